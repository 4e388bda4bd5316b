"""The monitor's TensorBoard output beyond its tag list: one set of events under DDP, the user's own metrics
untouched, a rarely changing value logged only where it changes, and the compile card's content for decisions
a CPU test cannot measure (rendered from records)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from boring import TRAINER_KWARGS, TinyModule, make_loader
from lightning_plugin import CompiledStrategy, CompileStats
from lightning_plugin.callbacks import TrainingMonitor
from lightning_plugin.callbacks.compile_card import CompileFacts, render_compile_card
from lightning_plugin.compile.decision import CompileDecision
from lightning_plugin.kernel_choice.selection import KernelDecision

pytestmark = pytest.mark.xdist_group("tensorboard")

HERE = os.path.dirname(__file__)
MY_VALUES = [0.5, 0.25, 0.125, 0.125, 3.0]  # repeats on purpose: what the user logs is theirs


def _events(log_dir: str | Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


@pytest.mark.timeout(300)
def test_ddp_writes_one_set_of_events_from_rank_zero(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    script = os.path.join(HERE, "tensorboard_ddp_script.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].parent == Path("ddp/version_0"), files
    acc = _events(tmp_path / "ddp" / "version_0")
    steps = [e.step for e in acc.Scalars("vitals/step_time_ms")]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4]  # 32 samples / 2 ranks / batch 4: each step once
    assert len(acc.Tensors("compile/report/text_summary")) >= 1
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")


class LogsMyMetric(TinyModule):
    """Logs ``my/metric`` with known values, one per training step."""

    def training_step(self, batch, batch_idx):
        self.log("my/metric", MY_VALUES[batch_idx])
        return super().training_step(batch, batch_idx)


def test_what_the_user_logs_is_unchanged(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="mine", version=0)
    kwargs = {**TRAINER_KWARGS, "logger": logger, "log_every_n_steps": 1}
    trainer = L.Trainer(
        **kwargs, strategy=CompiledStrategy(backend="eager"), callbacks=[TrainingMonitor(log_images=False)]
    )
    trainer.fit(LogsMyMetric(), make_loader(n=5 * 4, batch_size=4))
    events = _events(logger.log_dir).Scalars("my/metric")
    assert [(e.step, e.value) for e in events] == [(i, v) for i, v in enumerate(MY_VALUES)]


def _stats() -> CompileStats:
    stats = CompileStats()
    stats.decision, stats.speedup = "eager", 0.8
    return stats


def test_the_card_shows_a_measured_decision_with_its_median_times():
    decision = CompileDecision("eager", "measured", 0.8, compiled_ms=12.5, eager_ms=10.0, steps=4)
    card = render_compile_card(CompileFacts(_stats(), decision, device=torch.device("cpu")))
    assert (
        "| compile or eager | **eager**: compiled steps **0.80x** the speed of eager; median step 12.5 ms "
        "compiled, 10.0 ms eager (4 steps each, measured in this run;"
    ) in card
    assert "| graph breaks | 0 |" in card and "### Recompiles\n\nnone" in card


def test_the_card_names_each_block_s_kernel_and_the_times_of_both_candidates():
    kept = KernelDecision(
        "layer1.0", "conv_bn_act", "conv_bn_act", None, 1.4, True, "faster", False, 1.0, 1.4
    )
    wrong = KernelDecision("layer1.1", "conv_bn_act", "eager", None, None, False, "differs | at x", True)
    untimed = KernelDecision("fc", "batch_norm_act", "eager", None, reason="not called in the first forward")
    facts = CompileFacts(_stats(), kernels=[kept, wrong, untimed], device=torch.device("cuda"))
    card = render_compile_card(facts)
    assert "| kernels | 1 of 3 rewritten block(s) kept fused (table below) |" in card
    assert "| `layer1.0` | conv_bn_act | conv_bn_act | 1.000 | 1.400 | 1.4x | yes | faster |" in card
    assert "| `layer1.1` | conv_bn_act | eager | - | - | - | no | differs \\| at x (cached) |" in card
    assert "| `fc` | batch_norm_act | eager | - | - | - | - | not called in the first forward |" in card


@pytest.mark.parametrize(
    ("setting", "device", "why"),
    [
        ("auto", "cpu", "CUDA only (this run is on cpu"),
        ("auto", "cuda", "no block of this model has a fused kernel"),
        ("none", "cuda", "kernel substitution is off"),
    ],
)
def test_the_card_says_why_no_kernel_was_tried(setting, device, why):
    facts = CompileFacts(_stats(), kernels_setting=setting, device=torch.device(device))
    card = render_compile_card(facts)
    assert why in card.split("| kernels | ")[1].split("\n")[0] and "### Kernel choice" not in card


def test_substituted_blocks_without_a_selection_are_listed():
    block = SimpleNamespace(path="stem", kind="conv_bn_act")
    facts = CompileFacts(_stats(), substituted=[block], kernels_setting="all", device=torch.device("cpu"))
    assert "| `stem` | conv_bn_act |" in render_compile_card(facts)


def test_a_rarely_changing_value_is_logged_where_it_changes():
    from lightning_plugin.callbacks.change_points import ChangePoints

    constant, schedule = ChangePoints(), ChangePoints()
    logged_constant, logged_schedule = {}, {}
    for step, lr in [(10, 0.1), (20, 0.1), (30, 0.1), (40, 0.01), (50, 0.01), (60, 0.01)]:
        logged_constant.update(constant.points(step, {"vitals/lr": 0.5}))
        logged_schedule.update(schedule.points(step, {"vitals/lr": lr}))
    logged_constant.update(constant.end())
    logged_schedule.update(schedule.end())
    assert logged_constant == {10: {"vitals/lr": 0.5}}  # one point, no flat line
    # a step, drawn as a step: the old value's last point, the new value's first, and the end
    assert logged_schedule == {
        10: {"vitals/lr": 0.1},
        30: {"vitals/lr": 0.1},
        40: {"vitals/lr": 0.01},
        60: {"vitals/lr": 0.01},
    }
