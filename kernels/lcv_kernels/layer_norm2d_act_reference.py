"""PyTorch references for ``lcv::layer_norm2d_act`` (LayerNorm over the channels of NCHW, ConvNeXt's
``LayerNorm2d``): the oracle of the tests (:func:`layer_norm2d_act_reference`) and the exact forward/backward
semantics the op runs on a CPU without ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lcv_kernels._common import accumulation_dtype, activation_grad, apply_activation, in_layout_of
from lcv_kernels._norm_common import affine, channel, grads_out


def layer_norm2d_act_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(LayerNorm over the channels of an NCHW tensor [+ residual]): permute to NHWC, ``F.layer_norm`` over
    the last dim, permute back."""
    y = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), weight, bias, eps).permute(0, 3, 1, 2)
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation)


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
    y = apply_activation(affine((xf - mean) * rstd, weight, bias, residual), activation)
    return in_layout_of(y, x), mean.reshape(-1), rstd.reshape(-1)


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
    u = affine(xhat, weight, bias, residual)
    gu = grad_y.to(acc) * activation_grad(u, activation)
    db, dw = gu.sum((0, 2, 3)), (gu * xhat).sum((0, 2, 3))
    wg = gu if weight is None else gu * channel(weight, acc)
    dx = rstd4 * (wg - wg.mean(1, keepdim=True) - xhat * (wg * xhat).mean(1, keepdim=True))
    return grads_out(x, residual, dx, dw, db, gu, grad_mask)
