"""PyTorch references for the fused normalization ops: the ground truth the kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import apply_activation


def batch_norm_act_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(batch_norm(x) [+ residual]); running stats updated in place exactly like ``nn.BatchNorm2d``."""
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation)
