"""Weight averaging: an exponential moving average of a model, and airbench's lookahead variant.

Why a full-state copy (parameters *and* buffers): evaluating averaged weights with the live
model's BatchNorm statistics mixes two different networks; averaging the running statistics
too keeps the evaluated network self-consistent.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from typing_extensions import override

__all__ = ["ModelEMA", "ema_warmup_decay", "lookahead_decay"]


class ModelEMA(nn.Module):
    """Keeps ``average = decay * average + (1 - decay) * live`` over a model's whole state.

    Floating-point tensors are averaged; integer buffers (e.g. BN's ``num_batches_tracked``)
    are copied. The copy is frozen (``requires_grad=False``) and never seen by the optimizer.

    Args:
        model: the live model to shadow; it is deep-copied once.
        decay: default decay in [0, 1); 0 copies the live weights.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        super().__init__()
        _check_decay(decay)
        self.decay = decay
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        self.module.eval()

    @torch.no_grad()
    def update(self, model: nn.Module, decay: float | None = None) -> None:
        """Move the average towards ``model`` by ``1 - decay``."""
        decay = self.decay if decay is None else decay
        _check_decay(decay)
        live = model.state_dict()
        # Grouped by tensor type: under FSDP2 the parameters are DTensor shards and the buffers plain tensors,
        # and one multi-tensor op refuses a mix of both.
        groups: dict[type, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for name, average in self.module.state_dict().items():
            value = live[name].detach()
            if average.is_floating_point():
                averages, values = groups.setdefault(type(average), ([], []))
                averages.append(average)
                values.append(value.to(average.dtype))
            else:
                average.copy_(value)
        for averages, values in groups.values():  # one fused multi-tensor op instead of a kernel per tensor
            torch._foreach_lerp_(averages, values, 1.0 - decay)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Load the averaged state into ``model`` (the lookahead reset)."""
        live = model.state_dict()
        for name, average in self.module.state_dict().items():
            live[name].copy_(average)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @override
    def train(self, mode: bool = True) -> ModelEMA:
        # The average is only ever evaluated; BN must use its (averaged) running statistics.
        super().train(mode)
        self.module.eval()
        return self


def ema_warmup_decay(decay: float, updates_before: int) -> float:
    """The decay of an EMA update after ``updates_before`` others: ``min(decay, (1 + k) / (10 + k))``.

    Why: with a decay meant for a long run (0.9999 per update) an average over a few hundred updates never
    leaves the initial weights. This warm-up (TensorFlow's ``ExponentialMovingAverage(num_updates=)``) keeps
    the average's horizon near a tenth of the updates so far, until ``decay`` takes over."""
    k = max(int(updates_before), 0)
    return min(decay, (1.0 + k) / (10.0 + k))


def lookahead_decay(step: int, total_steps: int, every_n_steps: int = 5, base: float = 0.95) -> float:
    """airbench's schedule: ``base**every_n_steps * (step / total_steps)**3``, near 0 early, ~0.77 at the
    end."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    progress = min(max(step / total_steps, 0.0), 1.0)
    return base**every_n_steps * progress**3


def _check_decay(decay: float) -> None:
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"EMA decay must be in [0, 1), got {decay!r}")
