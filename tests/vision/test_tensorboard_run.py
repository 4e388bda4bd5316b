"""What ``lcv fit`` leaves in TensorBoard, read back with TensorBoard's own reader: one event file per run, only
changing values as curves, the compiler's card, and an HParams row per run that a sweep can be sorted by.

Two short fits with two learning rates into one log folder, shared by every test here (a module fixture).
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

from lcv_args import TINY_QUIET
from lcv_vision.cli import run
from lcv_vision.run_logs import HEADLINE

pytestmark = pytest.mark.xdist_group("tensorboard")

LEARNING_RATES = (0.2, 0.05)
#: The module's and Lightning's tags: the user's, whatever they hold.
USER_PREFIXES = ("train/", "val/", "test/", "epoch")


def _events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("lcv_tb")
    argv, cwd = sys.argv, Path.cwd()
    sys.argv = ["lcv"]  # LightningCLI must not read pytest's arguments
    try:
        import os

        os.chdir(root)
        dirs = []
        for lr in LEARNING_RATES:
            cli = run(
                [
                    "fit",
                    "--recipe",
                    "digits-small",
                    "--trainer.max_epochs",
                    "2",
                    "--trainer.limit_train_batches",
                    "3",
                    "--trainer.log_every_n_steps",
                    "1",
                    "--model.lr",
                    str(lr),
                    *TINY_QUIET,
                ]
            )
            assert cli is not None
            dirs.append(Path(cli.trainer.logger.log_dir).resolve())
    finally:
        os.chdir(cwd)
        sys.argv = argv
    assert dirs[0].parent == dirs[1].parent  # runs/digits-small/version_0 and version_1
    return dirs


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
    for log_dir in runs:
        assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1, sorted(log_dir.iterdir())
        scalars = set(_events(log_dir).Tags()["scalars"])
        assert {"test/ema/acc", "test/final/acc", "test/ema/loss", "test/final/loss"} <= scalars
        assert "test/acc" not in scalars


def test_no_plugin_tag_is_a_flat_series(runs):
    acc = _events(runs[0])
    ours = [t for t in acc.Tags()["scalars"] if not t.startswith(USER_PREFIXES)]
    assert not [t for t in ours if t.startswith(("compile/", "final/"))]
    assert {"perf/step_time_ms", "perf/samples_per_sec", "perf/data_wait_fraction"} <= set(ours)
    for tag in ours:
        values = [e.value for e in acc.Scalars(tag)]
        if tag.startswith("summary/"):
            assert len(values) == 1, (tag, values)  # one value per run, for the HParams tab
        else:
            assert len(values) >= 2 and len(set(values)) > 1, (tag, values)  # a curve that moves


def test_curves_first_in_the_custom_scalars_layout(runs):
    acc = _events(runs[0])
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
    acc = _events(runs[0])
    cards = acc.Tensors("compile/report/text_summary")
    assert 1 <= len(cards) <= 2 and [c.step for c in cards] == sorted({c.step for c in cards})
    card = cards[-1].tensor_proto.string_val[0].decode()
    assert card.startswith("| | |\n|---|---|\n| compile or eager | ")  # the facts first, the decision on top
    assert "### Graph breaks" in card and "### Recompiles" in card
    assert re.search(r"\| graphs \| [1-9]", card) and "| on-disk compile caches |" in card
    kernels = card.split("| kernels | ")[1].split("\n")[0]
    assert "None tried" in kernels and "cpu" in kernels  # kernels='auto' on CPU: says why


def test_hparams_row_has_the_settings_without_internal_keys_and_the_results(runs):
    acc = _events(runs[0])
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
    wanted = {
        "summary/best_val_acc",
        "summary/samples_per_sec",
        "summary/compile_s",
        "test/ema/acc",
        "test/final/acc",
    }
    assert wanted <= set(columns), columns
    scalars = set(acc.Tags()["scalars"])
    assert set(columns) <= scalars  # every column has a value in the run
    assert 0.0 <= acc.Scalars("summary/best_val_acc")[-1].value <= 1.0


def test_two_learning_rates_give_two_rows_with_their_accuracies(runs):
    rows = []
    for log_dir in runs:
        acc = _events(log_dir)
        params, columns, _ = _hparams(acc)
        rows.append((params["lr"].number_value, columns, acc.Scalars("test/final/acc")[-1].value))
    assert [lr for lr, _, _ in rows] == pytest.approx(list(LEARNING_RATES))
    assert rows[0][1] == rows[1][1]  # the same columns: TensorBoard takes them from one run
    assert all(0.0 <= accuracy <= 1.0 for _, _, accuracy in rows)
