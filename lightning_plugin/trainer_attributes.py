"""The ``Trainer`` attributes that Lightning assigns at runtime, typed.

Lightning's connectors set ``trainer.callbacks``, ``trainer.datamodule``, ``trainer.log_every_n_steps`` and
``trainer.fast_dev_run`` from outside the class (``trainer.x = ...`` in ``Trainer.__init__``'s helpers and in
``fit``), so a type checker does not see them on ``Trainer``. ``runtime_attributes(trainer)`` is the same
object, typed with them: the one way this code base reads or sets those attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

    class TrainerWithRuntimeAttributes(pl.Trainer):
        callbacks: list[Callback]  # set by the callback connector (after the Trainer's own defaults)
        datamodule: pl.LightningDataModule | None  # set by the data connector when fit/validate/... start
        log_every_n_steps: int  # set by the logger connector
        fast_dev_run: int | bool  # set by the debugging-flags initialisation


def runtime_attributes(trainer: pl.Trainer) -> TrainerWithRuntimeAttributes:
    """``trainer`` itself; only its static type gains the attributes Lightning sets at runtime."""
    return cast("TrainerWithRuntimeAttributes", trainer)
