"""PyTorch references for ``lcv::batch_norm_act``: the ground truth its kernels are tested against.

* :func:`batch_norm_act_reference`: what a model computes without our kernels (``F.batch_norm`` →
  ``+ residual`` → activation), the oracle of the tests;
* ``batch_norm_act_forward_reference`` / ``..._backward_reference``: the exact semantics of the op and its
  backward op (the statistics they return, the explicit gradient formulas), which the op runs on a CPU without
  ``TRITON_INTERPRET=1``.

All arithmetic is fp32 (float64 for float64 inputs, as under gradcheck), whatever the storage dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lcv_kernels._common import accumulation_dtype, activation_grad, apply_activation, in_layout_of
from lcv_kernels._norm_common import affine, channel, grads_out


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


def batch_norm_act_forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    batch_mean: torch.Tensor | None,
    batch_var: torch.Tensor | None,
    use_batch_stats: bool,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, var)`` of ``lcv::batch_norm_act``: the batch statistics (biased variance) over N, H, W —
    ``batch_mean``/``batch_var`` when given (a conv epilogue's) — or the running statistics in eval."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    if not use_batch_stats:
        assert running_mean is not None and running_var is not None  # the op's contract: eval has them
        mean, var = running_mean.to(acc), running_var.to(acc)
    elif batch_mean is not None:
        assert batch_var is not None  # the op's contract: given together
        mean, var = batch_mean.to(acc), batch_var.to(acc)
    else:
        var, mean = torch.var_mean(xf, dim=(0, 2, 3), unbiased=False)
    xhat = (xf - channel(mean, acc)) * torch.rsqrt(channel(var, acc) + eps)
    y = apply_activation(affine(xhat, weight, bias, residual), activation)
    return in_layout_of(y, x), mean.clone(), var.clone()


def batch_norm_act_backward_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    use_batch_stats: bool,
    eps: float,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dγ, dβ, d residual)``: ``g_u = g·act'(u)``; ``dβ = Σg_u``; ``dγ = Σg_u·x̂``;
    ``dx = γ·rstd·(g_u - mean g_u - x̂·mean(g_u·x̂))`` with batch statistics, ``γ·rstd·g_u`` without."""
    acc = accumulation_dtype(x.dtype)
    rstd = torch.rsqrt(channel(var, acc) + eps)
    xhat = (x.to(acc) - channel(mean, acc)) * rstd
    u = affine(xhat, weight, bias, residual)
    gu = grad_y.to(acc) * activation_grad(u, activation)
    dims = (0, 2, 3)
    db, dw = gu.sum(dims), (gu * xhat).sum(dims)
    scale = rstd if weight is None else rstd * channel(weight, acc)
    if use_batch_stats:
        dx = scale * (gu - gu.mean(dims, keepdim=True) - xhat * (gu * xhat).mean(dims, keepdim=True))
    else:
        dx = scale * gu
    return grads_out(x, residual, dx, dw, db, gu, grad_mask)
