"""`TrainingMonitor`: one callback that shows in TensorBoard where a compiled run spends its time.

Lightning's ``ThroughputMonitor``, ``DeviceStatsMonitor`` and ``LearningRateMonitor`` each
cover a slice; none knows about the compiler (graphs, breaks, recompiles, compile time)
or how long each step waited for data, and ``ThroughputMonitor`` gives no MFU on an H200.
This callback logs all of it through the Trainer's loggers, from global rank zero only,
and never during the sanity check.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lightning_plugin.flops import measure_forward_flops, peak_flops, training_flops_per_sample

__all__ = ["TrainingMonitor"]

_GIB = float(1 << 30)
#: Datamodule attribute pairs searched (in order) for the normalisation used by the loader.
_NORMALIZATION_ATTRS: tuple[tuple[str, str], ...] = (("mean", "std"), ("normalize_mean", "normalize_std"))


class TrainingMonitor(Callback):
    """Logs throughput, data wait, compiler activity, memory, learning rate, MFU, sample images and hparams.

    Scalars (every ``log_every_n_steps`` training batches, averaged over that window):
    ``perf/step_time_ms`` (device-synchronised), ``perf/samples_per_sec`` (end to end, data
    wait included), ``perf/data_wait_fraction``, ``perf/flops_per_sec`` and ``perf/mfu`` (when
    FLOPs are known), ``compile/graphs``, ``compile/graph_breaks``, ``compile/recompiles``,
    ``compile/compile_time_s``, ``compile/fell_back`` and ``compile/graph_time_s`` (one point
    per graph, x-axis = graph index) when the strategy exposes ``compile_stats``,
    ``memory/{allocated,reserved,peak}_gib`` on CUDA, and ``optim/lr`` (``optim/lr_opt{i}_group{j}``
    with several optimizers or groups). Text: ``compile/graphs``, ``compile/break_reasons``,
    ``compile/recompile_reasons`` and ``compile/fallback``. Image: ``samples/augmented`` at the
    first batch of each epoch. At the end of ``fit``: the HParams tab (hyperparameters +
    ``final/*`` metrics); to make it the run's only hparams record, the monitor turns off
    ``TensorBoardLogger``'s placeholder ``hp_metric`` (TensorBoard displays the first record of a run).

    The defaults suit a monitor that is always on (the ``lcv`` command adds one): monitoring
    never stops a run (a FLOP count that cannot be measured only warns), and on CUDA the
    clock reads wait for the current stream only, so a loader that prepares the next batch on
    a side stream keeps overlapping with the step.

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
        mean, std: per-channel normalisation to undo for the grid; ``None`` takes it from the
            train loader's pipeline (a ``Normalize`` op: an op with ``mean``/``std`` attributes),
            then from ``trainer.datamodule.mean``/``std`` (or ``normalize_mean``/``normalize_std``),
            and failing both rescales each image to [0, 1]. uint8 images are shown as they are.
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
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ValueError(
                "TrainingMonitor: log_every_n_steps must be a positive int or None, "
                f"got {log_every_n_steps!r}"
            )
        for name, value in (("flops_per_sample", flops_per_sample), ("peak_flops", peak_flops)):
            if value is not None and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            ):
                raise ValueError(
                    f"TrainingMonitor: {name} must be a positive finite number or None, got {value!r}"
                )
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"TrainingMonitor: num_images must be a positive int, got {num_images!r}")
        for name, flag in (
            ("measure_flops", measure_flops),
            ("log_images", log_images),
            ("log_hparams", log_hparams),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"TrainingMonitor: {name} must be a bool, got {flag!r}")
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(f"TrainingMonitor: batch_size_fn must be callable or None, got {batch_size_fn!r}")
        if (mean is None) != (std is None):
            raise ValueError("TrainingMonitor: pass both `mean` and `std`, or neither")
        if mean is not None and std is not None:
            if len(mean) != len(std) or len(mean) == 0:
                raise ValueError(
                    f"TrainingMonitor: mean and std need the same non-zero length, got {mean!r} / {std!r}"
                )
            if any(s <= 0 for s in std):
                raise ValueError(f"TrainingMonitor: std values must be positive, got {std!r}")
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_sample = flops_per_sample
        self.measure_flops = measure_flops
        self.peak_flops = peak_flops
        self.batch_size_fn = batch_size_fn
        self.log_images = log_images
        self.num_images = num_images
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        self.log_hparams = log_hparams
        self._reset_run_state()

    # ------------------------------------------------------------------ state

    def _reset_run_state(self) -> None:
        self._interval = 1
        self._flops_per_sample: float | None = None
        self._flops_per_batch: float | None = None
        self._peak: float | None = None
        self._device = torch.device("cpu")
        self._batch_start: float | None = None
        self._last_end: float | None = None
        self._images_pending = False
        self._graphs_logged = 0
        self._breaks_logged = 0
        self._recompiles_logged = 0
        self._graphs_text = 0
        self._fallback_logged = False
        self._decisions_logged = 0
        self._max_batch_size = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._win_batches = 0
        self._win_samples = 0
        self._win_step_s = 0.0
        self._win_wait_s = 0.0

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run_state()
        self._interval = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps))
        if not trainer.loggers and trainer.is_global_zero:
            warnings.warn(
                "TrainingMonitor: the Trainer has no logger (logger=False); nothing will be logged.",
                stacklevel=2,
            )
        if self.log_hparams:
            for logger in trainer.loggers:
                # TensorBoard's HParams tab shows only the first hparams record of a run, and Lightning
                # writes a placeholder one (hp_metric=-1) at the start unless this is off.
                if isinstance(logger, TensorBoardLogger) and hasattr(logger, "_default_hp_metric"):
                    logger._default_hp_metric = False
        self._flops_per_sample = self.flops_per_sample
        module_flops = getattr(pl_module, "flops_per_batch", None)
        if self._flops_per_sample is None and module_flops:
            self._flops_per_batch = float(module_flops)
        measure = self.measure_flops and trainer.is_global_zero
        if self._flops_per_sample is None and self._flops_per_batch is None and measure:
            self._flops_per_sample = _measured_flops_per_sample(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._peak = self.peak_flops
        if self._peak is None:
            self._peak = peak_flops(self._device, _compute_dtype(trainer))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._last_end = self._now()  # the first fetch of the epoch (worker start-up included) is data wait
        self._images_pending = self.log_images

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return  # only rank zero logs, so only rank zero pays for the device syncs
        now = self._now()
        if self._last_end is not None:
            self._win_wait_s += now - self._last_end
        if self._images_pending:
            self._images_pending = False
            self._log_image_grid(trainer, batch)
            now = self._now()  # writing the grid is neither data wait nor step time
        self._batch_start = now

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        now = self._now()
        if self._batch_start is not None:
            self._win_step_s += now - self._batch_start
        samples = self._batch_size(batch)
        self._max_batch_size = max(self._max_batch_size, samples)
        self._win_samples += samples
        self._win_batches += 1
        if self._win_batches >= self._interval:
            self._log_window(trainer)
            self._reset_window()
            now = self._now()  # after our own logging, so it is not counted as data wait
        self._last_end = now

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self._last_end = self._now()  # a mid-epoch validation is not data wait

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            if self._win_batches:
                self._log_window(trainer)
            self._log_compile_text(trainer, force=True)
        self._reset_window()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if self.log_hparams:
            self._log_hparams(trainer, pl_module)
        writer = _tensorboard_writer(trainer)
        if writer is not None:
            writer.flush()

    # ------------------------------------------------------------------ logging

    def _log_window(self, trainer: pl.Trainer) -> None:
        metrics: dict[str, float] = {}
        busy = self._win_step_s + self._win_wait_s
        if self._win_batches:
            metrics["perf/step_time_ms"] = 1e3 * self._win_step_s / self._win_batches
        if busy > 0:
            samples_per_sec = self._win_samples / busy
            metrics["perf/samples_per_sec"] = samples_per_sec
            metrics["perf/data_wait_fraction"] = self._win_wait_s / busy
            flops_per_sec = self._flops_per_sec(samples_per_sec, busy)
            if flops_per_sec is not None:
                metrics["perf/flops_per_sec"] = flops_per_sec
                if self._peak:
                    metrics["perf/mfu"] = flops_per_sec / self._peak
        metrics.update(_learning_rates(trainer))
        if self._device.type == "cuda":
            metrics["memory/allocated_gib"] = torch.cuda.memory_allocated(self._device) / _GIB
            metrics["memory/reserved_gib"] = torch.cuda.memory_reserved(self._device) / _GIB
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(self._device) / _GIB
        stats = _compile_stats(trainer)
        if stats is not None:
            metrics.update({f"compile/{k}": float(v) for k, v in stats.as_dict().items()})
        step = trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if stats is not None:
            self._log_graph_times(trainer, stats)
            self._log_compile_text(trainer)

    def _flops_per_sec(self, samples_per_sec: float, busy_s: float) -> float | None:
        if self._flops_per_sample is not None:
            return self._flops_per_sample * samples_per_sec
        if self._flops_per_batch is not None:
            return self._flops_per_batch * self._win_batches / busy_s
        return None

    def _log_graph_times(self, trainer: pl.Trainer, stats: Any) -> None:
        times = list(stats.graph_compile_times)
        if len(times) < self._graphs_logged:  # the strategy recompiled from scratch (a new fit)
            self._graphs_logged = 0
        for index in range(self._graphs_logged, len(times)):
            for logger in trainer.loggers:
                logger.log_metrics({"compile/graph_time_s": float(times[index][1])}, step=index)
        self._graphs_logged = len(times)

    def _log_compile_text(self, trainer: pl.Trainer, force: bool = False) -> None:
        stats = _compile_stats(trainer)
        writer = _tensorboard_writer(trainer)
        if stats is None or writer is None:
            return
        step = trainer.global_step
        breaks, recompiles = list(stats.break_reasons), list(stats.recompile_reasons)
        graphs = list(stats.graph_compile_times)
        if graphs and (force or len(graphs) != self._graphs_text):
            rows = "\n".join(
                f"| {i} | `{name}` | {seconds:.3f} |" for i, (name, seconds) in enumerate(graphs)
            )
            writer.add_text("compile/graphs", f"| # | graph | compile s |\n|---|---|---|\n{rows}", step)
            self._graphs_text = len(graphs)
        if breaks and (force or len(breaks) != self._breaks_logged):
            writer.add_text("compile/break_reasons", _bullets(breaks), step)
            self._breaks_logged = len(breaks)
        if recompiles and (force or len(recompiles) != self._recompiles_logged):
            writer.add_text("compile/recompile_reasons", _bullets(recompiles), step)
            self._recompiles_logged = len(recompiles)
        if getattr(stats, "fell_back", False) and (force or not self._fallback_logged):
            writer.add_text(
                "compile/fallback", str(getattr(stats, "fallback_reason", "fell back to eager")), step
            )
            self._fallback_logged = True
        decisions = _kernel_decisions(trainer)
        if decisions and (force or len(decisions) != self._decisions_logged):
            writer.add_text("compile/kernel_decisions", _decision_table(decisions), step)
            self._decisions_logged = len(decisions)

    def _log_image_grid(self, trainer: pl.Trainer, batch: Any) -> None:
        writer = _tensorboard_writer(trainer)
        images = _first_tensor(batch)
        if writer is None or images is None or images.dim() != 4 or images.shape[1] not in (1, 3):
            return
        images = images[: self.num_images].detach().cpu()
        if images.dtype == torch.uint8:
            shown = images.float() / 255.0  # not normalised yet: the pixels as they are
        elif images.is_floating_point():
            shown = _denormalize(images.float(), *self._normalization(trainer))
        else:
            return
        from torchvision.utils import make_grid

        grid = make_grid(shown.clamp(0.0, 1.0), nrow=max(1, math.ceil(math.sqrt(shown.shape[0]))), padding=1)
        writer.add_image("samples/augmented", grid, trainer.global_step)

    def _normalization(self, trainer: pl.Trainer) -> tuple[list[float] | None, list[float] | None]:
        if self.mean is not None:
            return self.mean, self.std
        mean, std = _loader_normalization(trainer)
        return (mean, std) if mean is not None else _datamodule_normalization(trainer)

    def _log_hparams(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params: dict[str, Any] = {}
        params.update(_plain(dict(pl_module.hparams)))
        datamodule = trainer.datamodule
        if datamodule is not None:
            params.update({f"data/{k}": v for k, v in _plain(dict(datamodule.hparams)).items()})
        params["trainer/strategy"] = type(trainer.strategy).__name__
        params["trainer/precision"] = str(trainer.precision)
        params["trainer/max_epochs"] = trainer.max_epochs if trainer.max_epochs is not None else -1
        params["trainer/batch_size"] = self._max_batch_size  # the last batch of an epoch may be smaller
        config = _compile_config(trainer)
        if config is not None:
            for name in ("backend", "mode", "fullgraph", "dynamic", "regional", "fallback"):
                value = getattr(config, name, None)
                params[f"compile/{name}"] = getattr(value, "__name__", value)
            kernels = getattr(config, "kernels", None)
            params["compile/kernels"] = kernels if isinstance(kernels, str) else ",".join(sorted(kernels))
        metrics = {
            f"final/{k}": float(v)
            for k, v in trainer.callback_metrics.items()
            if isinstance(v, torch.Tensor) and v.numel() == 1 and math.isfinite(float(v))
        }
        stats = _compile_stats(trainer)
        if stats is not None:
            metrics.update({f"final/compile_{k}": float(v) for k, v in stats.as_dict().items()})
        decisions = _kernel_decisions(trainer)
        if decisions:
            metrics["final/kernel_blocks_fused"] = float(sum(d.fused for d in decisions))
            metrics["final/kernel_blocks_candidates"] = float(len(decisions))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(params, metrics=metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ helpers

    def _now(self) -> float:
        if self._device.type == "cuda":
            # The clock must not run ahead of queued kernels. Only the current stream: a loader
            # preparing the next batch on a side stream keeps overlapping with this step.
            torch.cuda.current_stream(self._device).synchronize()
        return time.perf_counter()

    def _batch_size(self, batch: Any) -> int:
        if self.batch_size_fn is not None:
            return int(self.batch_size_fn(batch))
        tensor = _first_tensor(batch)
        return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _compilers(trainer: pl.Trainer) -> list[Any]:
    """The strategy, then the callbacks (e.g. ``TorchCompile``): whoever compiled the module."""
    return [trainer.strategy, *trainer.callbacks]


def _compile_stats(trainer: pl.Trainer) -> Any:
    """Duck-typed ``compile_stats`` (graphs, graph_breaks, recompiles, ...); None with a plain strategy."""
    for owner in _compilers(trainer):
        stats = getattr(owner, "compile_stats", None)
        if stats is not None:
            return stats
    return None


def _kernel_decisions(trainer: pl.Trainer) -> list[Any]:
    """``kernels="auto"``'s ``KernelDecision`` rows, from a strategy that exposes them; [] otherwise."""
    for owner in _compilers(trainer):
        decisions = getattr(owner, "kernel_decisions", None)
        if decisions:
            return list(decisions)
    return []


def _decision_table(decisions: list[Any]) -> str:
    """Markdown: what ``kernels="auto"`` chose per block, the measured ratio (Inductor time / fused time)."""
    lines = ["| block | chosen | ratio | matches eager | why | signature |", "|---|---|---|---|---|---|"]
    for d in decisions:
        row = d.as_row()
        ratio = f"{row['ratio']:.3g}x" if row["ratio"] is not None else "-"
        correct = {True: "yes", False: "no", None: "-"}[row["correct"]]
        why = row["reason"] + (" (cached)" if row["cached"] else "")
        cells = [f"`{row['path']}`", row["chosen"], ratio, correct, why, f"`{row['signature']}`"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _compile_config(trainer: pl.Trainer) -> Any:
    for owner in _compilers(trainer):
        config = getattr(owner, "compile_config", None) or getattr(
            getattr(owner, "_compiler", None), "config", None
        )
        if config is not None:
            return config
    return None


def _learning_rates(trainer: pl.Trainer) -> dict[str, float]:
    groups = [
        (i, j, group) for i, opt in enumerate(trainer.optimizers) for j, group in enumerate(opt.param_groups)
    ]
    if len(groups) == 1:
        return {"optim/lr": float(groups[0][2]["lr"])}
    return {f"optim/lr_opt{i}_group{j}": float(group["lr"]) for i, j, group in groups}


def _compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    try:
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        return _plugin_to_compute_dtype(trainer.precision_plugin)
    except Exception:  # private helper: if it moves or rejects a plugin, assume fp32
        return torch.float32


def _tensorboard_writer(trainer: pl.Trainer) -> Any:
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def _measured_flops_per_sample(pl_module: pl.LightningModule) -> float | None:
    """3x the forward FLOPs of ``example_input_array`` per sample; None (with a warning) when unavailable."""
    example = getattr(pl_module, "example_input_array", None)
    batch = _first_tensor(example)
    if batch is None or batch.dim() == 0 or batch.shape[0] == 0:
        return None
    try:
        forward = measure_forward_flops(pl_module, example)
    except Exception as err:  # monitoring must not stop a run: no MFU is better than no training
        first_line = (str(err).strip().splitlines() or [""])[0]
        warnings.warn(
            f"TrainingMonitor: could not count FLOPs on {type(pl_module).__name__}.example_input_array "
            f"({type(err).__name__}: {first_line}); perf/flops_per_sec and perf/mfu will not be logged. "
            "Pass flops_per_sample=..., or measure_flops=False to silence this.",
            stacklevel=3,
        )
        return None
    return training_flops_per_sample(forward, int(batch.shape[0])) if forward > 0 else None


def _loader_normalization(trainer: pl.Trainer) -> tuple[list[float] | None, list[float] | None]:
    """Mean/std of the last normalising op in the train loader's ``pipeline`` (``DeviceLoader``)."""
    try:
        loader = trainer.train_dataloader
    except Exception:  # no fit loop / loader yet
        return None, None
    ops = getattr(getattr(loader, "pipeline", None), "ops", None) or []
    for op in reversed(list(ops)):
        mean, std = getattr(op, "mean", None), getattr(op, "std", None)
        if mean is not None and std is not None:
            return [float(m) for m in mean], [float(s) for s in std]
    return None, None


def _datamodule_normalization(trainer: pl.Trainer) -> tuple[list[float] | None, list[float] | None]:
    datamodule = trainer.datamodule
    for mean_attr, std_attr in _NORMALIZATION_ATTRS:
        mean, std = getattr(datamodule, mean_attr, None), getattr(datamodule, std_attr, None)
        if mean is not None and std is not None:
            return [float(m) for m in mean], [float(s) for s in std]
    return None, None


def _denormalize(images: torch.Tensor, mean: list[float] | None, std: list[float] | None) -> torch.Tensor:
    """``x * std + mean`` (in [0, 1] units); without a usable mean/std, each image rescaled to [0, 1]."""
    if mean is None or std is None or len(mean) not in (1, images.shape[1]) or len(std) != len(mean):
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        high = images.amax(dim=(1, 2, 3), keepdim=True)
        return (images - low) / (high - low).clamp_min(1e-12)
    images = images * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
    return images / 255.0 if max(mean) > 1.5 else images  # a mean above 1.5 is in 0-255 units


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters as TensorBoard accepts them: numbers, bools and strings."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, (bool, int, float, str)) or value is None:
            out[key] = "None" if value is None else value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.item()
        else:
            out[key] = str(value)
    return out


def _bullets(lines: list[str]) -> str:
    """A markdown list; dynamo's reasons span several lines, kept inside their item by indenting."""
    return "\n".join("- " + line.strip().replace("\n", "\n  ") for line in lines)
