"""Every registered name starts and fits; strategy, Trainer and callbacks pickle and deep-copy."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry

from boring import TRAINER_KWARGS, LinearModule, TinyModule, make_loader, make_vector_loader
from lightning_plugin import CompiledDDPStrategy, CompiledStrategy

SINGLE_DEVICE_NAMES = [
    "compiled",
    "compiled_max_autotune",
    "compiled_reduce_overhead",
    "compiled_regional",
    "compiled_step",
]
ONE_PROCESS_DDP_NAMES = [
    "compiled_ddp",
    "compiled_ddp_find_unused_parameters_true",
]  # popen: would relaunch pytest
TWO_PROCESS_DDP_NAMES = ["compiled_ddp_spawn", "compiled_ddp_fork", "compiled_ddp_notebook"]
FSDP_NAMES = ["compiled_fsdp", "compiled_fsdp_activation_checkpointing"]  # lightning namespace only
HERE = os.path.dirname(__file__)


def test_the_lists_cover_every_registered_name():
    ours = {n for n in StrategyRegistry.available_strategies() if n.startswith("compiled")}
    assert ours == set(SINGLE_DEVICE_NAMES + ONE_PROCESS_DDP_NAMES + TWO_PROCESS_DDP_NAMES + FSDP_NAMES)


@pytest.fixture
def restores_process_state():
    """DDP on one process leaves a process group and MASTER_* variables behind: clear them afterwards."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.mark.parametrize("name", [*SINGLE_DEVICE_NAMES, *ONE_PROCESS_DDP_NAMES, "compiled_fsdp"])
def test_name_fits_in_one_process(name, restores_process_state):
    trainer = L.Trainer(**{**TRAINER_KWARGS, "strategy": name, "limit_train_batches": 2})
    module = LinearModule()
    trainer.fit(module, make_vector_loader())
    assert trainer.global_step == 2
    stats = trainer.strategy.compile_stats
    assert stats.graphs + stats.reused_frames >= 1 and not stats.skipped_frames
    assert "forward" not in module.__dict__
    if name == "compiled_step":  # each step one graph, not the compiled forward it falls back to
        assert stats.one_graph_fallback is None and stats.one_graph_steps == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_names_fit_on_two_cpu_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "names_script.py"), str(tmp_path), *TWO_PROCESS_DDP_NAMES],
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in TWO_PROCESS_DDP_NAMES:
        with open(tmp_path / f"{name}.json") as f:
            seen = json.load(f)
        assert seen["world_size"] == 2, name
        assert seen["steps"] == 2, name  # 16 samples, 2 ranks, batch 4, limit 2
        assert seen["compiled"] >= 1 and not seen["skipped"], (name, seen)
        assert seen["forward_patched"], name  # at the end of training, still the compiled forward


@pytest.mark.parametrize(
    "strategy",
    [
        CompiledStrategy(),
        CompiledStrategy(backend="aot_eager", regional=True),
        CompiledDDPStrategy(start_method="spawn"),
    ],
    ids=["compiled", "compiled-regional", "compiled_ddp_spawn"],
)
def test_strategy_pickles_and_deep_copies(strategy):
    for clone in (pickle.loads(pickle.dumps(strategy)), copy.deepcopy(strategy)):
        assert type(clone) is type(strategy) and clone.compile_config == strategy.compile_config


class HoldsTrainer(Callback):
    """A callback that keeps a reference to the trainer, as many do."""

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer


class CopiesTrainerDuringFit(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.pickled = pickle.loads(pickle.dumps(trainer))
        self.copied_callbacks = copy.deepcopy(trainer.callbacks)


@pytest.mark.parametrize(
    "strategy",
    [lambda: "auto", lambda: CompiledStrategy(backend="aot_eager")],
    ids=["lightning-own", "compiled"],
)
def test_trainer_and_callbacks_pickle_and_deep_copy_during_fit(strategy):
    copier = CopiesTrainerDuringFit()
    trainer = L.Trainer(
        **{
            **TRAINER_KWARGS,
            "strategy": strategy(),
            "callbacks": [HoldsTrainer(), copier],
            "limit_train_batches": 1,
        }
    )
    trainer.fit(TinyModule(), make_loader())
    assert type(copier.pickled.strategy) is type(trainer.strategy)
    assert len(copier.copied_callbacks) == len(trainer.callbacks)
