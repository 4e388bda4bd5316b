"""``kernels="auto"`` through the Trainer (first forward, sanity check, regional compile, the monitor, the
cache across fits) and under DDP (two gloo processes), with a fake clock."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lcv_vision.models.resnet import BasicBlock, ResNet
from lightning_plugin import KNOWN_KERNELS, CompileConfig, CompiledStrategy
from lightning_plugin.callbacks import TrainingMonitor
from lightning_plugin.kernel_choice import selection as kernel_selection
from lightning_plugin.kernel_choice.cache import CACHE_DIR_ENV
from lightning_plugin.kernel_choice.substitution import substituted_modules
from logged_process import LoggedProcess
from selection_helpers import FakeClock, chain, use_reference_ops

HERE = os.path.dirname(__file__)


@pytest.fixture
def reference_ops(monkeypatch):
    """The fused ops on their PyTorch references: these tests are about the flow, not the kernels."""
    use_reference_ops(monkeypatch)  # and no oneDNN: see its docstring


# ---------------------------------------------------------------------------------------------------------
# Under DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_ddp_ranks_run_rank_zeros_decisions(tmp_path):
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    script = os.path.join(HERE, "kernel_selection_ddp_script.py")
    # output to files: waiting on rank 0 must not leave rank 1 blocked on a full pipe (tests/logged_process.py)
    procs = [
        LoggedProcess([sys.executable, script, str(rank), port, str(tmp_path)], env=env) for rank in (0, 1)
    ]
    for proc in procs:
        code, output = proc.finish(timeout=280)
        assert code == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Rank 1's clock says the opposite of rank 0's; it is never asked, and runs rank 0's graph.
    assert ranks[0]["chosen"] == ["conv_bn_act", "eager"]
    assert ranks[1]["chosen"] == ranks[0]["chosen"]
    assert ranks[1]["rewritten"] == ranks[0]["rewritten"] == ["0"]
    assert ranks[0]["timer_calls"] == 4 and ranks[1]["timer_calls"] == 0


# ---------------------------------------------------------------------------------------------------------
# Through the Trainer


class BlockModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = chain(3, 4, 5)
        self.head = nn.Linear(5, 3)
        self.rewritten_in_training: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.rewritten_in_training.append(substituted_modules(self))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=4)


def _trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=2,
        limit_val_batches=1,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_auto_stays_none_on_cpu_through_the_trainer(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))

    def no_timing(*args, **kwargs):
        raise AssertionError("nothing is measured on CPU")

    monkeypatch.setattr(kernel_selection, "default_timer", lambda: no_timing)
    module = BlockModule()
    strategy = CompiledStrategy(backend="eager")
    _trainer(strategy=strategy, num_sanity_val_steps=1).fit(module, _loader(), _loader(4))
    assert strategy.kernel_decisions == [] and strategy.substituted_blocks() == []
    assert module.rewritten_in_training == [[], []]


@pytest.fixture
def auto_as_on_cuda(monkeypatch, tmp_path):
    """What "auto" resolves to on a GPU (every kernel), on this CPU, with a fake clock and a private cache."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(CompileConfig, "resolve_kernels", lambda self, device: frozenset(KNOWN_KERNELS))
    clock = FakeClock({"4x3x6x6": (1.0, 1.3), "4x4x6x6": (1.0, 0.9)})
    monkeypatch.setattr(kernel_selection, "default_timer", lambda: clock)
    return clock


def test_trainer_selects_at_the_first_forward_and_logs_the_decisions(
    auto_as_on_cuda, reference_ops, caplog, tmp_path
):
    clock = auto_as_on_cuda
    module = BlockModule()
    strategy = CompiledStrategy(backend="eager")
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    with caplog.at_level(logging.INFO):
        # The first forward is the sanity check: eval mode, under inference_mode; training is what is timed.
        monitor = TrainingMonitor(log_every_n_steps=1)
        trainer = _trainer(strategy=strategy, num_sanity_val_steps=1, logger=logger, callbacks=[monitor])
        trainer.fit(module, _loader(), _loader(4))
    assert len(clock.calls) == 4  # one selection, two signatures, two sides each
    decisions = strategy.kernel_decisions
    assert [(d.path, d.chosen) for d in decisions] == [("net.0", "conv_bn_act"), ("net.1", "eager")]
    assert {d.signature.mode for d in decisions} == {"train"}
    assert module.rewritten_in_training == [["net.0"], ["net.0"]]
    assert not strategy.compile_stats.fell_back and strategy.compile_stats.graph_breaks == 0
    assert substituted_modules(module) == []  # restored after fit
    assert "measuring 2 block signature(s)" in caplog.text
    assert "measured 2 block signature(s) in" in caplog.text
    assert "net.1" in caplog.text and "1.3x" in caplog.text  # the table

    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    text = acc.Tensors("compile/report/text_summary")[-1].tensor_proto.string_val[0].decode()
    # each candidate's measured time (fake clock: ms), the chosen kernel and why
    assert "| `net.0` | conv_bn_act | conv_bn_act | 1000.000 | 1300.000 | 1.3x | yes | faster |" in text
    assert "| `net.1` | conv_bn_act | eager | 1000.000 | 900.000 | 0.9x | yes | below 1.05x |" in text
    content = acc.PluginTagToContent("hparams")
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert hparams.session_start_info.hparams["compile/kernels"].string_value == "auto"

    # A second fit (a new run, or a resume) finds its decisions in the cache: nothing is measured.
    caplog.clear()
    clock.calls.clear()
    second = BlockModule()
    strategy = CompiledStrategy(backend="eager")
    with caplog.at_level(logging.INFO):
        _trainer(strategy=strategy, num_sanity_val_steps=0).fit(second, _loader())
    assert clock.calls == []
    assert "used cached decisions for 2 block signature(s)" in caplog.text
    assert second.rewritten_in_training == [["net.0"], ["net.0"]]
    assert all(d.cached for d in strategy.kernel_decisions)


class ResNetModule(L.LightningModule):
    def __init__(self, call_forward_directly: bool) -> None:
        super().__init__()
        self.net = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=3, width=4, stem="cifar")
        self.call_forward_directly = call_forward_directly
        self.rewritten_in_training: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.forward(x) if self.call_forward_directly else self(x)
        self.rewritten_in_training.append(substituted_modules(self))
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("call_forward_directly", [False, True], ids=["self(x)", "self.forward(x)"])
def test_regional_compile_selects_before_any_block_is_traced(
    call_forward_directly, auto_as_on_cuda, reference_ops
):
    clock = auto_as_on_cuda
    clock.default = (1.0, 1.2)  # every block measured is kept
    module = ResNetModule(call_forward_directly)
    strategy = CompiledStrategy(backend="eager", regional=True)
    data = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))), batch_size=4)
    blocks = [
        "net.layer1.0",
        "net.layer2.0",
        "net.layer2.0.downsample",
        "net.layer3.0",
        "net.layer3.0.downsample",
        "net.layer4.0",
        "net.layer4.0.downsample",
    ]
    if call_forward_directly:
        # The root's pre-hook never fires and the first compiled block cannot know its neighbours' inputs:
        # nothing is measured, so nothing stays fused.
        with pytest.warns(UserWarning, match="was not called as a module"):
            _trainer(strategy=strategy, num_sanity_val_steps=0).fit(module, data)
        assert clock.calls == [] and module.rewritten_in_training == [[], []]
        assert not any(d.fused for d in strategy.kernel_decisions)
        return
    _trainer(strategy=strategy, num_sanity_val_steps=0).fit(module, data)
    assert clock.calls
    assert module.rewritten_in_training == [blocks, blocks]  # the stem's ResNet rewrite holds the rest: eager
    # Blocks are measured on copies without the compiler's wrappers (or their gradients would go to the
    # model's blocks); the recording forward compiled nothing (else training would recompile for grad mode).
    assert all(d.correct for d in strategy.kernel_decisions if d.signature is not None)
    assert not [r for r in strategy.compile_stats.recompile_reasons if "grad_mode" in r]


def test_validate_alone_times_the_forward_in_eval_mode(auto_as_on_cuda, reference_ops):
    strategy = CompiledStrategy(backend="eager")
    _trainer(strategy=strategy).validate(BlockModule(), _loader(4))
    assert {d.signature.mode for d in strategy.kernel_decisions} == {"eval"}
    assert [d.chosen for d in strategy.kernel_decisions] == ["conv_bn_act", "eager"]
