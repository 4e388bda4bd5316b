"""One run, one event file: ``lcv fit`` tests the EMA and the final weights after training, and their metrics
belong in the run's TensorBoard log under tags that tell them apart.

Lightning finalizes (closes) every logger at the end of each ``fit``/``test`` call, and TensorBoard then opens a
new event file for the next call's first scalar: two tests after a fit left two more event files, both with
``test/acc``. :class:`HeldFinalize` holds the loggers' finalize until the tests ran, and
:func:`weights_tagged` names the test metrics after the weights they measured (``test/ema/acc``,
``test/final/acc``) on their way to the loggers; what the module returns (``test/acc``) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
from typing_extensions import override

from lightning_plugin.callbacks import HParamsRecord, TrainingMonitor
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = ["HEADLINE", "HeldFinalize", "prepare_hparams", "weights_tag", "weights_tagged"]


def weights_tag(weights: str, metric: str = "acc") -> str:
    """The tag of a test metric of ``weights`` ("EMA", "final"): ``test/ema/acc``."""
    return f"test/{weights.lower()}/{metric}"


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
    """Forwards to ``inner`` with ``test/<name>`` renamed ``test/<weights>/<name>``; records no hparams (the
    fit's record stands)."""

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
    """Inside the block, the trainer's loggers get test metrics as ``test/<weights>/<name>``."""
    loggers = list(trainer.loggers)
    trainer.loggers = [_WeightsTagged(logger, weights) for logger in loggers]
    try:
        yield
    finally:
        trainer.loggers = loggers


#: The settings ``lcv``'s HParams table shows first (TensorBoard shows five; the reader ticks others).
HEADLINE = ("recipe", "model", "lr", "optimizer", "compile/compile")


def prepare_hparams(trainer: pl.Trainer, weights: Sequence[str]) -> None:
    """Give the run's HParams record ``lcv``'s headline settings and the columns of the tests that follow the
    fit (none for an empty ``weights``)."""
    for callback in runtime_attributes(trainer).callbacks:
        record = callback.hparams_record if isinstance(callback, TrainingMonitor) else callback
        if isinstance(record, HParamsRecord):
            record.headline = list(HEADLINE)
            record.expect_metrics(weights_tag(name) for name in weights)
