"""``group_norm_act``: GroupNorm with a fused residual add and activation, forward and backward.

One program per (sample, group) reads the group twice forward (statistics, then output) and twice backward
(reductions, then ``dx``). Statistics merge each tile's centred (count, mean, M2) in a fixed order, so they
are well conditioned at any mean and deterministic. Arithmetic is fp32 whatever the storage dtype; a tensor is
seen as ``N·H·W`` rows of ``C`` channels (NCHW or channels_last, see ``lcv_kernels._norm_common.row_strides``).

* forward: ``x̂ = (x - μ_g)·rstd_g``, ``u = x̂·γ + β (+ residual)``, ``y = act(u)``;
* backward: ``g_u = g_y·act'(u)``, ``dβ = Σ g_u``, ``dγ = Σ g_u·x̂``, ``d residual = g_u``,
  ``dx = rstd·(γg_u - mean_g(γg_u) - x̂·mean_g(γg_u·x̂))``.

Op ``lcv::group_norm_act`` → ``(y, mean, rstd)`` (``[N·G]`` statistics, not differentiable) and
``lcv::group_norm_act_backward``. Arguments are checked as ``F.group_norm`` checks them (same exception
types).
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
    residual_like,
    row_strides,
    run_backward,
    share_state,
)
from lcv_kernels._triton import activate, chan_merge, grad_through_epilogue, load_channel_vector, tl, triton
from lcv_kernels.group_norm_act_reference import (
    group_norm_act_backward_reference,
    group_norm_act_forward_reference,
)

__all__ = ["FusedGroupNormAct", "group_norm_act", "group_norm_act_forward"]

# ---------------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _gn_fwd_kernel(
    # pointers
    x_ptr,
    res_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    # sizes and scalars
    HW,
    G,
    CG,
    inv_count,
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
    BLOCK_HW: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    c_first = (pid % G) * CG
    # Each [BLOCK_HW, BLOCK_C] tile is centred in registers and merged into the group's (count, mean, M2).
    count = tl.zeros((), dtype=tl.float32)
    mean = tl.zeros((), dtype=tl.float32)
    m2 = tl.zeros((), dtype=tl.float32)
    for c0 in range(0, CG, BLOCK_C):
        in_group = c0 + tl.arange(0, BLOCK_C)
        cols = c_first + in_group.to(tl.int64)
        mask_c = in_group < CG
        for hw0 in range(0, HW, BLOCK_HW):
            hws = hw0 + tl.arange(0, BLOCK_HW).to(tl.int64)
            mask = (hws < HW)[:, None] & mask_c[None, :]
            x = tl.load(
                x_ptr + n * sx_n + (hws * sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            tile_count = tl.maximum(tl.sum(tl.sum(mask.to(tl.float32), axis=1), axis=0), 1.0)
            first = tl.sum(tl.sum(x, axis=1), axis=0) / tile_count
            d = tl.where(mask, x - first, 0.0)
            d_sum = tl.sum(tl.sum(d, axis=1), axis=0)
            tile_mean = first + d_sum / tile_count  # corrected two-pass, as lcv_kernels._triton.tile_mean_m2
            tile_m2 = tl.sum(tl.sum(d * d, axis=1), axis=0) - d_sum * d_sum / tile_count
            count, mean, m2 = chan_merge(count, mean, m2, tile_count, tile_mean, tile_m2)
    rstd = 1.0 / tl.sqrt(m2 * inv_count + eps)
    tl.store(mean_ptr + pid, mean)
    tl.store(rstd_ptr + pid, rstd)
    for c0 in range(0, CG, BLOCK_C):
        in_group = c0 + tl.arange(0, BLOCK_C)
        cols = c_first + in_group.to(tl.int64)
        mask_c = in_group < CG
        scale = tl.zeros((BLOCK_C,), dtype=tl.float32) + rstd
        if HAS_WEIGHT:
            scale = scale * tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
        for hw0 in range(0, HW, BLOCK_HW):
            hws = hw0 + tl.arange(0, BLOCK_HW).to(tl.int64)
            mask = (hws < HW)[:, None] & mask_c[None, :]
            x = tl.load(
                x_ptr + n * sx_n + (hws * sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            u = (x - mean) * scale[None, :]
            if HAS_BIAS:
                u += bias[None, :]
            if HAS_RESIDUAL:
                r_offs = n * sr_n + (hws * sr_hw)[:, None] + (cols * sr_c)[None, :]
                u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
            y = activate(u, ACTIVATION)
            y_offs = n * sy_n + (hws * sy_hw)[:, None] + (cols * sy_c)[None, :]
            tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue_grad_tile(
    x_ptr,
    g_ptr,
    res_ptr,
    n,
    hws,
    cols,
    mask,
    mean,
    rstd,
    w,
    bias,
    sx_n,
    sx_hw,
    sx_c,
    sg_n,
    sg_hw,
    sg_c,
    sr_n,
    sr_hw,
    sr_c,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """One ``[BLOCK_HW, BLOCK_C]`` tile of sample ``n``: ``(g_u, x̂)``, the gradient at the epilogue's input
    and the normalised input. Both backward passes recompute it (cheaper than storing ``g_u``)."""
    x = tl.load(x_ptr + n * sx_n + (hws * sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + n * sg_n + (hws * sg_hw)[:, None] + (cols * sg_c)[None, :], mask=mask, other=0.0)
    xhat = (x.to(tl.float32) - mean) * rstd
    r_offs = n * sr_n + (hws * sr_hw)[:, None] + (cols * sr_c)[None, :]
    g = grad_through_epilogue(
        g.to(tl.float32), xhat, w[None, :], bias[None, :], res_ptr, r_offs, mask, HAS_RESIDUAL, ACTIVATION
    )
    return g, xhat


@triton.jit
def _gn_bwd_kernel(
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
    C,
    HW,
    G,
    CG,
    inv_count,
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
    BLOCK_HW: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 1: per-channel Σg_u, Σg_u·x̂ of this sample (→ ``[N, C]`` partials of dβ, dγ) and the group's
    Σγg_u, Σγg_u·x̂. Pass 2: ``dx = rstd·(γg_u - mean(γg_u) - x̂·mean(γg_u·x̂))`` and ``d residual = g_u``."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // G
    c_first = (pid % G) * CG
    mean = tl.load(mean_ptr + pid)
    rstd = tl.load(rstd_ptr + pid)
    acc_wg = tl.zeros((BLOCK_C,), dtype=tl.float32)
    acc_wgx = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, CG, BLOCK_C):
        in_group = c0 + tl.arange(0, BLOCK_C)
        cols = c_first + in_group.to(tl.int64)
        mask_c = in_group < CG
        w = load_channel_vector(w_ptr, cols, mask_c, HAS_WEIGHT, 1.0)
        bias = load_channel_vector(b_ptr, cols, mask_c, HAS_BIAS, 0.0)
        acc_g = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
        acc_gx = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
        for hw0 in range(0, HW, BLOCK_HW):
            hws = hw0 + tl.arange(0, BLOCK_HW).to(tl.int64)
            mask = (hws < HW)[:, None] & mask_c[None, :]
            g, xhat = _epilogue_grad_tile(
                x_ptr,
                g_ptr,
                res_ptr,
                n,
                hws,
                cols,
                mask,
                mean,
                rstd,
                w,
                bias,
                sx_n,
                sx_hw,
                sx_c,
                sg_n,
                sg_hw,
                sg_c,
                sr_n,
                sr_hw,
                sr_c,
                HAS_RESIDUAL,
                ACTIVATION,
            )
            g = tl.where(mask, g, 0.0)
            acc_g += g
            acc_gx += g * xhat
        sum_g = tl.sum(acc_g, axis=0)
        sum_gx = tl.sum(acc_gx, axis=0)
        tl.store(pdb_ptr + n * C + cols, sum_g, mask=mask_c)
        tl.store(pdw_ptr + n * C + cols, sum_gx, mask=mask_c)
        acc_wg += sum_g * w
        acc_wgx += sum_gx * w
    c_g = tl.sum(acc_wg, axis=0) * inv_count
    c_gx = tl.sum(acc_wgx, axis=0) * inv_count
    if WRITE_DX or WRITE_DRES:
        for c0 in range(0, CG, BLOCK_C):
            in_group = c0 + tl.arange(0, BLOCK_C)
            cols = c_first + in_group.to(tl.int64)
            mask_c = in_group < CG
            w = load_channel_vector(w_ptr, cols, mask_c, HAS_WEIGHT, 1.0)
            bias = load_channel_vector(b_ptr, cols, mask_c, HAS_BIAS, 0.0)
            for hw0 in range(0, HW, BLOCK_HW):
                hws = hw0 + tl.arange(0, BLOCK_HW).to(tl.int64)
                mask = (hws < HW)[:, None] & mask_c[None, :]
                g, xhat = _epilogue_grad_tile(
                    x_ptr,
                    g_ptr,
                    res_ptr,
                    n,
                    hws,
                    cols,
                    mask,
                    mean,
                    rstd,
                    w,
                    bias,
                    sx_n,
                    sx_hw,
                    sx_c,
                    sg_n,
                    sg_hw,
                    sg_c,
                    sr_n,
                    sr_hw,
                    sr_c,
                    HAS_RESIDUAL,
                    ACTIVATION,
                )
                d_offs = n * sd_n + (hws * sd_hw)[:, None] + (cols * sd_c)[None, :]
                if WRITE_DRES:
                    tl.store(dres_ptr + d_offs, g.to(dres_ptr.dtype.element_ty), mask=mask)
                if WRITE_DX:
                    dx = rstd * (g * w[None, :] - c_g - xhat * c_gx)
                    tl.store(dx_ptr + d_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launchers: check → allocate → launch (the checks run in the op)


def _group_tile(cg: int, hw: int) -> tuple[int, int]:
    """(BLOCK_HW, BLOCK_C) for GroupNorm: ≤ 64 group channels wide, ~2K elements a tile (untuned)."""
    block_c = min(triton.next_power_of_2(max(cg, 1)), 64)
    block_hw = min(max(16, 2048 // block_c), max(16, triton.next_power_of_2(max(hw, 1))))
    return block_hw, block_c


def group_norm_act_forward_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupNorm(+residual)(+act) forward; returns ``(y, mean, rstd)`` with ``[N·G]`` fp32 statistics."""
    n, c, h, w = x.shape
    hw, cg = h * w, c // num_groups
    weight, bias = dense_vector(weight), dense_vector(bias)
    y = empty_in_layout_of(x)
    mean = torch.empty(n * num_groups, device=x.device, dtype=torch.float32)
    rstd = torch.empty(n * num_groups, device=x.device, dtype=torch.float32)
    block_hw, block_c = _group_tile(cg, hw)
    res = residual if residual is not None else x
    with launch_context(x):
        _gn_fwd_kernel[(n * num_groups,)](
            x,
            res,
            y,
            weight if weight is not None else mean,
            bias if bias is not None else mean,
            mean,
            rstd,
            hw,
            num_groups,
            cg,
            1.0 / (cg * hw),
            eps,
            *row_strides(x),
            *row_strides(res),
            *row_strides(y),
            **epilogue_flags(weight, bias, residual, activation),
            BLOCK_HW=block_hw,
            BLOCK_C=block_c,
            num_warps=num_warps(block_hw * block_c),
        )
    return y, mean, rstd


def group_norm_act_backward_triton(
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
    """``(dx, dγ, dβ, d residual)``: one launch, then dγ/dβ summed over the batch from ``[N, C]`` partials."""
    want_x, want_w, want_b, want_r = grad_mask
    n, c, h, w = x.shape
    hw, cg = h * w, c // num_groups
    block_hw, block_c = _group_tile(cg, hw)
    pdw = torch.empty((n, c), device=x.device, dtype=torch.float32)
    pdb = torch.empty((n, c), device=x.device, dtype=torch.float32)
    weight, bias = dense_vector(weight), dense_vector(bias)
    dx = empty_in_layout_of(x) if want_x else None
    dres = empty_in_layout_of(x, residual.dtype) if (want_r and residual is not None) else None
    out = dx if dx is not None else (dres if dres is not None else x)
    res = residual if residual is not None else x
    with launch_context(x):
        _gn_bwd_kernel[(n * num_groups,)](
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
            c,
            hw,
            num_groups,
            cg,
            1.0 / (cg * hw),
            *row_strides(grad_y),
            *row_strides(x),
            *row_strides(res),
            *row_strides(out),
            **epilogue_flags(weight, bias, residual, activation),
            WRITE_DX=dx is not None,
            WRITE_DRES=dres is not None,
            BLOCK_HW=block_hw,
            BLOCK_C=block_c,
            num_warps=num_warps(block_hw * block_c),
        )
    dw = pdw.sum(0) if want_w else None
    db = pdb.sum(0) if want_b else None
    return dx, dw, db, dres


# ---------------------------------------------------------------------------------------------------------
# torch.library ops


def check_group_norm_act_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    activation: str,
) -> None:
    """``F.group_norm``'s checks with its exception types (a ValueError for a single value per group over the
    batch, a RuntimeError for channels not divisible by the groups), then ours."""
    op = "group_norm_act"
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise RuntimeError(f"{op}: num_groups must be a positive int, got {num_groups!r}")
    n, c, h, w = x.shape
    if (n * c // num_groups) * h * w == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {list(x.shape)}"
        )
    if c % num_groups != 0:
        raise RuntimeError(
            "Expected number of channels in input to be divisible by num_groups, but got input of shape "
            f"{list(x.shape)} and num_groups={num_groups}"
        )
    check_common(x, weight, bias, residual, activation, op)


@torch.library.custom_op("lcv::group_norm_act", mutates_args=())
def _group_norm_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_group_norm_act_args(x, weight, bias, residual, num_groups, activation)
    args = (x, weight, bias, residual, num_groups, eps, activation)
    return run_triton_or_reference(x, group_norm_act_forward_triton, group_norm_act_forward_reference, *args)


@_group_norm_act_op.register_fake
def _group_norm_act_fake(x, weight, bias, residual, num_groups, eps, activation):
    check_group_norm_act_args(x, weight, bias, residual, num_groups, activation)
    acc = accumulation_dtype(x.dtype)
    stats = x.shape[0] * num_groups
    return empty_in_layout_of(x), x.new_empty((stats,), dtype=acc), x.new_empty((stats,), dtype=acc)


@torch.library.custom_op("lcv::group_norm_act_backward", mutates_args=())
def _group_norm_act_backward_op(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (grad_y, x, weight, bias, residual, mean, rstd, num_groups, activation, grad_mask)
    return run_backward(x, group_norm_act_backward_triton, group_norm_act_backward_reference, *args)


@_group_norm_act_backward_op.register_fake
def _group_norm_act_backward_fake(
    grad_y, x, weight, bias, residual, mean, rstd, num_groups, activation, grad_mask
):
    return fake_grads(x, residual, grad_mask)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, residual, num_groups, _eps, activation = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.save_for_backward(x, weight, bias, residual, mean, rstd)


def _backward(ctx: Any, grad_y: torch.Tensor | None, _grad_mean: Any, _grad_rstd: Any) -> tuple:
    grads = norm_backward(ctx, grad_y, _group_norm_act_backward_op, ctx.num_groups, ctx.activation)
    return (*grads, None, None, None)


_group_norm_act_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Functional API and module


def group_norm_act(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.group_norm(x, num_groups, weight, bias, eps) + residual)`` as one fused op (fwd and bwd)."""
    if autocast_to_fp32(x):
        x, residual = x.float(), None if residual is None else residual.float()
    return _group_norm_act_op(x, weight, bias, residual, num_groups, float(eps), activation)[0]


def group_norm_act_forward(
    gn: nn.GroupNorm, x: torch.Tensor, activation: str = "none", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``act(gn(x) + residual)`` for a plain ``nn.GroupNorm`` on a 4-D input, with ``lcv::group_norm_act``."""
    x = as_dense(x)

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return group_norm_act(
            x, gn.num_groups, gn.weight, gn.bias, gn.eps, activation=act, residual=residual_like(res, x)
        )

    return fuse_residual(run, torch.float32 if autocast_to_fp32(x) else x.dtype, activation, residual)


class FusedGroupNormAct(nn.GroupNorm):
    """``nn.GroupNorm`` + activation (+ residual before it) for 4-D inputs, via ``lcv::group_norm_act``."""

    def __init__(self, num_groups: int, num_channels: int, activation: str = "none", **kwargs: Any) -> None:
        check_activation(activation, type(self).__name__)
        super().__init__(num_groups, num_channels, **kwargs)
        self.activation = activation

    @classmethod
    def from_module(cls, gn: nn.GroupNorm, act: nn.Module | None = None) -> FusedGroupNormAct:
        """Wrap an existing GroupNorm (and activation module), sharing its parameters."""
        if not isinstance(gn, nn.GroupNorm):
            raise TypeError(f"from_module expects nn.GroupNorm, got {type(gn).__name__}")
        return share_state(gn, cls, act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(
                f"FusedGroupNormAct expects a 4-D (N, C, H, W) input, got shape {tuple(x.shape)}"
            )
        return group_norm_act_forward(self, x, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"
