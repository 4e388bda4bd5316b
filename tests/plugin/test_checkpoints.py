"""Checkpoints under the compiled strategy are interchangeable with eager ones."""

from __future__ import annotations

import lightning as L
import torch

from boring import TRAINER_KWARGS, TinyModule, make_loader, params_of
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from lightning_plugin import CompiledStrategy
from lightning_plugin.compile.checkpoint_keys import align_to_module, strip_compile_prefix

CKPT_KWARGS = {**TRAINER_KWARGS, "enable_checkpointing": True}


def test_saved_keys_are_clean_and_load_into_an_eager_module(tmp_path):
    module = TinyModule()
    trainer = L.Trainer(
        strategy=CompiledStrategy(backend="aot_eager"), default_root_dir=tmp_path, **CKPT_KWARGS
    )
    trainer.fit(module, make_loader())
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert not any("_orig_mod" in k for k in state)
    assert set(state) == set(TinyModule().state_dict())
    eager = TinyModule.load_from_checkpoint(path)
    for key, value in params_of(module).items():
        torch.testing.assert_close(eager.state_dict()[key], value, rtol=0, atol=0)


def test_user_compiled_submodule_saves_clean_keys_and_loads_both_ways(tmp_path):
    module = TinyModule()
    module.net = torch.compile(module.net, backend="aot_eager")
    assert any("_orig_mod" in k for k in module.state_dict())
    trainer = L.Trainer(
        strategy=CompiledStrategy(backend="aot_eager"), default_root_dir=tmp_path, **CKPT_KWARGS
    )
    trainer.fit(module, make_loader())
    path = tmp_path / "user_compiled.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert not any("_orig_mod" in k for k in state)
    # Resume that clean checkpoint into the user's compiled module under the strategy.
    again = TinyModule()
    again.net = torch.compile(again.net, backend="aot_eager")
    resumed = L.Trainer(
        strategy=CompiledStrategy(backend="aot_eager"),
        default_root_dir=tmp_path,
        **{**CKPT_KWARGS, "max_epochs": 2},
    )
    resumed.fit(again, make_loader(), ckpt_path=path)
    assert resumed.global_step == 2 * trainer.global_step


def test_eager_checkpoint_resumes_under_the_strategy_and_training_continues(tmp_path):
    torch.manual_seed(0)
    reference = TinyModule()
    L.Trainer(default_root_dir=tmp_path, **{**CKPT_KWARGS, "max_epochs": 2}).fit(reference, make_loader())

    torch.manual_seed(0)
    first_half = TinyModule()
    eager_trainer = L.Trainer(default_root_dir=tmp_path, **CKPT_KWARGS)
    eager_trainer.fit(first_half, make_loader())
    path = tmp_path / "eager.ckpt"
    eager_trainer.save_checkpoint(path)

    resumed = TinyModule()
    strategy = CompiledStrategy()  # inductor
    trainer = L.Trainer(strategy=strategy, default_root_dir=tmp_path, **{**CKPT_KWARGS, "max_epochs": 2})
    trainer.fit(resumed, make_loader(), ckpt_path=path)
    assert trainer.global_step == 6
    assert strategy.compile_stats.graphs >= 1
    # Same weights as one uninterrupted eager run of 2 epochs (optimizer momentum restored too), within the
    # rounding of Inductor's fused sums over its 6 steps (batches of 8 images of 8x8).
    tol = trajectory_tolerance(torch.float32, network_length(reference, (8, 3, 8, 8)), trainer.global_step)
    for key, value in params_of(reference).items():
        torch.testing.assert_close(resumed.state_dict()[key], value, atol=bound(tol, value), rtol=0, msg=key)


def test_key_helpers():
    module = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2), backend="eager"))
    clean = strip_compile_prefix(module.state_dict())
    assert set(clean) == {"0.weight", "0.bias"}
    assert set(align_to_module(clean, module)) == set(module.state_dict())
