"""`HParamsRecord`: a run's settings and results in TensorBoard's HParams tab, one row per run, so that a sweep
can be sorted by what matters.

The row's columns are the metrics named in the record; TensorBoard fills each with the last value of the scalar
of that tag. So the record names the curves the run already logged (their last value), a few one-point
``whole_run/*`` values that are no curve (best validation score, the fit's throughput, compile seconds), and
tags that come after ``fit`` (e.g. test accuracy, :meth:`HParamsRecord.expect_metrics`).

TensorBoard shows only the first hparams record of a run and Lightning writes a placeholder one
(``hp_metric=-1``) at the start, so this callback turns the placeholder off: its record is the run's only one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lightning_plugin.callbacks._options import check_options
from lightning_plugin.callbacks._trainer_lookup import (
    batch_size,
    compile_config,
    compile_decision,
    compile_stats,
    flush_tensorboard,
)
from lightning_plugin.step_meter import StepTotals
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = ["DEFAULT_HEADLINE", "HParamsRecord"]

#: Logged by Lightning with every metric: a column of it sorts nothing.
_NOT_A_RESULT = frozenset({"epoch", "step"})
#: The settings the HParams table shows before the reader picks others (TensorBoard shows five).
DEFAULT_HEADLINE = ("lr", "trainer/batch_size", "trainer/max_epochs", "compile/compile", "compile/kernels")


class HParamsRecord(Callback):
    """At the end of ``fit`` (global rank zero): the module's and datamodule's hparams (``data/*``), the
    trainer's (``trainer/*``) and the compiler's (``compile/*``) settings, never a key starting with ``_``
    (``LightningCLI``'s ``_instantiator``, ``_class_path``).

    Metric columns: ``columns`` when given (the same for every run of a sweep: TensorBoard takes the columns
    from one run's record), else every tag the run logged (its last value), ``whole_run/best_<monitor>`` (each
    ``ModelCheckpoint``'s best score), ``whole_run/samples_per_sec`` (the fit's throughput, with ``steps``),
    ``whole_run/compile_s`` and ``whole_run/compile_speedup`` (when compiled), and the tags passed to
    :meth:`expect_metrics`.

    Args:
        batch_size_fn: returns the number of samples in a batch (``trainer/batch_size`` is the largest seen);
            default: dim 0 of the first tensor.
        fit_totals: returns the fit's step totals (``StepMonitor.fit_totals``) for ``whole_run/samples_per_sec``.
        headline: the settings the HParams table shows first (TensorBoard shows five, sorted by name, and the
            reader ticks others); default :data:`DEFAULT_HEADLINE`.
        columns: the table's metric columns, in order, whatever this run logged; ``None``: as above.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        fit_totals: Callable[[], StepTotals] | None = None,
        headline: Sequence[str] = DEFAULT_HEADLINE,
        columns: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        check_options(type(self).__name__, batch_size_fn=batch_size_fn)
        self.batch_size_fn = batch_size_fn
        self.fit_totals = fit_totals
        self.headline = list(headline)
        self.columns = list(columns) if columns is not None else None
        self._max_batch_size = 0
        self._expected: list[str] = []

    def expect_metrics(self, tags: Iterable[str]) -> None:
        """Name metrics that are logged after ``fit`` (a test run): the record, written at the end of ``fit``,
        gets their columns, which TensorBoard fills once they are logged into the same run."""
        self._expected = list(dict.fromkeys([*self._expected, *tags]))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._max_batch_size = 0
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and hasattr(logger, "_default_hp_metric"):
                logger._default_hp_metric = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:  # the last batch of an epoch may be smaller: keep the largest
            self._max_batch_size = max(self._max_batch_size, batch_size(batch, self.batch_size_fn))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        params = self.params(trainer, pl_module)
        summary = self.summary_metrics(trainer)
        step = trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=step)
        columns = self.columns
        if columns is None:
            columns = [*self._expected, *summary, *_logged_tags(trainer)]  # the table's order
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                _write_record(logger, params, list(dict.fromkeys(columns)), self.headline, step)
        flush_tensorboard(trainer)

    def params(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The run's settings as TensorBoard takes them, without internal (``_``) keys."""
        params: dict[str, Any] = dict(_plain(dict(pl_module.hparams)))
        datamodule = runtime_attributes(trainer).datamodule
        if datamodule is not None:
            params.update({f"data/{k}": v for k, v in _plain(dict(datamodule.hparams)).items()})
        params["trainer/strategy"] = type(trainer.strategy).__name__
        params["trainer/precision"] = str(trainer.precision)
        params["trainer/max_epochs"] = trainer.max_epochs if trainer.max_epochs is not None else -1
        params["trainer/batch_size"] = self._max_batch_size
        config = compile_config(trainer)
        if config is not None:
            for name in ("compile", "backend", "mode", "fullgraph", "dynamic", "regional", "fallback"):
                value = getattr(config, name, None)
                params[f"compile/{name}"] = getattr(value, "__name__", value)
            kernels = config.kernels
            params["compile/kernels"] = kernels if isinstance(kernels, str) else ",".join(sorted(kernels))
        return {k: v for k, v in _plain(params).items() if not _internal(k)}

    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        """One value per run for what is no curve: best scores, the fit's throughput, compile seconds."""
        metrics: dict[str, float] = {}
        for callback in runtime_attributes(trainer).callbacks:
            if not isinstance(callback, ModelCheckpoint) or not callback.monitor:
                continue
            score = callback.best_model_score
            if isinstance(score, torch.Tensor) and math.isfinite(float(score)):
                metrics[f"whole_run/best_{callback.monitor.replace('/', '_')}"] = float(score)
        totals = self.fit_totals() if self.fit_totals is not None else None
        if totals is not None and totals.samples_per_sec is not None:
            metrics["whole_run/samples_per_sec"] = totals.samples_per_sec
        stats = compile_stats(trainer)
        if stats is not None:
            metrics["whole_run/compile_s"] = float(stats.compile_time_s)
        decision = compile_decision(trainer)
        if decision is not None and decision.speedup is not None:
            metrics["whole_run/compile_speedup"] = float(decision.speedup)
        return metrics


def _logged_tags(trainer: pl.Trainer) -> list[str]:
    """The scalar tags the run sent to its loggers (the modules' own ``self.log`` calls)."""
    return [k for k in trainer.logged_metrics if k not in _NOT_A_RESULT and not _internal(k)]


def _internal(key: str) -> bool:
    return any(part.startswith("_") for part in key.split("/"))


def _write_record(
    logger: TensorBoardLogger, params: dict[str, Any], columns: list[str], headline: Sequence[str], step: int
) -> None:
    """The HParams plugin's three summaries; the columns' values are the scalars of those tags."""
    from torch.utils.tensorboard.summary import hparams

    experiment, start, end = hparams(params, dict.fromkeys(columns, 0.0))
    _mark_headline(experiment, headline)
    writer = logger.experiment._get_file_writer()
    for summary in (experiment, start, end):
        writer.add_summary(summary, step)


def _mark_headline(experiment: Any, headline: Sequence[str]) -> None:
    """Mark the headline settings as ``differs``: TensorBoard's table shows those first (and five in all)."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    metadata = experiment.value[0].metadata.plugin_data
    data = plugin_data_pb2.HParamsPluginData.FromString(metadata.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in headline
    metadata.content = data.SerializeToString()


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
