"""``layer_norm2d_act``: LayerNorm over the channels of an NCHW tensor (ConvNeXt's ``LayerNorm2d``) with a
fused residual add and activation, forward and backward, without the two permute copies of the eager module.

A program holds a [BLOCK_M pixels, all C channels] tile in registers: centred two-step variance, one read, one
write. Backward walks a chunk of pixels per program (``dx`` per pixel) and reduces ``dγ``/``dβ`` through
per-program partial rows summed in a fixed order.

* forward: ``x̂ = (x - μ_pixel)·rstd_pixel``, ``u = x̂·γ + β (+ residual)``, ``y = act(u)``;
* backward: ``g_u = g_y·act'(u)``, ``dβ = Σ g_u``, ``dγ = Σ g_u·x̂``, ``d residual = g_u``,
  ``dx = rstd·(γg_u - mean_C(γg_u) - x̂·mean_C(γg_u·x̂))``.

Op ``lcv::layer_norm2d_act`` → ``(y, mean, rstd)`` (``[N·H·W]`` statistics, not differentiable) and
``lcv::layer_norm2d_act_backward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lcv_kernels._common import (
    accumulation_dtype,
    as_dense,
    check_activation,
    dense_vector,
    empty_in_layout_of,
    launch_context,
    run_triton_or_reference,
)
from lcv_kernels._norm_common import (
    autocast_to_fp32,
    check_common,
    epilogue_flags,
    fake_grads,
    fuse_residual,
    norm_backward,
    num_warps,
    parallel_target,
    residual_like,
    row_chunks,
    row_strides,
    run_backward,
    share_state,
)
from lcv_kernels._triton import activate, grad_through_epilogue, load_channel_vector, row_offsets, tl, triton
from lcv_kernels.layer_norm2d_act_reference import (
    layer_norm2d_act_backward_reference,
    layer_norm2d_act_forward_reference,
)

__all__ = ["MAX_LAYERNORM_CHANNELS", "FusedLayerNorm2dAct", "layer_norm2d_act", "layer_norm2d_act_forward"]

#: Largest channel count the kernel keeps in registers; beyond it the launcher raises.
MAX_LAYERNORM_CHANNELS = 16384

# ---------------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _ln2d_fwd_kernel(
    # pointers
    x_ptr,
    res_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    # sizes and scalars
    M,
    C,
    HW,
    inv_c,
    eps,
    # strides
    sx_n,
    sx_hw,
    sx_c,
    sr_n,
    sr_hw,
    sr_c,
    sy_n,
    sy_hw,
    sy_c,
    # meta
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """A [BLOCK_M pixels, all C channels] tile: centred two-step variance in registers, one write."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_C).to(tl.int64)
    mask_m = rows < M
    mask_c = cols < C
    mask = mask_m[:, None] & mask_c[None, :]
    x = tl.load(
        x_ptr + row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    first = tl.sum(x, axis=1) * inv_c
    xc = tl.where(mask, x - first[:, None], 0.0)
    correction = tl.sum(xc, axis=1) * inv_c  # corrected two-pass: a mean of 1000 costs no accuracy
    mean = first + correction
    xc = tl.where(mask, xc - correction[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) * inv_c + eps)
    tl.store(mean_ptr + rows, mean, mask=mask_m)
    tl.store(rstd_ptr + rows, rstd, mask=mask_m)
    u = xc * rstd[:, None]
    if HAS_WEIGHT:
        u = u * tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        u += tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        r_offs = row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
        u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    y = activate(u, ACTIVATION)
    y_offs = row_offsets(rows, HW, sy_n, sy_hw)[:, None] + (cols * sy_c)[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln2d_bwd_kernel(
    # pointers
    g_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dres_ptr,
    pdw_ptr,
    pdb_ptr,
    # sizes and scalars
    M,
    C,
    HW,
    ROWS_PER_PROG,
    inv_c,
    # strides
    sg_n,
    sg_hw,
    sg_c,
    sx_n,
    sx_hw,
    sx_c,
    sr_n,
    sr_hw,
    sr_c,
    sd_n,
    sd_hw,
    sd_c,
    # meta
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_DX: tl.constexpr,
    WRITE_DRES: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Each program walks a chunk of pixels: dx per pixel, and its chunk's partial dγ, dβ rows."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    w = load_channel_vector(w_ptr, cols, mask_c, HAS_WEIGHT, 1.0)
    bias = load_channel_vector(b_ptr, cols, mask_c, HAS_BIAS, 0.0)
    acc_dw = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    start = pid * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = start + r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_c[None, :]
        x = tl.load(
            x_ptr + row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        g = tl.load(
            g_ptr + row_offsets(rows, HW, sg_n, sg_hw)[:, None] + (cols * sg_c)[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=mask_m, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=mask_m, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        r_offs = row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
        g = grad_through_epilogue(
            g, xhat, w[None, :], bias[None, :], res_ptr, r_offs, mask, HAS_RESIDUAL, ACTIVATION
        )
        g = tl.where(mask, g, 0.0)
        acc_db += g
        acc_dw += g * xhat
        d_offs = row_offsets(rows, HW, sd_n, sd_hw)[:, None] + (cols * sd_c)[None, :]
        if WRITE_DRES:
            tl.store(dres_ptr + d_offs, g.to(dres_ptr.dtype.element_ty), mask=mask)
        if WRITE_DX:
            wg = g * w[None, :]
            c_g = tl.sum(wg, axis=1) * inv_c
            c_gx = tl.sum(wg * xhat, axis=1) * inv_c
            dx = (wg - c_g[:, None] - xhat * c_gx[:, None]) * rstd[:, None]
            tl.store(dx_ptr + d_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(pdw_ptr + pid * C + cols, tl.sum(acc_dw, axis=0), mask=mask_c)
    tl.store(pdb_ptr + pid * C + cols, tl.sum(acc_db, axis=0), mask=mask_c)


# ---------------------------------------------------------------------------------------------------------
# Launchers: check → allocate → launch (the checks run in the op)


def _pixel_tile(channels: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C) for LayerNorm2d: all channels of a pixel in one tile, ~4K elements (untuned)."""
    if channels > MAX_LAYERNORM_CHANNELS:
        raise ValueError(
            f"LayerNorm2d kernel keeps a pixel's channels in registers: at most {MAX_LAYERNORM_CHANNELS} "
            f"channels, got {channels}"
        )
    block_c = triton.next_power_of_2(max(channels, 1))
    return max(1, 4096 // block_c), block_c


def layer_norm2d_act_forward_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over C (+residual)(+act) forward; returns ``(y, mean, rstd)`` with ``[N·H·W]`` fp32 stats."""
    n, c, h, w = x.shape
    m, hw = n * h * w, h * w
    block_m, block_c = _pixel_tile(c)
    weight, bias = dense_vector(weight), dense_vector(bias)
    y = empty_in_layout_of(x)
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    res = residual if residual is not None else x
    with launch_context(x):
        _ln2d_fwd_kernel[(triton.cdiv(m, block_m),)](
            x,
            res,
            y,
            weight if weight is not None else mean,
            bias if bias is not None else mean,
            mean,
            rstd,
            m,
            c,
            hw,
            1.0 / c,
            eps,
            *row_strides(x),
            *row_strides(res),
            *row_strides(y),
            **epilogue_flags(weight, bias, residual, activation),
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=num_warps(block_m * block_c),
        )
    return y, mean, rstd


def layer_norm2d_act_backward_triton(
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
    """``(dx, dγ, dβ, d residual)``: one pass; dγ/dβ reduced from per-program partial rows."""
    want_x, want_w, want_b, want_r = grad_mask
    n, c, h, w = x.shape
    m, hw = n * h * w, h * w
    block_m, block_c = _pixel_tile(c)
    rows_per, programs = row_chunks(m, block_m, parallel_target(x.device))
    pdw = torch.empty((programs, c), device=x.device, dtype=torch.float32)
    pdb = torch.empty((programs, c), device=x.device, dtype=torch.float32)
    weight, bias = dense_vector(weight), dense_vector(bias)
    dx = empty_in_layout_of(x) if want_x else None
    dres = empty_in_layout_of(x, residual.dtype) if (want_r and residual is not None) else None
    out = dx if dx is not None else (dres if dres is not None else x)
    res = residual if residual is not None else x
    with launch_context(x):
        _ln2d_bwd_kernel[(programs,)](
            grad_y,
            x,
            res,
            weight if weight is not None else mean,
            bias if bias is not None else mean,
            mean,
            rstd,
            dx if dx is not None else out,
            dres if dres is not None else out,
            pdw,
            pdb,
            m,
            c,
            hw,
            rows_per,
            1.0 / c,
            *row_strides(grad_y),
            *row_strides(x),
            *row_strides(res),
            *row_strides(out),
            **epilogue_flags(weight, bias, residual, activation),
            WRITE_DX=dx is not None,
            WRITE_DRES=dres is not None,
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=num_warps(block_m * block_c),
        )
    dw = pdw.sum(0) if want_w else None
    db = pdb.sum(0) if want_b else None
    return dx, dw, db, dres


# ---------------------------------------------------------------------------------------------------------
# torch.library ops


def check_layer_norm2d_act_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
) -> None:
    check_common(x, weight, bias, residual, activation, "layer_norm2d_act")


@torch.library.custom_op("lcv::layer_norm2d_act", mutates_args=())
def _layer_norm2d_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_layer_norm2d_act_args(x, weight, bias, residual, activation)
    args = (x, weight, bias, residual, eps, activation)
    return run_triton_or_reference(
        x, layer_norm2d_act_forward_triton, layer_norm2d_act_forward_reference, *args
    )


@_layer_norm2d_act_op.register_fake
def _layer_norm2d_act_fake(x, weight, bias, residual, eps, activation):
    check_layer_norm2d_act_args(x, weight, bias, residual, activation)
    acc = accumulation_dtype(x.dtype)
    rows = x.numel() // x.shape[1]
    return empty_in_layout_of(x), x.new_empty((rows,), dtype=acc), x.new_empty((rows,), dtype=acc)


@torch.library.custom_op("lcv::layer_norm2d_act_backward", mutates_args=())
def _layer_norm2d_act_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (grad_y, x, weight, bias, residual, mean, rstd, activation, grad_mask)
    return run_backward(x, layer_norm2d_act_backward_triton, layer_norm2d_act_backward_reference, *args)


@_layer_norm2d_act_backward_op.register_fake
def _layer_norm2d_act_backward_fake(grad_y, x, weight, bias, residual, mean, rstd, activation, grad_mask):
    return fake_grads(x, residual, grad_mask)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, residual, _eps, activation = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.activation = activation
    ctx.save_for_backward(x, weight, bias, residual, mean, rstd)


def _backward(ctx: Any, grad_y: torch.Tensor | None, _grad_mean: Any, _grad_rstd: Any) -> tuple:
    return (*norm_backward(ctx, grad_y, _layer_norm2d_act_backward_op, ctx.activation), None, None)


_layer_norm2d_act_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Functional API and module


def layer_norm2d_act(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(LayerNorm over the channels of x + residual)`` (ConvNeXt ``LayerNorm2d``) as one fused op.

    Equivalent to ``F.layer_norm(x.permute(0, 2, 3, 1), (C,), weight, bias, eps).permute(0, 3, 1, 2)``
    without the two layout copies; the output keeps ``x``'s memory format.
    """
    if autocast_to_fp32(x):
        x, residual = x.float(), None if residual is None else residual.float()
    return _layer_norm2d_act_op(x, weight, bias, residual, float(eps), activation)[0]


def layer_norm2d_act_forward(
    ln: nn.LayerNorm, x: torch.Tensor, activation: str = "none", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``act(LayerNorm2d(x) + residual)`` for an ``nn.LayerNorm`` applied over the channels of NCHW ``x``."""
    if tuple(ln.normalized_shape) != (x.shape[1],):
        raise ValueError(
            f"LayerNorm2d normalizes the {x.shape[1]} channels of x, but the module's normalized_shape is "
            f"{tuple(ln.normalized_shape)}"
        )
    x = as_dense(x)

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return layer_norm2d_act(x, ln.weight, ln.bias, ln.eps, activation=act, residual=residual_like(res, x))

    return fuse_residual(run, torch.float32 if autocast_to_fp32(x) else x.dtype, activation, residual)


class FusedLayerNorm2dAct(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (ConvNeXt ``LayerNorm2d``) + activation (+ residual),
    via ``lcv::layer_norm2d_act``; no permute copies, output in the input's memory format."""

    def __init__(self, num_channels: int, activation: str = "none", **kwargs: Any) -> None:
        check_activation(activation, type(self).__name__)
        super().__init__(num_channels, **kwargs)
        self.activation = activation

    @classmethod
    def from_module(cls, ln: nn.LayerNorm, act: nn.Module | None = None) -> FusedLayerNorm2dAct:
        """Wrap a LayerNorm applied over channels (torchvision's ``LayerNorm2d``), sharing its parameters."""
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(
                f"from_module expects an nn.LayerNorm (such as LayerNorm2d), got {type(ln).__name__}"
            )
        if len(ln.normalized_shape) != 1:
            raise ValueError(
                "LayerNorm2d normalizes one (channel) dimension; "
                f"normalized_shape is {tuple(ln.normalized_shape)}"
            )
        return share_state(ln, cls, act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(
                f"FusedLayerNorm2dAct expects a 4-D (N, C, H, W) input, got shape {tuple(x.shape)}"
            )
        return layer_norm2d_act_forward(self, x, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"
