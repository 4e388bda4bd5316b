"""`TrainingMonitor`: one callback that shows in TensorBoard where a compiled run spends its time.

It is the five monitoring callbacks together, each usable alone: :class:`StepMonitor` (step time, data wait,
throughput, MFU, peak memory, learning rate, on a framework-free ``StepMeter``), :class:`ScalarLayout` (the
Custom Scalars charts: train and validation curves together), :class:`CompileReport` (the compiler's story as
one card), :class:`ImageGrid` (the augmented batch) and :class:`HParamsRecord` (the HParams tab). Together, the
time the others spend writing is kept out of the step time and data wait. Everything is logged from global
rank zero only, never during the sanity check. Only what changes is logged as a curve.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.callbacks._options import check_normalization, check_options
from lightning_plugin.callbacks.compile_report import CompileReport
from lightning_plugin.callbacks.hparams import HParamsRecord
from lightning_plugin.callbacks.image_grid import ImageGrid
from lightning_plugin.callbacks.scalar_layout import ScalarLayout
from lightning_plugin.callbacks.step_monitor import StepMonitor

__all__ = ["TrainingMonitor"]


class TrainingMonitor(Callback):
    """Logs throughput, data wait, compiler activity, memory, learning rate, MFU, sample images and hparams.

    Scalars (every ``log_every_n_steps`` training batches, averaged over that window):
    ``vitals/step_time_ms``, ``vitals/samples_per_sec``, ``vitals/data_wait_fraction``, ``vitals/flops_per_sec``,
    ``vitals/mfu``, ``vitals/peak_memory_gib`` (CUDA) and ``vitals/lr`` (:class:`StepMonitor`). The Custom Scalars
    layout (:class:`ScalarLayout`). Text ``compile/report`` when the strategy exposes ``compile_stats``: the
    compile decision, graphs, breaks, recompiles, caches, compile time and kernel choices
    (:class:`CompileReport`). Image: ``vitals/train_batch`` at the first batch of each epoch
    (:class:`ImageGrid`). At the end of ``fit``: the HParams tab, the run's settings and its results, with the
    one-point ``whole_run/*`` values (:class:`HParamsRecord`).

    The defaults suit a monitor that is always on (the ``lcv`` command adds one): monitoring never stops a run
    (a FLOP count that cannot be measured only warns), and on CUDA the clock reads wait for the current stream
    only, so a loader that prepares the next batch on a side stream keeps overlapping with the step.

    Args:
        log_every_n_steps: logging interval in training batches; ``None`` uses the Trainer's.
        flops_per_sample: training FLOPs per sample; otherwise ``pl_module.flops_per_batch``
            (Lightning's convention) or, with ``measure_flops``, 3x the forward FLOPs of
            ``pl_module.example_input_array`` measured on the uncompiled module.
        measure_flops: measure FLOPs from ``example_input_array`` when nothing else gives them.
        peak_flops: the device's peak FLOP/s for MFU; ``None`` looks it up (H100/H200 included).
        batch_size_fn: returns the number of samples in a batch; default: dim 0 of the first tensor.
        log_images: log a grid of the first training batch of each epoch.
        num_images: how many images the grid shows.
        mean, std: per-channel normalisation to undo for the grid; ``None`` asks the train loader
            (``ImageGrid``'s ``NormalizedBatches``: ``lcv_vision.data.DeviceLoader`` says), then
            ``trainer.datamodule.mean``/``std`` (or ``normalize_mean``/``normalize_std``), and failing both
            rescales each image to [0, 1]. uint8 images are shown as they are.
        log_hparams: write the HParams tab at the end of ``fit``.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        flops_per_sample: float | None = None,
        measure_flops: bool = True,
        peak_flops: float | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        log_images: bool = True,
        num_images: int = 16,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        log_hparams: bool = True,
    ) -> None:
        super().__init__()
        check_options(
            "TrainingMonitor",
            log_every_n_steps=log_every_n_steps,
            flops_per_sample=flops_per_sample,
            peak_flops=peak_flops,
            num_images=num_images,
            measure_flops=measure_flops,
            log_images=log_images,
            log_hparams=log_hparams,
            batch_size_fn=batch_size_fn,
        )
        check_normalization("TrainingMonitor", mean, std)
        self.steps = StepMonitor(
            log_every_n_steps, flops_per_sample, measure_flops, peak_flops, batch_size_fn
        )
        self.layout = ScalarLayout()
        self.compile_report = CompileReport(log_every_n_steps, meter=self.steps.meter)
        self.image_grid = ImageGrid(num_images, mean, std, meter=self.steps.meter) if log_images else None
        self.hparams_record = (
            HParamsRecord(batch_size_fn, fit_totals=lambda: self.steps.fit_totals) if log_hparams else None
        )

    @property
    def parts(self) -> list[Callback]:
        """In hook order: the step clock first, so the others' writing is kept out of it."""
        parts = (self.steps, self.layout, self.image_grid, self.compile_report, self.hparams_record)
        return [part for part in parts if part is not None]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not trainer.loggers and trainer.is_global_zero:
            warnings.warn(
                "TrainingMonitor: the Trainer has no logger (logger=False); nothing will be logged.",
                stacklevel=2,
            )
        for part in self.parts:
            part.setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_fit_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for part in self.parts:
            part.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for part in self.parts:
            part.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_validation_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_train_end(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for part in self.parts:
            part.on_fit_end(trainer, pl_module)
