"""Every TensorBoard tag ``TrainingMonitor`` writes on a small compiled fit, pinned: dashboards and saved
TensorBoard links use these names, so a refactor of the monitor must not rename, add or drop one unnoticed.

Pinned on the monitor before it was split into a step meter and thin callbacks; the split must keep the list.
Tags that need CUDA (``memory/*``) are checked by ``test_monitor.py``'s mocked-device test;
``compile/kernel_decisions`` by ``test_kernel_selection_trainer.py``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.plugins.hparams import plugin_data_pb2

from lightning_plugin import CompiledStrategy, CompileStats
from lightning_plugin.callbacks import CompileReport, HParamsRecord, ImageGrid, StepMonitor, TrainingMonitor
from test_monitor import ImageData, WithGraphBreak, _events

#: ``compile/<field>`` and ``final/compile_<field>`` for every field of ``CompileStats.as_dict()``: the
#: monitor follows the stats, so a field added there shows up here by design.
COMPILE_FIELDS = set(CompileStats().as_dict())
SCALARS = {
    # the monitor's own
    "perf/step_time_ms",
    "perf/samples_per_sec",
    "perf/data_wait_fraction",
    "perf/flops_per_sec",
    "perf/mfu",
    "optim/lr",
    "compile/graph_time_s",
    *(f"compile/{field}" for field in COMPILE_FIELDS),
    # the HParams tab's metrics, which Lightning also writes as scalars
    "final/train_loss",
    "final/val_loss",
    *(f"final/compile_{field}" for field in COMPILE_FIELDS),
    # the module's and Lightning's (not the monitor's, listed so the set is complete)
    "train_loss",
    "val_loss",
    "epoch",
}
TEXTS = {"compile/graphs", "compile/break_reasons", "compile/recompile_reasons"}
IMAGES = {"samples/augmented"}
HPARAMS = {
    "lr",
    "step_sleep",
    "data/delay",
    "trainer/strategy",
    "trainer/precision",
    "trainer/max_epochs",
    "trainer/batch_size",
    "compile/backend",
    "compile/mode",
    "compile/fullgraph",
    "compile/dynamic",
    "compile/regional",
    "compile/fallback",
    "compile/kernels",
}
FINAL_METRICS = {
    "final/train_loss",
    "final/val_loss",
    *(f"final/compile_{field}" for field in COMPILE_FIELDS),
}


def _hparams_session(acc) -> plugin_data_pb2.HParamsPluginData:
    content = acc.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    return plugin_data_pb2.HParamsPluginData.FromString(content)


def _fit_and_read_tags(root: Path, callbacks: list[pl.Callback]) -> dict[str, set[str]]:
    logger = TensorBoardLogger(str(root), name="tags", version=0)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        strategy=CompiledStrategy(backend="eager"),
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=2,
        num_sanity_val_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(WithGraphBreak(step_sleep=0.0), datamodule=ImageData(delay=0.0))
    acc = _events(Path(logger.log_dir))
    tags = acc.Tags()
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        acc.SummaryMetadata("_hparams_/experiment").plugin_data.content
    ).experiment
    return {
        "scalars": set(tags["scalars"]),
        "texts": {t.removesuffix("/text_summary") for t in tags["tensors"] if t.endswith("/text_summary")},
        "images": set(tags["images"]),
        "hparams": set(_hparams_session(acc).session_start_info.hparams),
        "final": {m.name.tag for m in experiment.metric_infos},
    }


def test_the_monitor_writes_exactly_these_tags(tmp_path):
    tags = _fit_and_read_tags(tmp_path, [TrainingMonitor(log_every_n_steps=2, peak_flops=1e12, num_images=4)])
    assert tags["scalars"] == SCALARS
    assert {"compile/graphs", "compile/graph_breaks", "compile/recompiles", "compile/compile_time_s"} <= (
        tags["scalars"]
    )
    assert tags["texts"] == TEXTS
    assert tags["images"] == IMAGES
    assert tags["hparams"] == HPARAMS
    assert tags["final"] == FINAL_METRICS


def test_the_four_parts_alone_write_the_same_tags(tmp_path):
    steps = StepMonitor(peak_flops=1e12)
    grid, report = ImageGrid(num_images=4, meter=steps.meter), CompileReport(meter=steps.meter)
    parts = [steps, grid, report, HParamsRecord()]
    tags = _fit_and_read_tags(tmp_path, parts)
    assert tags == {
        "scalars": SCALARS,
        "texts": TEXTS,
        "images": IMAGES,
        "hparams": HPARAMS,
        "final": FINAL_METRICS,
    }
