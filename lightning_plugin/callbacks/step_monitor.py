"""`StepMonitor`: step time, data wait, throughput, FLOP/s and MFU, peak device memory and learning rate,
every N training batches, on a :class:`~lightning_plugin.step_meter.StepMeter`.

Lightning's ``ThroughputMonitor`` does not split out the time a step waited for data and gives no MFU on an
H200; this callback does both, from global rank zero only. On CUDA the steps are timed with CUDA events that
are read once per logging window, so the monitor adds no host sync to a step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.callbacks._options import check_options
from lightning_plugin.callbacks._trainer_lookup import batch_size, first_tensor, logging_interval
from lightning_plugin.callbacks.change_points import ChangePoints
from lightning_plugin.flops import measure_forward_flops, peak_flops, training_flops_per_sample
from lightning_plugin.step_meter import StepMeter, StepTotals, device_timeline

__all__ = ["StepMonitor"]

_GIB = float(1 << 30)


class StepMonitor(Callback):
    """Logs, averaged over every ``log_every_n_steps`` training batches: ``vitals/step_time_ms``
    (device time on CUDA), ``vitals/samples_per_sec`` (end to end, data wait included),
    ``vitals/data_wait_fraction``, ``vitals/flops_per_sec`` and ``vitals/mfu`` (when FLOPs are known),
    ``vitals/peak_memory_gib`` on CUDA (the window's peak: the allocator's peak is reset after each reading), and
    ``vitals/lr`` (``vitals/lr_opt{i}_group{j}`` with several optimizers or groups); the learning rate and the
    peak memory only where they change (:class:`ChangePoints`). Validation and the monitors' own writing count
    neither as step nor as wait.

    Args: as :class:`~lightning_plugin.callbacks.TrainingMonitor`'s of the same names.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        flops_per_sample: float | None = None,
        measure_flops: bool = True,
        peak_flops: float | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__()
        check_options(
            type(self).__name__,
            log_every_n_steps=log_every_n_steps,
            flops_per_sample=flops_per_sample,
            measure_flops=measure_flops,
            peak_flops=peak_flops,
            batch_size_fn=batch_size_fn,
        )
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_sample = flops_per_sample
        self.measure_flops = measure_flops
        self.peak_flops = peak_flops
        self.batch_size_fn = batch_size_fn
        #: Other callbacks that write during a step pass this to exclude their time (``meter.discard()``).
        self.meter = StepMeter()
        #: Every logged window of this fit added up: the fit's throughput (``HParamsRecord`` shows it).
        self.fit_totals = StepTotals()
        self._rare = ChangePoints()  # the learning rate, the peak memory: points only where they change
        self._interval = 1
        self._device = torch.device("cpu")
        self._flops_per_sample: float | None = None
        self._flops_per_batch: float | None = None
        self._peak: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.meter.reset()
        self.fit_totals = StepTotals()
        self._rare.reset()
        self._flops_per_sample, self._flops_per_batch = self.flops_per_sample, None
        module_flops = getattr(pl_module, "flops_per_batch", None)
        if self._flops_per_sample is None and module_flops:
            self._flops_per_batch = float(module_flops)
        measure = self.measure_flops and trainer.is_global_zero
        if self._flops_per_sample is None and self._flops_per_batch is None and measure:
            self._flops_per_sample = _measured_flops_per_sample(pl_module, type(self).__name__)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Read here, after every callback's setup: one may fit the Trainer's interval to short epochs there
        # (lcv's FitLoggingInterval), and these curves should share the module's logging steps.
        self._interval = logging_interval(trainer, self.log_every_n_steps)
        self._device = trainer.strategy.root_device
        self.meter.timeline = device_timeline(self._device)
        self._peak = self.peak_flops
        if self._peak is None:
            self._peak = peak_flops(self._device, _compute_dtype(trainer))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.meter.discard()  # the first fetch of the epoch (worker start-up included) is data wait

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            self.meter.step_started()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        self.meter.step_ended(batch_size(batch, self.batch_size_fn))
        if self.meter.steps >= self._interval:
            self._log(trainer, self.meter.take())
            self.meter.discard()  # our own logging is not data wait

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self.meter.discard()  # a mid-epoch validation is not data wait

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self.meter.take()
        if trainer.is_global_zero and window.steps:
            self._log(trainer, window)
        if trainer.is_global_zero:
            _log_points(trainer, self._rare.end())

    def _log(self, trainer: pl.Trainer, window: StepTotals) -> None:
        self.fit_totals = self.fit_totals + window
        metrics: dict[str, float] = {}
        if window.mean_step_s is not None:
            metrics["vitals/step_time_ms"] = 1e3 * window.mean_step_s
        if window.busy_s > 0:
            metrics["vitals/samples_per_sec"] = window.samples / window.busy_s
            metrics["vitals/data_wait_fraction"] = window.wait_s / window.busy_s
            flops_per_sec = self._flops_per_sec(window)
            if flops_per_sec is not None:
                metrics["vitals/flops_per_sec"] = flops_per_sec
                if self._peak:
                    metrics["vitals/mfu"] = flops_per_sec / self._peak
        rare = _learning_rates(trainer)
        if self._device.type == "cuda":
            # The allocator's own counters: host-side, no sync. Reset so each point is its window's peak.
            rare["vitals/peak_memory_gib"] = torch.cuda.max_memory_allocated(self._device) / _GIB
            torch.cuda.reset_peak_memory_stats(self._device)
        points = self._rare.points(trainer.global_step, rare)
        metrics.update(points.pop(trainer.global_step, {}))
        points[trainer.global_step] = metrics
        _log_points(trainer, points)

    def _flops_per_sec(self, window: StepTotals) -> float | None:
        if self._flops_per_sample is not None:
            return self._flops_per_sample * window.samples / window.busy_s
        if self._flops_per_batch is not None:
            return self._flops_per_batch * window.steps / window.busy_s
        return None


def _log_points(trainer: pl.Trainer, points: dict[int, dict[str, float]]) -> None:
    for step, metrics in points.items():
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    groups = [
        (i, j, group) for i, opt in enumerate(trainer.optimizers) for j, group in enumerate(opt.param_groups)
    ]
    if len(groups) == 1:
        return {"vitals/lr": float(groups[0][2]["lr"])}
    return {f"vitals/lr_opt{i}_group{j}": float(group["lr"]) for i, j, group in groups}


def _compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    try:
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        return _plugin_to_compute_dtype(trainer.precision_plugin)
    except Exception:  # private helper: if it moves or rejects a plugin, assume fp32
        return torch.float32


def _measured_flops_per_sample(pl_module: pl.LightningModule, owner: str) -> float | None:
    """3x the forward FLOPs of ``example_input_array`` per sample; None (with a warning) when unavailable."""
    example = getattr(pl_module, "example_input_array", None)
    batch = first_tensor(example)
    if batch is None or batch.dim() == 0 or batch.shape[0] == 0:
        return None
    try:
        forward = measure_forward_flops(pl_module, example)
    except Exception as err:  # monitoring must not stop a run: no MFU is better than no training
        first_line = (str(err).strip().splitlines() or [""])[0]
        warnings.warn(
            f"{owner}: could not count FLOPs on {type(pl_module).__name__}.example_input_array "
            f"({type(err).__name__}: {first_line}); vitals/flops_per_sec and vitals/mfu will not be logged. "
            "Pass flops_per_sample=..., or measure_flops=False to silence this.",
            stacklevel=3,
        )
        return None
    return training_flops_per_sample(forward, int(batch.shape[0])) if forward > 0 else None
