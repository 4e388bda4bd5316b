"""One run, one event file, curves first: ``lcv fit`` tests the EMA and the final weights after training, and
their metrics belong in the run's TensorBoard log under tags that tell them apart.

Lightning finalizes (closes) every logger at the end of each ``fit``/``test`` call, and TensorBoard then opens a
new event file for the next call's first scalar: two tests after a fit left two more event files, both with
``test/acc``. :class:`HeldFinalize` holds the loggers' finalize until the tests ran, and
:func:`weights_tagged` names the test metrics after the weights they measured (``whole_run/test_ema_acc``,
``whole_run/test_final_acc``) on their way to the loggers; what the module returns (``test/acc``) is unchanged.

TensorBoard's Time Series tab (its first screen) orders its sections by tag name. The test results are one
point each, so they go to the ``whole_run/`` section, which sorts after the module's ``train/`` and ``val/``
curves (as the monitor's ``vitals/`` does), and :class:`RunLogger` leaves out Lightning's ``epoch`` series (a
staircase of the step that would come first).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from typing_extensions import override

from lightning_plugin.callbacks import HParamsRecord, TrainingMonitor
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = [
    "COLUMNS",
    "HEADLINE",
    "HeldFinalize",
    "RunLogger",
    "prepare_hparams",
    "weights_tag",
    "weights_tagged",
]


def weights_tag(weights: str, metric: str = "acc") -> str:
    """The tag of a test metric of ``weights`` ("EMA", "final"): ``whole_run/test_ema_acc``."""
    return f"whole_run/test_{weights.lower()}_{metric.replace('/', '_')}"


class RunLogger(TensorBoardLogger):
    """``lcv``'s TensorBoard logger: Lightning's, without the ``epoch`` series Lightning adds to every metrics
    record "for convenience". In TensorBoard it is a staircase of the step, and its section would come first
    on the Time Series tab; the epoch stays in the checkpoints and in the progress bar."""

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step)


class HeldFinalize:
    """Holds ``finalize`` of ``loggers`` (the calls are recorded, not made) until :meth:`release`."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self._held = list(loggers)
        self._statuses: list[str] = []
        for logger in self._held:
            logger.finalize = self._statuses.append  # type: ignore[method-assign,assignment]  # this instance

    def release(self) -> None:
        """Finalize each logger once, with the worst status recorded ("success" when none was)."""
        status = next((s for s in self._statuses if s != "success"), "success")
        held, self._held = self._held, []
        for logger in held:
            del logger.finalize  # the class's method again
            logger.finalize(status)


class _WeightsTagged(Logger):
    """Forwards to ``inner`` with ``test/<name>`` renamed :func:`weights_tag` ``(weights, name)``; records no
    hparams (the fit's record stands)."""

    def __init__(self, inner: Logger, weights: str) -> None:
        super().__init__()
        self.inner = inner
        self.weights = weights

    @property
    @override
    def name(self) -> str | None:
        return self.inner.name

    @property
    @override
    def version(self) -> int | str | None:
        return self.inner.version

    @property
    @override
    def save_dir(self) -> str | None:
        return self.inner.save_dir

    @property
    @override
    def log_dir(self) -> str | None:
        return self.inner.log_dir

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        renamed = {
            weights_tag(self.weights, key.removeprefix("test/")) if key.startswith("test/") else key: value
            for key, value in metrics.items()
        }
        self.inner.log_metrics(renamed, step)

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def save(self) -> None:
        self.inner.save()

    @override
    def finalize(self, status: str) -> None:
        self.inner.finalize(status)


@contextmanager
def weights_tagged(trainer: pl.Trainer, weights: str) -> Iterator[None]:
    """Inside the block, the trainer's loggers get test metrics as ``whole_run/test_<weights>_<name>``."""
    loggers = list(trainer.loggers)
    trainer.loggers = [_WeightsTagged(logger, weights) for logger in loggers]
    try:
        yield
    finally:
        trainer.loggers = loggers


#: The settings ``lcv``'s HParams table shows first (TensorBoard shows five; the reader ticks others).
HEADLINE = ("recipe", "model", "lr", "optimizer", "compile/compile")
#: The HParams table's metric columns, the same for every ``lcv fit``: TensorBoard takes the columns from one
#: run's record, so a run that measured less (compile="never", no EMA, no test) leaves cells empty instead of
#: changing the columns of a sweep.
COLUMNS = (
    weights_tag("EMA"),
    weights_tag("final"),
    "whole_run/best_val_acc",
    "whole_run/samples_per_sec",
    "whole_run/compile_s",
    "whole_run/compile_speedup",
)


def prepare_hparams(trainer: pl.Trainer) -> None:
    """Give the run's HParams record ``lcv``'s headline settings and its fixed metric :data:`COLUMNS`."""
    for callback in runtime_attributes(trainer).callbacks:
        record = callback.hparams_record if isinstance(callback, TrainingMonitor) else callback
        if isinstance(record, HParamsRecord):
            record.headline = list(HEADLINE)
            record.columns = list(COLUMNS)
