"""`CompileReport`: what the compiler did, in TensorBoard, as one Markdown card per fit: the compile-or-eager
decision with the times behind it, graphs, breaks and recompiles with their reasons, the compile caches,
compile time and ``kernels="auto"``'s choice per block, from whoever compiled the module (a compiled strategy
or ``TorchCompile``).

None of Lightning's callbacks knows about the compiler; a graph break or a recompile per step is the commonest
reason a compiled run is slow, so the reasons stand beside the counts. The counts are not logged as scalars:
they hardly change, and a flat line says less than the card.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.callbacks._options import check_options
from lightning_plugin.callbacks._trainer_lookup import (
    compile_config,
    compile_decision,
    compile_stats,
    flush_tensorboard,
    kernel_decisions,
    logging_interval,
    substituted_blocks,
    tensorboard_writer,
)
from lightning_plugin.callbacks.compile_card import CompileFacts, render_compile_card
from lightning_plugin.step_meter import StepMeter

__all__ = ["COMPILE_CARD_TAG", "CompileReport"]

#: The text tag of the card (TensorBoard stores it as ``compile/report/text_summary``).
COMPILE_CARD_TAG = "compile/report"


class CompileReport(Callback):
    """Text ``compile/report``: written once the compile-or-eager decision is known (checked every
    ``log_every_n_steps`` training batches) and again, same tag, new step, at the end of training when it
    changed. Nothing with a plain strategy; global rank zero only.

    Args:
        log_every_n_steps: how often to check whether the decision is known; ``None`` uses the Trainer's.
        meter: a :class:`StepMeter` not to charge with the time spent writing here (``StepMonitor.meter``).
    """

    def __init__(self, log_every_n_steps: int | None = None, meter: StepMeter | None = None) -> None:
        super().__init__()
        check_options(type(self).__name__, log_every_n_steps=log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.meter = meter
        self._reset()

    def _reset(self) -> None:
        self._interval = 1
        self._batches = 0  # since the last check
        self._written: str | None = None  # the card as last written this fit

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after every callback's setup, which may fit the Trainer's interval to short epochs
        self._interval = logging_interval(trainer, self.log_every_n_steps)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero or self._written is not None:
            return
        self._batches += 1
        if self._batches < self._interval:
            return
        self._batches = 0
        stats = compile_stats(trainer)
        settled = stats is not None and (
            stats.decision is not None or stats.decision_reason or stats.fell_back
        )
        if settled and self._write(trainer) and self.meter is not None:
            self.meter.discard()  # writing the card is neither data wait nor step time

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write(trainer)  # the strategy restores the model after this: read everything now

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            flush_tensorboard(trainer)

    def card(self, trainer: pl.Trainer) -> str | None:
        """The card as it stands; None when nothing compiled the module."""
        stats = compile_stats(trainer)
        if stats is None:
            return None
        config = compile_config(trainer)
        facts = CompileFacts(
            stats=stats,
            decision=compile_decision(trainer),
            kernels=kernel_decisions(trainer),
            substituted=substituted_blocks(trainer),
            kernels_setting=config.kernels if config is not None else None,
            device=trainer.strategy.root_device,
        )
        return render_compile_card(facts)

    def _write(self, trainer: pl.Trainer) -> bool:
        """Write the card when it differs from the last one written; True when written."""
        writer = tensorboard_writer(trainer)
        text = self.card(trainer) if writer is not None else None
        if text is None or text == self._written:
            return False
        writer.add_text(COMPILE_CARD_TAG, text, trainer.global_step)
        self._written = text
        return True
