"""PyTorch references for the fused normalization ops: the ground truth the kernels are tested against.

Two kinds:

* *eager-sequence* references (``batch_norm_act_reference`` …) written with ``torch.nn.functional``:
  what a model computes without our kernels, used as the oracle by tests;
* *op* references (``*_forward_reference`` / ``*_backward_reference``): the exact semantics of the
  ``lcv::`` ops, including the statistics they return and the explicit backward formulas. These are what
  the registered ops run on a CPU without ``TRITON_INTERPRET=1``.

All arithmetic is fp32 (or float64 for float64 inputs, used by gradcheck), whatever the storage dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._common import activation_grad, apply_activation
from kernels.conv_reference import accumulation_dtype


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


def group_norm_act_reference(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(group_norm(x) [+ residual]) with ``F.group_norm``."""
    y = F.group_norm(x, num_groups, weight, bias, eps)
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation)


def layer_norm2d_act_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(LayerNorm over the channels of an NCHW tensor [+ residual]), the ConvNeXt ``LayerNorm2d``:
    permute to NHWC, ``F.layer_norm`` over the last dim, permute back."""
    y = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), weight, bias, eps).permute(0, 3, 1, 2)
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation)


# ---------------------------------------------------------------------------------------------------------
# Op references


def _channel(v: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    return None if v is None else v.to(acc).view(1, -1, 1, 1)


def _affine(
    xhat: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    acc = xhat.dtype
    u = xhat if weight is None else xhat * _channel(weight, acc)
    if bias is not None:
        u = u + _channel(bias, acc)
    if residual is not None:
        u = u + residual.to(acc)
    return u


def _like(values: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` in a fresh tensor with ``like``'s strides (what ``empty_like`` gives the kernels)."""
    out = torch.empty_like(like, dtype=dtype or like.dtype)
    out.copy_(values)
    return out


def _grads_out(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    gu: torch.Tensor,
    grad_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    want_x, want_w, want_b, want_r = grad_mask
    return (
        _like(dx, x) if want_x else None,
        dw if want_w else None,
        db if want_b else None,
        _like(gu, x, residual.dtype) if (want_r and residual is not None) else None,
    )


def batch_norm_act_forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    sums: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    use_batch_stats: bool,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, var)`` of ``lcv::batch_norm_act``: batch statistics (biased variance) over N, H, W —
    from ``sums``/``sumsq`` (``Σx``, ``Σx²`` per channel) when given — or the running statistics."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    if not use_batch_stats:
        mean, var = running_mean.to(acc), running_var.to(acc)
    elif sums is not None:
        count = x.numel() // x.shape[1]
        mean = sums.to(acc) / count
        var = (sumsq.to(acc) / count - mean * mean).clamp_min(0.0)
    else:
        var, mean = torch.var_mean(xf, dim=(0, 2, 3), unbiased=False)
    xhat = (xf - _channel(mean, acc)) * torch.rsqrt(_channel(var, acc) + eps)
    y = apply_activation(_affine(xhat, weight, bias, residual), activation)
    return _like(y, x), mean.clone(), var.clone()


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
    rstd = torch.rsqrt(_channel(var, acc) + eps)
    xhat = (x.to(acc) - _channel(mean, acc)) * rstd
    u = _affine(xhat, weight, bias, residual)
    gu = grad_y.to(acc) * activation_grad(u, activation)
    dims = (0, 2, 3)
    db, dw = gu.sum(dims), (gu * xhat).sum(dims)
    scale = rstd if weight is None else rstd * _channel(weight, acc)
    if use_batch_stats:
        dx = scale * (gu - gu.mean(dims, keepdim=True) - xhat * (gu * xhat).mean(dims, keepdim=True))
    else:
        dx = scale * gu
    return _grads_out(x, residual, dx, dw, db, gu, grad_mask)


def _group_xhat(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, groups: int) -> torch.Tensor:
    n = x.shape[0]
    xg = x.reshape(n, groups, -1)
    return ((xg - mean.view(n, groups, 1)) * rstd.view(n, groups, 1)).reshape(x.shape)


def group_norm_act_forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` of ``lcv::group_norm_act``; statistics are ``[N·G]`` (sample-major)."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    var, mean = torch.var_mean(xf.reshape(x.shape[0], num_groups, -1), dim=-1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    xhat = _group_xhat(xf, mean, rstd, num_groups)
    y = apply_activation(_affine(xhat, weight, bias, residual), activation)
    return _like(y, x), mean.reshape(-1), rstd.reshape(-1)


def group_norm_act_backward_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    num_groups: int,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dx = rstd·(γg_u - mean_group(γg_u) - x̂·mean_group(γg_u·x̂))``; dγ, dβ summed over N, H, W."""
    acc = accumulation_dtype(x.dtype)
    n = x.shape[0]
    xhat = _group_xhat(x.to(acc), mean.to(acc), rstd.to(acc), num_groups)
    u = _affine(xhat, weight, bias, residual)
    gu = grad_y.to(acc) * activation_grad(u, activation)
    db, dw = gu.sum((0, 2, 3)), (gu * xhat).sum((0, 2, 3))
    wg = gu if weight is None else gu * _channel(weight, acc)
    c_g = wg.reshape(n, num_groups, -1).mean(-1, keepdim=True)
    c_gx = (wg * xhat).reshape(n, num_groups, -1).mean(-1, keepdim=True)
    dx = wg.reshape(n, num_groups, -1) - c_g - xhat.reshape(n, num_groups, -1) * c_gx
    dx = (dx * rstd.to(acc).view(n, num_groups, 1)).reshape(x.shape)
    return _grads_out(x, residual, dx, dw, db, gu, grad_mask)


def layer_norm2d_act_forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` of ``lcv::layer_norm2d_act``; statistics are ``[N·H·W]`` (row ``n·HW + hw``)."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    var, mean = torch.var_mean(xf, dim=1, keepdim=True, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    y = apply_activation(_affine((xf - mean) * rstd, weight, bias, residual), activation)
    return _like(y, x), mean.reshape(-1), rstd.reshape(-1)


def layer_norm2d_act_backward_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dx = rstd·(γg_u - mean_C(γg_u) - x̂·mean_C(γg_u·x̂))`` per pixel; dγ, dβ summed over N, H, W."""
    acc = accumulation_dtype(x.dtype)
    n, _, h, w = x.shape
    mean4, rstd4 = mean.to(acc).view(n, 1, h, w), rstd.to(acc).view(n, 1, h, w)
    xhat = (x.to(acc) - mean4) * rstd4
    u = _affine(xhat, weight, bias, residual)
    gu = grad_y.to(acc) * activation_grad(u, activation)
    db, dw = gu.sum((0, 2, 3)), (gu * xhat).sum((0, 2, 3))
    wg = gu if weight is None else gu * _channel(weight, acc)
    dx = rstd4 * (wg - wg.mean(1, keepdim=True) - xhat * (wg * xhat).mean(1, keepdim=True))
    return _grads_out(x, residual, dx, dw, db, gu, grad_mask)
