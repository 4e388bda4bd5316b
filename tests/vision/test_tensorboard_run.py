"""What ``lcv fit`` leaves in TensorBoard, read back with TensorBoard's own reader: one event file per run, the
module's curves in the first sections, only changing values as curves (the learning rate a curve over steps),
the compiler's card, and an HParams row per run with the same columns, that a sweep can be sorted by.

Two short fits with different settings (learning rate, compile) into one log folder, shared by every test here
(a module fixture). The Trainer's logging interval is left at its default (50): ``lcv`` lowers it to the
epoch's 3 batches, and the monitor's curves must follow.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

pytest.importorskip(
    "jsonargparse", reason="the lcv CLI needs jsonargparse (a dependency of lightning[pytorch-extra])"
)

import torch

import lcv_vision.data.compiled as compiled_data
from lcv_args import TINY_QUIET
from lcv_vision.cli import run
from lcv_vision.module import lr_factor
from lcv_vision.run_logs import COLUMNS, HEADLINE

pytestmark = pytest.mark.xdist_group("tensorboard")

LEARNING_RATES = (0.2, 0.05)
#: Per run, beside its learning rate: the second is not compiled, so it measures no compile speed-up. The first
#: compiles with ``aot_eager`` (dynamo's graphs, breaks and recompiles, without Inductor's C++ build): what the
#: logs hold is the subject; tests/vision/test_quiet_main_job.py runs ``lcv fit`` through Inductor.
SETTINGS = (["--trainer.strategy.backend", "aot_eager"], ["--trainer.strategy.compile", "never"])
EPOCHS, BATCHES = 2, 3
#: The module's tags: the user's, whatever they hold.
USER_PREFIXES = ("train/", "val/")


def _events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[tuple[Path, dict]]:
    """Per run: its log folder and the module's hyperparameters."""
    root = tmp_path_factory.mktemp("lcv_tb")
    dirs = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["lcv"])  # LightningCLI must not read pytest's arguments
        patch.chdir(root)
        patch.setattr(compiled_data, "BACKEND", "aot_eager")  # the data pipeline traced too, not built
        for lr, settings in zip(LEARNING_RATES, SETTINGS, strict=True):
            cli = run(
                [
                    "fit",
                    "--recipe",
                    "digits-small",
                    "--trainer.max_epochs",
                    str(EPOCHS),
                    "--trainer.limit_train_batches",
                    str(BATCHES),
                    "--model.lr",
                    str(lr),
                    *settings,
                    *TINY_QUIET,
                ]
            )
            assert cli is not None
            dirs.append((Path(cli.trainer.logger.log_dir).resolve(), dict(cli.model.hparams)))
    assert dirs[0][0].parent == dirs[1][0].parent  # runs/digits-small/version_0 and version_1
    return dirs


def _sections(tags: list[str]) -> list[str]:
    """TensorBoard's Time Series sections in its order: the tags sorted by its ``compareTagNames`` (a ``/``
    sorts before any other character; its numeric comparison of digit runs is left out: no section name here
    has digits, so it could only reorder cards inside a section) and grouped by their first part."""
    ordered = sorted(tags, key=lambda tag: [(c != "/", c) for c in tag])
    return list(dict.fromkeys(tag.split("/", 1)[0] for tag in ordered))


def _hparams(acc: EventAccumulator) -> tuple[dict, list[str], set[str]]:
    """The run's settings, the table's metric columns, and the settings it shows first."""
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    columns = [m.name.tag for m in experiment.metric_infos]
    return (
        dict(start.session_start_info.hparams),
        columns,
        {i.name for i in experiment.hparam_infos if i.differs},
    )


def test_each_run_is_one_event_file_with_both_tests_told_apart(runs):
    for log_dir, _ in runs:
        assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1, sorted(log_dir.iterdir())
        scalars = set(_events(log_dir).Tags()["scalars"])
        tests = {"whole_run/test_ema_acc", "whole_run/test_final_acc", "whole_run/test_ema_loss"}
        assert tests | {"whole_run/test_final_loss"} <= scalars
        assert not [t for t in scalars if t.startswith("test/")]


def test_the_first_sections_are_the_module_curves(runs):
    acc = _events(runs[0][0])
    tags = acc.Tags()
    assert "epoch" not in tags["scalars"]  # Lightning's staircase of the step: not written by lcv's logger
    sections = _sections([*tags["scalars"], *tags["images"]])
    assert sections[:2] == ["train", "val"], sections  # then vitals, whole_run
    assert set(sections) == {"train", "val", "vitals", "whole_run"}, sections


def test_the_learning_rate_is_a_curve_that_follows_the_schedule(runs):
    log_dir, hp = runs[0]
    acc = _events(log_dir)
    total = EPOCHS * BATCHES
    for tag, scale in (("vitals/lr_opt0_group0", 1.0), ("vitals/lr_opt0_group1", hp["bias_lr_scale"])):
        points = acc.Scalars(tag)
        # logged with the other step series, once per epoch here (lcv's interval: 3 batches an epoch)
        assert [p.step for p in points] == list(range(BATCHES, total + 1, BATCHES)), (tag, points)
        # at step g the rate after g optimizer steps (Lightning steps a per-step schedule before the
        # batch-end hooks): the schedule's value at g, as the next step will use it
        expected = [hp["lr"] * scale * lr_factor(p.step, total, BATCHES, _Hp(hp)) for p in points]
        eps = torch.finfo(torch.float32).eps  # the event file stores float32
        assert [p.value for p in points] == pytest.approx(expected, rel=4 * eps), tag
        assert len({p.value for p in points}) == len(points)


class _Hp:
    """The module's hyperparameters as attributes, for ``lr_factor``."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


def test_no_plugin_tag_is_a_flat_series(runs):
    acc = _events(runs[0][0])
    ours = [t for t in acc.Tags()["scalars"] if not t.startswith(USER_PREFIXES)]
    assert not [t for t in ours if t.startswith(("compile/", "final/"))]
    assert {"vitals/step_time_ms", "vitals/samples_per_sec", "vitals/data_wait_fraction"} <= set(ours)
    for tag in ours:
        values = [e.value for e in acc.Scalars(tag)]
        if tag.startswith("whole_run/"):
            assert len(values) == 1, (tag, values)  # one value per run, for the HParams tab
        else:
            assert len(values) >= 2 and len(set(values)) > 1, (tag, values)  # a curve that moves


def test_curves_first_in_the_custom_scalars_layout(runs):
    acc = _events(runs[0][0])
    content = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(content)
    curves = layout.category[0]
    assert curves.title == "Curves"
    loss, accuracy = curves.chart[0], curves.chart[1]
    scalars = acc.Tags()["scalars"]
    drawn = {
        chart.title: [t for t in scalars if re.search(chart.multiline.tag[0], t)]
        for chart in (loss, accuracy)
    }
    assert sorted(drawn[loss.title]) == ["train/loss", "val/loss"]
    assert sorted(drawn[accuracy.title]) == ["train/acc", "val/acc"]


def test_the_compile_card_is_written_when_known_and_at_the_end(runs):
    acc = _events(runs[0][0])
    cards = acc.Tensors("compile/report/text_summary")
    assert 1 <= len(cards) <= 2 and [c.step for c in cards] == sorted({c.step for c in cards})
    card = cards[-1].tensor_proto.string_val[0].decode()
    assert card.startswith("| | |\n|---|---|\n| compile or eager | ")  # the facts first, the decision on top
    assert "### Graph breaks" in card and "### Recompiles" in card
    assert re.search(r"\| graphs \| [1-9]", card) and "| on-disk compile caches |" in card
    kernels = card.split("| kernels | ")[1].split("\n")[0]
    assert "None tried" in kernels and "cpu" in kernels  # kernels='auto' on CPU: says why


def test_hparams_row_has_the_settings_without_internal_keys_and_the_results(runs):
    acc = _events(runs[0][0])
    params, columns, shown_first = _hparams(acc)
    assert shown_first == set(HEADLINE)  # TensorBoard shows these five before the reader picks others
    assert not [k for k in params if k.startswith("_") or "/_" in k], sorted(params)
    for key in (
        "recipe",
        "model",
        "lr",
        "optimizer",
        "data/batch_size",
        "compile/compile",
        "compile/kernels",
    ):
        assert key in params, sorted(params)
    assert params["recipe"].string_value == "digits-small"
    wanted = [
        "whole_run/test_ema_acc",
        "whole_run/test_final_acc",
        "whole_run/best_val_acc",
        "whole_run/samples_per_sec",
        "whole_run/compile_s",
    ]
    assert columns[: len(wanted)] == wanted, columns
    scalars = set(acc.Tags()["scalars"])
    missing = set(columns) - scalars
    assert missing <= {"whole_run/compile_speedup"}, missing  # a speed-up only where compile="auto" timed one
    assert 0.0 <= acc.Scalars("whole_run/best_val_acc")[-1].value <= 1.0


def test_two_runs_with_different_settings_give_two_rows_with_the_same_columns(runs):
    """TensorBoard takes the table's columns (and settings) from the first run's record it finds: every run's
    must be the same, whatever the run measured, or a sweep cannot be sorted by a column."""
    rows = []
    for log_dir, _ in runs:
        acc = _events(log_dir)
        content = acc.PluginTagToContent("hparams")
        end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"])
        assert end.session_end_info.status == 1  # STATUS_SUCCESS
        params, columns, _ = _hparams(acc)
        accuracy = acc.Scalars("whole_run/test_final_acc")[-1].value
        rows.append(
            (params["lr"].number_value, params["compile/compile"].string_value, params, columns, accuracy)
        )
    assert [row[:2] for row in rows] == [
        (pytest.approx(lr), c) for lr, c in zip(LEARNING_RATES, ("auto", "never"))
    ]
    assert rows[0][3] == rows[1][3] == list(COLUMNS)  # the same columns, in lcv's order
    assert sorted(rows[0][2]) == sorted(rows[1][2])  # the same settings
    assert all(0.0 <= row[4] <= 1.0 for row in rows)
