"""`NonFiniteLossGuard`: stop at the first NaN/Inf loss, before it reaches the weights.

A NaN loss turns every weight into NaN at the next optimizer step, and the run then keeps
"training" silently. The guard checks the loss right before ``backward`` (so the error
names the step where it happened, not a later symptom) and either raises or stops the
run with the weights of the last good step.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["NonFiniteLossError", "NonFiniteLossGuard"]

_ACTIONS = ("raise", "stop")


class NonFiniteLossError(RuntimeError):
    """The training loss (or a gradient) was NaN or infinite."""


class NonFiniteLossGuard(Callback):
    """Checks the training loss (and optionally the gradients) for NaN/Inf.

    Args:
        action: ``"raise"`` raises :class:`NonFiniteLossError` (with ``OnExceptionCheckpoint`` or
            ``FaultTolerantCheckpoint`` the checkpoint then holds the last finite weights);
            ``"stop"`` warns, drops the gradients of the bad step so the optimizer leaves the
            weights alone, and ends ``fit`` gracefully.
        check_every_n_steps: check one step in N. Each check reads one scalar back from the
            device (a sync); a skipped NaN is caught at the next check, which names that step.
            Under DDP each check also gathers every rank's verdict (one tiny collective), so
            all ranks stop together: a rank that raised alone would leave the others waiting
            in the gradient all-reduce, and one that skipped its update alone would leave the
            ranks with different weights.
        check_grads: also check every gradient before the optimizer step and name the first
            non-finite parameter. Skipped when a ``GradScaler`` is active (fp16 AMP), whose
            overflow steps are expected and handled by the scaler.
    """

    def __init__(
        self,
        action: Literal["raise", "stop"] = "raise",
        check_every_n_steps: int = 1,
        check_grads: bool = False,
    ) -> None:
        super().__init__()
        if action not in _ACTIONS:
            raise ValueError(f"NonFiniteLossGuard: action must be one of {list(_ACTIONS)}, got {action!r}")
        if (
            isinstance(check_every_n_steps, bool)
            or not isinstance(check_every_n_steps, int)
            or check_every_n_steps < 1
        ):
            raise ValueError(
                f"NonFiniteLossGuard: check_every_n_steps must be a positive int, got {check_every_n_steps!r}"
            )
        if not isinstance(check_grads, bool):
            raise TypeError(f"NonFiniteLossGuard: check_grads must be a bool, got {check_grads!r}")
        self.action = action
        self.check_every_n_steps = check_every_n_steps
        self.check_grads = check_grads
        self._drop_step = False
        #: The message of the last detection, or None (read it after ``fit`` with ``action="stop"``).
        self.last_detection: str | None = None

    def _due(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step % self.check_every_n_steps == 0

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if not self._due(trainer) or not isinstance(loss, torch.Tensor):
            return
        finite = bool(torch.isfinite(loss.detach()).all())
        bad_ranks = _ranks_with_bad_loss(trainer, not finite, loss.device)
        if not bad_ranks:
            return
        what = f"the training loss is {_describe(loss)}" if not finite else "the training loss is non-finite"
        if trainer.world_size > 1:
            what += f" on rank(s) {bad_ranks}"
        self._detected(trainer, what)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.check_grads and not self._drop_step and self._due(trainer) and not _uses_grad_scaler(trainer):
            for name, param in pl_module.named_parameters():
                if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                    self._detected(trainer, f"the gradient of {name!r} contains {_describe(param.grad)}")
                    break
        if self._drop_step:
            # Optimizers skip parameters whose grad is None: the bad step changes no weight.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._drop_step:
            self._drop_step = False
            trainer.should_stop = True

    def _detected(self, trainer: pl.Trainer, what: str) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        message = (
            f"Non-finite value at global step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {epoch_loop.batch_idx}): {what}."
        )
        self.last_detection = message
        if self.action == "raise":
            raise NonFiniteLossError(
                message + " Training stopped before this step changed the weights "
                "(NonFiniteLossGuard(action='raise')). Common causes: a learning rate too high, "
                "fp16 overflow without loss scaling, log/sqrt/division of zero, bad input data."
            )
        self._drop_step = True
        warnings.warn(
            message + " Stopping: this step's update is skipped (NonFiniteLossGuard(action='stop')).",
            stacklevel=2,
        )


def _ranks_with_bad_loss(trainer: pl.Trainer, bad: bool, device: torch.device) -> list[int]:
    """The global ranks whose loss is non-finite (every rank gets the same list)."""
    if trainer.world_size == 1:
        return [0] if bad else []
    flags = trainer.strategy.all_gather(torch.tensor([int(bad)], device=device))
    return [int(rank) for rank in torch.nonzero(flags.reshape(-1)).reshape(-1).tolist()]


def _describe(tensor: torch.Tensor) -> str:
    values = tensor.detach().float()
    kinds = []
    if bool(torch.isnan(values).any()):
        kinds.append("nan")
    if bool(torch.isposinf(values).any()):
        kinds.append("+inf")
    if bool(torch.isneginf(values).any()):
        kinds.append("-inf")
    if values.numel() == 1:
        value = float(values)
        return "nan" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
    return "/".join(kinds) + f" ({int((~torch.isfinite(values)).sum())} of {values.numel()} values)"


def _uses_grad_scaler(trainer: pl.Trainer) -> bool:
    return getattr(trainer.precision_plugin, "scaler", None) is not None
