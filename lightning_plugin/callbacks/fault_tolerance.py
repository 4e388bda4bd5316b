"""`FaultTolerantCheckpoint`: a checkpoint on SIGTERM or on any exception that resumes exactly.

Lightning (2.0 and later) already stops after the current training step when SIGTERM arrives
(``SIGTERMException``, broadcast from rank 0 under DDP) and calls ``on_exception``; what it
gets wrong is the loader position. ``OnExceptionCheckpoint`` saves the loader as it is when
the exception hits, i.e. with the failed step's batch already taken, while the weights are
those of the last finished step: resuming skips that batch. This callback saves the loader
state recorded at the end of the last finished step instead, so the failed batch is replayed.

The loader must be resumable (``state_dict``/``load_state_dict``) and sized; unsized
loaders are prefetched one batch ahead by Lightning, so their position cannot be exact.

Nothing is saved when no training step finished in this ``fit`` (a data error, a bad option, a
missing ``ckpt_path``): such a checkpoint would hold untrained (or merely reloaded) weights and
its "resume from" advice would hide the real error.
"""

from __future__ import annotations

import copy
import os
from typing import Any, cast

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.loops.progress import _ProcessedTracker
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

__all__ = ["FaultTolerantCheckpoint"]


class FaultTolerantCheckpoint(OnExceptionCheckpoint):
    """Saves ``dirpath/filename.ckpt`` when ``fit`` is interrupted; removes it after a clean finish.

    Resume with ``trainer.fit(model, ckpt_path=callback.ckpt_path)``. Under DDP every rank must
    reach the exception (as with SIGTERM, which Lightning broadcasts): saving is collective. After the
    resumed run finishes cleanly, the interrupted checkpoint it started from is removed, also when
    it lies in another folder (``lcv`` gives a resumed run a new version folder).

    Args:
        dirpath: where to write the checkpoint; ``None`` = the run's ``checkpoints`` folder (next to
            ``ModelCheckpoint``'s: ``<logger log_dir>/checkpoints``, or ``<default_root_dir>/checkpoints``
            without a logger), resolved when fit starts.
        filename: file name without the ``.ckpt`` extension.
    """

    def __init__(self, dirpath: _PATH | None = None, filename: str = "interrupted") -> None:
        if dirpath is not None and (not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath)):
            raise ValueError(
                f"FaultTolerantCheckpoint: dirpath must be a non-empty path or None, got {dirpath!r}"
            )
        super().__init__(dirpath if dirpath is not None else "", filename)
        self._resolve_dirpath = dirpath is None
        self._loader_states_at_step_end: list[dict[str, Any]] | None = None
        self._saving_after_exception = False
        self._steps_finished = 0  # optimizer steps finished in this fit
        self._resumed_from_interrupt = False

    @property
    @override
    def ckpt_path(self) -> str | None:  # type: ignore[override]  # widened: None until resolved
        """The checkpoint file; ``None`` while ``dirpath=None`` is not resolved yet (before fit starts)."""
        if self._resolve_dirpath and not self.dirpath:
            return None
        return super().ckpt_path

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._resolve_dirpath:
            root = trainer.log_dir if trainer.loggers else None
            dirpath = os.path.join(root or trainer.default_root_dir, "checkpoints")
            self.dirpath = trainer.strategy.broadcast(dirpath)  # rank 0's logger version decides

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_finished = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        combined = trainer.fit_loop._combined_loader
        loaders = combined.flattened if combined is not None else []
        plain = [type(loader).__name__ for loader in loaders if not isinstance(loader, _Stateful)]
        if plain:
            rank_zero_warn(
                f"FaultTolerantCheckpoint: the train loader ({', '.join(plain)}) has no state_dict()/"
                "load_state_dict(), so a run resumed from a mid-epoch interruption cannot continue at the "
                "same batch. Use a resumable loader (lcv_vision.data.DeviceLoader, torchdata's "
                "StatefulDataLoader).",
                category=UserWarning,
            )
        self._remember_loader_states(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps_finished += 1
        self._remember_loader_states(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if trainer.state.fn != "fit" or self._steps_finished == 0 or self.ckpt_path is None:
            return  # nothing trained in this fit: the error is all there is to report
        self._saving_after_exception = True
        try:
            trainer.save_checkpoint(self.ckpt_path, weights_only=False)
        finally:
            self._saving_after_exception = False
        rank_zero_info(
            f"Interrupted ({type(exception).__name__}) at global step {trainer.global_step}; "
            f"resume from {self.ckpt_path!r}."
        )

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

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"interrupted": self._saving_after_exception}  # marks the checkpoints this callback wrote

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_from_interrupt = bool(state_dict.get("interrupted", False))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.ckpt_path is not None:
            super().teardown(trainer, pl_module, stage)
        resumed = trainer.ckpt_path
        if stage != "fit" or not self._resumed_from_interrupt or not resumed or not os.path.isfile(resumed):
            return
        self._resumed_from_interrupt = False
        if self.ckpt_path is None or os.path.abspath(resumed) != os.path.abspath(self.ckpt_path):
            trainer.strategy.remove_checkpoint(resumed)
            rank_zero_info(f"Removed {resumed!r}: the interrupted run it holds has now finished.")

    def _remember_loader_states(self, trainer: pl.Trainer) -> None:
        combined = trainer.fit_loop._combined_loader
        if combined is None:
            return
        loaders = [loader for loader in combined.flattened if isinstance(loader, _Stateful)]
        self._loader_states_at_step_end = [copy.deepcopy(loader.state_dict()) for loader in loaders] or None


def _step_in_flight(trainer: pl.Trainer) -> bool:
    """True when the exception hit between taking a batch and finishing its optimizer step."""
    # the training epoch loop's batch progress counts with `_ProcessedTracker`s (declared as their base)
    progress = cast(_ProcessedTracker, trainer.fit_loop.epoch_loop.batch_progress.current)
    return progress.ready > progress.processed
