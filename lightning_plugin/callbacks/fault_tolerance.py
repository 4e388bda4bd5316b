"""`FaultTolerantCheckpoint`: a checkpoint on SIGTERM or on any exception that resumes exactly.

Two gaps in Lightning 2.6 close here:

* A single-process run only acts on SIGTERM at the *end of the epoch* (the fit loop checks
  ``received_sigterm`` there), so a preempted job can lose a whole epoch. This callback
  checks after every training step and stops right there.
* ``OnExceptionCheckpoint`` saves the loader position as it is when the exception hits,
  i.e. with the failed step's batch already taken, while the weights are those of the last
  finished step: resuming skips that batch. This callback saves the loader state recorded
  at the end of the last finished step instead, so the failed batch is replayed.

The loader must be resumable (``state_dict``/``load_state_dict``) and sized; unsized
loaders are prefetched one batch ahead by Lightning, so their position cannot be exact.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

__all__ = ["FaultTolerantCheckpoint"]


class FaultTolerantCheckpoint(OnExceptionCheckpoint):
    """Saves ``dirpath/filename.ckpt`` when training is interrupted; removes it after a clean finish.

    Resume with ``trainer.fit(model, ckpt_path=callback.ckpt_path)``.

    Args:
        dirpath: where to write the checkpoint.
        filename: file name without the ``.ckpt`` extension.
        stop_on_sigterm: in a single process, stop after the current training step when SIGTERM
            arrives (Lightning alone waits for the end of the epoch). Under DDP Lightning already
            broadcasts SIGTERM and stops before the next step; this callback then just saves.
    """

    def __init__(self, dirpath: _PATH, filename: str = "interrupted", stop_on_sigterm: bool = True) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath):
            raise ValueError(f"FaultTolerantCheckpoint: dirpath must be a non-empty path, got {dirpath!r}")
        super().__init__(dirpath, filename)
        self.stop_on_sigterm = stop_on_sigterm
        self._loader_states_at_step_end: list[dict[str, Any]] | None = None
        self._saving_after_exception = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remember_loader_states(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._remember_loader_states(trainer)
        if self.stop_on_sigterm and trainer.world_size == 1 and trainer.received_sigterm:
            rank_zero_info(f"SIGTERM received: stopping after global step {trainer.global_step}.")
            raise SIGTERMException

    @override
    def on_exception(self, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        if trainer.state.fn != "fit":
            return
        self._saving_after_exception = True
        try:
            trainer.save_checkpoint(self.ckpt_path)
        finally:
            self._saving_after_exception = False
        rank_zero_info(f"Interrupted at global step {trainer.global_step}; resume from {self.ckpt_path!r}.")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self._saving_after_exception or not _step_in_flight(trainer):
            return
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if "combined_loader" not in fit_state:
            return
        if self._loader_states_at_step_end is None:
            fit_state.pop("combined_loader")  # nothing finished in this run: restart the loader
        else:
            fit_state["combined_loader"] = copy.deepcopy(self._loader_states_at_step_end)

    def _remember_loader_states(self, trainer: pl.Trainer) -> None:
        combined = trainer.fit_loop._combined_loader
        if combined is None:
            return
        loaders = [loader for loader in combined.flattened if isinstance(loader, _Stateful)]
        self._loader_states_at_step_end = [copy.deepcopy(loader.state_dict()) for loader in loaders] or None


def _step_in_flight(trainer: pl.Trainer) -> bool:
    """True when the exception hit between taking a batch and finishing its optimizer step."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return progress.ready > progress.processed
