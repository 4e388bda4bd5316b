"""Strategy registration, resolution by name/instance/CLI, and device resolution."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from boring import TinyModule
from lightning_plugin import CompileConfig, CompiledDDPStrategy, CompiledStrategy


@pytest.mark.parametrize(
    ("name", "cls", "init_params"),
    [
        ("compiled", CompiledStrategy, {}),
        ("compiled_max_autotune", CompiledStrategy, {"mode": "max-autotune"}),
        ("compiled_reduce_overhead", CompiledStrategy, {"mode": "reduce-overhead"}),
        ("compiled_regional", CompiledStrategy, {"regional": True}),
        ("compiled_ddp", CompiledDDPStrategy, {"start_method": "popen"}),
        ("compiled_ddp_spawn", CompiledDDPStrategy, {"start_method": "spawn"}),
    ],
)
def test_registered_on_import(name, cls, init_params):
    assert name in StrategyRegistry
    assert StrategyRegistry[name]["strategy"] is cls
    assert StrategyRegistry[name]["init_params"] == init_params


def test_trainer_resolves_name_to_a_fresh_strategy():
    trainer = L.Trainer(strategy="compiled", accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, CompiledStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.compile_config == CompileConfig()
    variant = L.Trainer(strategy="compiled_max_autotune", accelerator="cpu", logger=False)
    assert variant.strategy.compile_config.mode == "max-autotune"


def test_trainer_accepts_an_instance():
    strategy = CompiledStrategy(mode="max-autotune", fullgraph=True, fallback="raise")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", logger=False)
    assert trainer.strategy is strategy
    assert strategy.compile_config.fullgraph and strategy.compile_config.fallback == "raise"


def test_config_and_keywords_are_exclusive():
    with pytest.raises(ValueError, match="or as keyword arguments, not both"):
        CompiledStrategy(config=CompileConfig(), mode="max-autotune")
    with pytest.raises(TypeError, match="config must be a CompileConfig"):
        CompiledStrategy(config={"mode": "max-autotune"})


def test_lightning_cli_class_path(tmp_path):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        TinyModule,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.strategy=lightning_plugin.CompiledStrategy",
            "--trainer.strategy.mode=max-autotune",
            "--trainer.strategy.channels_last=true",
        ],
    )
    assert isinstance(cli.trainer.strategy, CompiledStrategy)
    assert cli.trainer.strategy.compile_config.mode == "max-autotune"
    assert cli.trainer.strategy.compile_config.channels_last is True


@pytest.fixture
def one_cuda_device(monkeypatch):
    """Pretend there is one CUDA device, the way Lightning's own tests mock it."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pl_cuda

    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_device_follows_the_accelerator(one_cuda_device):
    # The pitfall (Lightning #18902): the built-in single_device strategy resolved by name stays on the CPU.
    assert L.Trainer(
        accelerator="cuda", devices=1, strategy="single_device", logger=False
    ).strategy.root_device == (torch.device("cpu"))
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy="compiled", logger=False)
    assert trainer.strategy.root_device == torch.device("cuda", 0)
    by_instance = L.Trainer(accelerator="cuda", devices=1, strategy=CompiledStrategy(), logger=False)
    assert by_instance.strategy.root_device == torch.device("cuda", 0)


def test_explicit_device_wins():
    strategy = CompiledStrategy(device="cpu")
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, logger=False)
    assert trainer.strategy.root_device == torch.device("cpu")


def test_auto_kernels_resolve_by_device():
    config = CompileConfig()
    assert config.resolve_kernels(torch.device("cpu")) == frozenset()
    assert "conv_bn_act" in config.resolve_kernels(torch.device("cuda", 0))
    assert CompileConfig(kernels="all").resolve_kernels(torch.device("cpu")) == frozenset(
        ("conv_bn_act", "batch_norm_act", "group_norm_act", "layer_norm2d_act")
    )


def test_several_devices_point_to_the_ddp_sibling():
    with pytest.raises(ValueError, match="compiled_ddp"):
        L.Trainer(accelerator="cpu", devices=2, strategy="compiled", logger=False)
