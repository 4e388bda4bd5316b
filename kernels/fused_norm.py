"""Normalization modules with a fused activation (+ residual), drop-in for ``nn.BatchNorm2d`` + act.

``FusedBatchNormAct`` subclasses ``nn.BatchNorm2d`` so parameter names, buffers and state_dict keys
are unchanged: checkpoints stay interchangeable with eager models.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels._common import ACTIVATIONS
from kernels.norm_reference import batch_norm_act_reference

_ACT_MODULES: dict[type[nn.Module], str] = {nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "silu"}


def activation_name(module: nn.Module | None) -> str | None:
    """Our activation name for an activation module, or None if it cannot be fused."""
    if module is None:
        return "none"
    if isinstance(module, nn.GELU) and module.approximate != "none":
        return None
    return _ACT_MODULES.get(type(module))


class FusedBatchNormAct(nn.BatchNorm2d):
    """BatchNorm2d followed by an activation (and optional residual add before it) in one op."""

    def __init__(self, num_features: int, activation: str = "relu", **kwargs: object) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        super().__init__(num_features, **kwargs)  # type: ignore[arg-type]
        self.activation = activation

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, act: nn.Module | None = None) -> FusedBatchNormAct:
        """Wrap an existing BatchNorm2d, sharing its parameters and buffers (no copy)."""
        if not isinstance(bn, nn.BatchNorm2d):
            raise TypeError(f"from_module expects nn.BatchNorm2d, got {type(bn).__name__}")
        name = activation_name(act)
        if name is None:
            raise ValueError(f"activation {type(act).__name__} cannot be fused; supported: {sorted(_ACT_MODULES, key=str)}")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.__dict__.update({k: v for k, v in bn.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")})
        fused._parameters = bn._parameters
        fused._buffers = bn._buffers
        fused._modules = dict(bn._modules)
        fused.activation = name
        return fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        return batch_norm_act_reference(
            x, self.weight, self.bias,
            self.running_mean if track else None, self.running_var if track else None,
            use_batch, momentum, self.eps, self.activation, residual,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"
