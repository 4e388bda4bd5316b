"""The callbacks ``lcv fit`` adds besides the plugin's: checkpoints that mean what their names say, a progress
bar and a model summary without noise, a throughput meter, and a logging interval that fits short epochs.

Each one fixes something a user of ``lcv`` read wrong with Lightning's defaults: ``last.ckpt`` holding an
early epoch (Lightning 2.6 rewrites it only when the monitored metric improves), ``Epoch 1/1`` shown for the
second of two epochs, a ``v_num: 0.000`` metric, a FLOPs column of zeros, an unexplained "Non-trainable
params" count (the EMA copy), and ``train/loss`` never logged when an epoch has fewer batches than the logging
interval.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_plugin.step_meter import StepMeter, StepTotals, device_timeline
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = [
    "BestAndLastCheckpoint",
    "FitLoggingInterval",
    "LcvModelSummary",
    "LcvProgressBar",
    "ThroughputMeter",
]


class ThroughputMeter(Callback):
    """Training images per second over the training batches of every epoch (validation excluded), on the same
    :class:`~lightning_plugin.step_meter.StepMeter` as ``TrainingMonitor``'s ``vitals/samples_per_sec``.

    An epoch's time runs from its start to its last training batch, so data loading counts but validation does
    not; on CUDA the time comes from events on the device's current stream, read once per epoch. An epoch
    resumed from a mid-epoch checkpoint (Lightning does not call ``on_train_epoch_start`` for it) starts its
    clock at its first batch.
    """

    def __init__(self) -> None:
        self.meter = StepMeter()
        #: one per finished training epoch
        self.epochs: list[StepTotals] = []

    @property
    def samples(self) -> int:
        return sum(epoch.samples for epoch in self.epochs)

    @property
    def seconds(self) -> float:
        return sum(epoch.busy_s for epoch in self.epochs)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.meter.timeline = device_timeline(trainer.strategy.root_device)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.meter.discard()

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.meter.step_started()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.step_ended(int(batch[0].shape[0]))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.meter.discard()  # a mid-epoch validation is not training time

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = self.meter.take()
        if epoch.steps:
            self.epochs.append(epoch)

    def images_per_second(self, skip_first_epoch: bool = False) -> float | None:
        """All epochs, or all but the first (which includes compilation and warm-up)."""
        epochs = self.epochs[1:] if skip_first_epoch else self.epochs
        return sum(epochs, StepTotals()).samples_per_sec


class BestAndLastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is always the latest state: rewritten after every validation
    and at the end of every training epoch and of training, whether or not the monitored metric improved.

    It also remembers the best checkpoint of the run it resumed from when that run wrote to another folder
    (Lightning then does not restore it), so a summary can name the best of the whole training.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_last") is None:  # also when a CLI passes the parent's default explicitly
            kwargs["save_last"] = True
        super().__init__(*args, **kwargs)
        self._last_saved_at: int | None = None
        self.resumed_best: tuple[float, str] | None = None  # (score, path) of the run resumed from

    def _refresh_last(self, trainer: Trainer) -> None:
        if (
            not self.save_last
            or runtime_attributes(trainer).fast_dev_run
            or trainer.sanity_checking
            or trainer.state.fn != "fit"
        ):
            return
        if self._last_saved_at != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_saved_at = trainer.global_step

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):  # else the epoch's end saves, after the best
            self._refresh_last(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._refresh_last(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with warnings.catch_warnings():  # "The dirpath has changed ...": the resumed run's best is kept below
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)
        score, path = state_dict.get("best_model_score"), state_dict.get("best_model_path")
        if state_dict.get("dirpath", self.dirpath) != self.dirpath and score is not None and path:
            self.resumed_best = (float(score), str(path))

    def best(self) -> tuple[float, str] | None:
        """``(score, path)`` of the best checkpoint of the whole training, resumed runs included."""
        candidates = []
        if self.best_model_score is not None and self.best_model_path:
            candidates.append((float(self.best_model_score), self.best_model_path))
        if self.resumed_best is not None:
            candidates.append(self.resumed_best)
        if not candidates:
            return None
        pick = max if self.mode == "max" else min
        return pick(candidates, key=lambda c: c[0])


class LcvProgressBar(RichProgressBar):
    """Rich progress bar that counts epochs from 1 (``Epoch 2/2`` for the last of two) and shows no
    ``v_num``."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        text = f"Epoch {current_epoch + 1}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            text += f"/{self.trainer.max_epochs}"
        if len(self.validation_description) > len(text):
            text = f"{text:{len(self.validation_description)}}"  # same width as "Validation": no flicker
        return text

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version folder, not a metric
        return items


class LcvModelSummary(ModelSummary):
    """A short model summary: the top-level modules with parameters, and what the parameter counts mean.

    Lightning's table adds a FLOPs column that is all zeros unless the module has an ``example_input_array``,
    and counts the EMA copy as "non-trainable params" without saying so.
    """

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        rows = []
        for name, child in pl_module.named_children():
            count = sum(p.numel() for p in child.parameters())
            if count:
                trained = sum(p.numel() for p in child.parameters() if p.requires_grad)
                role = (
                    "trained"
                    if trained == count
                    else ("not trained" if trained == 0 else f"{get_human_readable_count(trained)} trained")
                )
                if name == "ema":
                    role = "not trained: the moving average of `model`'s weights, used to evaluate"
                rows.append((name, type(child).__name__, get_human_readable_count(count), role))
        if not rows:
            return
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
        total = sum(p.numel() for p in pl_module.parameters())
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        size_mb = sum(p.numel() * p.element_size() for p in pl_module.parameters()) / 1e6
        lines.append(
            f"{get_human_readable_count(trainable)} trainable parameters of "
            f"{get_human_readable_count(total)} ({size_mb:.1f} MB)"
        )
        rank_zero_info("\n".join(lines))


class FitLoggingInterval(Callback):
    """Lowers ``Trainer.log_every_n_steps`` to the number of training batches per epoch when an epoch is
    shorter, so per-step metrics (``train/loss``) are logged at least once an epoch instead of never.

    Runs in ``setup``, after the datamodule's and before Lightning sizes the training loop."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        count = getattr(runtime_attributes(trainer).datamodule, "num_train_batches", None)
        if stage != "fit" or count is None:
            return
        batches = count()
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            batches = min(batches, limit)
        elif limit is not None and limit < 1.0:
            batches = int(batches * limit)
        attributes = runtime_attributes(trainer)
        if 0 < batches < attributes.log_every_n_steps:
            attributes.log_every_n_steps = batches
