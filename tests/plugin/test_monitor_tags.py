"""Every TensorBoard tag ``TrainingMonitor`` writes on a small compiled fit, pinned: dashboards and saved
TensorBoard links use these names, so a refactor of the monitor must not rename, add or drop one unnoticed.

Only what changes is a curve: the compiler's counters are in the ``compile/report`` card, and what is one
value per run is a one-point ``whole_run/*`` scalar that the HParams tab shows. Tags that need CUDA
(``vitals/peak_memory_gib``) are checked by ``test_monitor.py``'s mocked-device test; the card's kernel table by
``test_kernel_selection_trainer.py``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.plugins.hparams import plugin_data_pb2

from lightning_plugin import CompiledStrategy
from lightning_plugin.callbacks import (
    CompileReport,
    HParamsRecord,
    ImageGrid,
    ScalarLayout,
    StepMonitor,
    TrainingMonitor,
)
from test_monitor import ImageData, WithGraphBreak, _events

SCALARS = {
    # the monitor's own curves
    "vitals/step_time_ms",
    "vitals/samples_per_sec",
    "vitals/data_wait_fraction",
    "vitals/flops_per_sec",
    "vitals/mfu",
    "vitals/lr",
    # one point each: the HParams tab's values that are no curve
    "whole_run/samples_per_sec",
    "whole_run/compile_s",
    # the module's and Lightning's (not the monitor's, listed so the set is complete)
    "train_loss",
    "val_loss",
    "epoch",
}
TEXTS = {"compile/report"}
IMAGES = {"vitals/train_batch"}
HPARAMS = {
    "lr",
    "step_sleep",
    "data/delay",
    "trainer/strategy",
    "trainer/precision",
    "trainer/max_epochs",
    "trainer/batch_size",
    "compile/compile",
    "compile/backend",
    "compile/mode",
    "compile/fullgraph",
    "compile/dynamic",
    "compile/regional",
    "compile/fallback",
    "compile/kernels",
}
#: The HParams tab's columns: the module's own curves (their last value) and the summary values.
METRICS = {"train_loss", "val_loss", "whole_run/samples_per_sec", "whole_run/compile_s"}
EXPECTED = {
    "scalars": SCALARS,
    "texts": TEXTS,
    "images": IMAGES,
    "hparams": HPARAMS,
    "metrics": METRICS,
    "layout": {"custom_scalars__config__"},  # the Custom Scalars charts
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
        "metrics": {m.name.tag for m in experiment.metric_infos},
        "layout": set(acc.PluginTagToContent("custom_scalars")),
    }


def test_the_monitor_writes_exactly_these_tags(tmp_path):
    tags = _fit_and_read_tags(tmp_path, [TrainingMonitor(log_every_n_steps=2, peak_flops=1e12, num_images=4)])
    assert tags == EXPECTED


def test_the_five_parts_alone_write_the_same_tags(tmp_path):
    steps = StepMonitor(peak_flops=1e12)
    grid, report = ImageGrid(num_images=4, meter=steps.meter), CompileReport(meter=steps.meter)
    parts = [steps, ScalarLayout(), grid, report, HParamsRecord(fit_totals=lambda: steps.fit_totals)]
    tags = _fit_and_read_tags(tmp_path, parts)
    assert tags == EXPECTED
