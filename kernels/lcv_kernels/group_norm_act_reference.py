"""PyTorch references for ``lcv::group_norm_act``: the oracle of the tests (:func:`group_norm_act_reference`)
and the exact forward/backward semantics the op runs on a CPU without ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lcv_kernels._common import accumulation_dtype, activation_grad, apply_activation, in_layout_of
from lcv_kernels._norm_common import affine, channel, grads_out


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
    y = apply_activation(affine(xhat, weight, bias, residual), activation)
    return in_layout_of(y, x), mean.reshape(-1), rstd.reshape(-1)


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
    u = affine(xhat, weight, bias, residual)
    gu = grad_y.to(acc) * activation_grad(u, activation)
    db, dw = gu.sum((0, 2, 3)), (gu * xhat).sum((0, 2, 3))
    wg = gu if weight is None else gu * channel(weight, acc)
    c_g = wg.reshape(n, num_groups, -1).mean(-1, keepdim=True)
    c_gx = (wg * xhat).reshape(n, num_groups, -1).mean(-1, keepdim=True)
    dx = wg.reshape(n, num_groups, -1) - c_g - xhat.reshape(n, num_groups, -1) * c_gx
    dx = (dx * rstd.to(acc).view(n, num_groups, 1)).reshape(x.shape)
    return grads_out(x, residual, dx, dw, db, gu, grad_mask)
