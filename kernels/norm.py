"""Triton kernels for BatchNorm2d, GroupNorm and LayerNorm-over-channels, each with a fused
residual add and activation, forward and backward.

Every kernel views a 4-D ``(N, C, H, W)`` tensor as ``M = N·H·W`` rows of ``C`` channels and addresses it
through three strides ``(s_n, s_hw, s_c)``, so one kernel serves channels_last (NHWC, ``s_c = 1``) and
contiguous NCHW (``s_hw = 1``) tensors; Triton specialises a stride equal to 1, so the contiguous axis is
known at compile time and loads coalesce along it. Statistics and all arithmetic are fp32, whatever the
storage dtype; offsets are int64.

Math (``u`` is the pre-activation, ``x̂`` the normalised input, ``act`` the fused activation):

* forward: ``x̂ = (x - μ)·rstd``, ``u = x̂·γ + β (+ residual)``, ``y = act(u)``;
* backward: ``g_u = g_y·act'(u)`` (``u`` recomputed from ``x``, never stored), ``dβ = Σ g_u``,
  ``dγ = Σ g_u·x̂``, ``d residual = g_u``, and with batch statistics
  ``dx = γ·rstd·(g_u - mean(g_u) - x̂·mean(g_u·x̂))`` (means over the normalised set); with fixed
  statistics (BatchNorm eval) ``dx = γ·rstd·g_u``.

BatchNorm (statistics per channel over ``M`` rows) runs as three small launches forward: partial sums per
row chunk (a sample of each channel is subtracted first, which keeps ``E[x²] - E[x]²`` well conditioned),
a per-channel finalize, and one elementwise pass; when a convolution epilogue already produced ``Σz`` and
``Σz²`` the first launch is skipped. Backward is one reduction pass plus one elementwise pass (the minimum
for batch statistics), joined by a per-channel finalize. Partial sums go to ``[chunks, C]`` buffers and
are reduced in a fixed order, so results are deterministic (no atomics).

GroupNorm runs one program per (sample, group): it reads the group twice (statistics, then output), and
in backward twice (reductions, then ``dx``). LayerNorm2d keeps each pixel's ``C`` channels in registers
(one read, one write) and reduces ``dγ``/``dβ`` through per-program partials.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from kernels._common import activation_code

#: Largest channel count LayerNorm2d keeps in registers; beyond it the launcher raises.
MAX_LAYERNORM_CHANNELS = 16384

# ---------------------------------------------------------------------------------------------------------
# Shared device helpers


@triton.jit
def _activate(u, ACTIVATION: tl.constexpr):
    """The epilogue activation; codes follow ``kernels._common.ACTIVATIONS`` (GELU is the exact erf form)."""
    if ACTIVATION == 1:
        u = tl.maximum(u, 0.0)
    elif ACTIVATION == 2:
        u = 0.5 * u * (1.0 + tl.erf(u * 0.7071067811865476))
    elif ACTIVATION == 3:
        u = u / (1.0 + tl.exp(-u))
    return u


@triton.jit
def _activation_grad(g, u, ACTIVATION: tl.constexpr):
    """``g · act'(u)``; the identity when there is no activation (the branch compiles out)."""
    if ACTIVATION == 1:
        g = tl.where(u > 0.0, g, 0.0)
    elif ACTIVATION == 2:
        cdf = 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))
        pdf = tl.exp(-0.5 * u * u) * 0.3989422804014327
        g = g * (cdf + u * pdf)
    elif ACTIVATION == 3:
        sig = 1.0 / (1.0 + tl.exp(-u))
        g = g * (sig * (1.0 + u * (1.0 - sig)))
    return g


@triton.jit
def _row_offsets(rows, HW, s_n, s_hw):
    """Offset of row ``m = n·HW + hw``: only the row part; the caller adds ``c · s_c``."""
    n = rows // HW
    return n * s_n + (rows - n * HW) * s_hw


# ---------------------------------------------------------------------------------------------------------
# BatchNorm: statistics per channel over the M = N·H·W rows


@triton.jit
def _bn_partial_stats_kernel(
    # pointers
    x_ptr,
    psum_ptr,
    psumsq_ptr,
    # sizes
    M,
    C,
    HW,
    ROWS_PER_PROG,
    # strides
    sx_n,
    sx_hw,
    sx_c,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Σ(x - p) and Σ(x - p)² over one chunk of rows, per channel, where ``p = x[0, c, 0, 0]`` (the pivot)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    pivot = tl.load(x_ptr + cols * sx_c, mask=mask_c, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_sq = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    start = pid_m * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = start + r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows < M)[:, None] & mask_c[None, :]
        offs = _row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - pivot[None, :], 0.0)
        acc += d
        acc_sq += d * d
    tl.store(psum_ptr + pid_m * C + cols, tl.sum(acc, axis=0), mask=mask_c)
    tl.store(psumsq_ptr + pid_m * C + cols, tl.sum(acc_sq, axis=0), mask=mask_c)


@triton.jit
def _bn_finalize_kernel(
    # pointers
    psum_ptr,
    psumsq_ptr,
    x_ptr,
    rm_ptr,
    rv_ptr,
    w_ptr,
    mean_ptr,
    var_ptr,
    scale_ptr,
    # sizes and scalars
    C,
    NUM_PARTS,
    inv_count,
    eps,
    sx_c,
    # meta
    USE_BATCH: tl.constexpr,
    PIVOTED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per channel: mean and biased variance (from the partial sums, or the running stats in eval) and
    the folded scale ``γ·rsqrt(var + eps)``."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    if USE_BATCH:
        s = tl.zeros((BLOCK_C,), dtype=tl.float32)
        q = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for p in range(0, NUM_PARTS):  # fixed order: deterministic
            s += tl.load(psum_ptr + p * C + cols, mask=mask_c, other=0.0)
            q += tl.load(psumsq_ptr + p * C + cols, mask=mask_c, other=0.0)
        mean = s * inv_count
        var = tl.maximum(q * inv_count - mean * mean, 0.0)
        if PIVOTED:
            mean += tl.load(x_ptr + cols * sx_c, mask=mask_c, other=0.0).to(tl.float32)
    else:
        mean = tl.load(rm_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
        var = tl.load(rv_ptr + cols, mask=mask_c, other=1.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(var + eps)
    if HAS_WEIGHT:
        scale = scale * tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(mean_ptr + cols, mean, mask=mask_c)
    tl.store(var_ptr + cols, var, mask=mask_c)
    tl.store(scale_ptr + cols, scale, mask=mask_c)


@triton.jit
def _bn_apply_kernel(
    # pointers
    x_ptr,
    res_ptr,
    y_ptr,
    mean_ptr,
    scale_ptr,
    b_ptr,
    # sizes
    M,
    C,
    HW,
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
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``y = act((x - mean)·scale + β (+ residual))``: one read of x (and the residual), one write."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    mask = (rows < M)[:, None] & mask_c[None, :]
    x = tl.load(
        x_ptr + _row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    mean = tl.load(mean_ptr + cols, mask=mask_c, other=0.0)
    scale = tl.load(scale_ptr + cols, mask=mask_c, other=0.0)
    u = (x - mean[None, :]) * scale[None, :]
    if HAS_BIAS:
        u += tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        r_offs = _row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
        u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    y = _activate(u, ACTIVATION)
    y_offs = _row_offsets(rows, HW, sy_n, sy_hw)[:, None] + (cols * sy_c)[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_bwd_reduce_kernel(
    # pointers
    g_ptr,
    x_ptr,
    res_ptr,
    mean_ptr,
    scale_ptr,
    b_ptr,
    pg_ptr,
    pgx_ptr,
    # sizes
    M,
    C,
    HW,
    ROWS_PER_PROG,
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
    # meta
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per chunk of rows and channel: Σ g_u and Σ g_u·(x - mean) (``u`` recomputed from x)."""
    pid_m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    mean = tl.load(mean_ptr + cols, mask=mask_c, other=0.0)
    scale = tl.load(scale_ptr + cols, mask=mask_c, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_gx = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    start = pid_m * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = start + r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows < M)[:, None] & mask_c[None, :]
        x = tl.load(
            x_ptr + _row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        g = tl.load(
            g_ptr + _row_offsets(rows, HW, sg_n, sg_hw)[:, None] + (cols * sg_c)[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        xc = x - mean[None, :]
        if ACTIVATION != 0:
            u = xc * scale[None, :]
            if HAS_BIAS:
                u += bias[None, :]
            if HAS_RESIDUAL:
                r_offs = _row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
                u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
            g = _activation_grad(g, u, ACTIVATION)
        g = tl.where(mask, g, 0.0)
        acc_g += g
        acc_gx += g * xc
    tl.store(pg_ptr + pid_m * C + cols, tl.sum(acc_g, axis=0), mask=mask_c)
    tl.store(pgx_ptr + pid_m * C + cols, tl.sum(acc_gx, axis=0), mask=mask_c)


@triton.jit
def _bn_bwd_finalize_kernel(
    # pointers
    pg_ptr,
    pgx_ptr,
    var_ptr,
    scale_ptr,
    dw_ptr,
    db_ptr,
    k1_ptr,
    k0_ptr,
    # sizes and scalars
    C,
    NUM_PARTS,
    inv_count,
    eps,
    # meta
    USE_BATCH: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per channel: ``dβ = Σg_u``, ``dγ = rstd·Σg_u(x-μ)``, and the coefficients of
    ``dx = scale·g_u + k1·(x - μ) + k0`` (zero without batch statistics)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    sg = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sgx = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p in range(0, NUM_PARTS):
        sg += tl.load(pg_ptr + p * C + cols, mask=mask_c, other=0.0)
        sgx += tl.load(pgx_ptr + p * C + cols, mask=mask_c, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.load(var_ptr + cols, mask=mask_c, other=1.0) + eps)
    tl.store(db_ptr + cols, sg, mask=mask_c)
    tl.store(dw_ptr + cols, sgx * rstd, mask=mask_c)
    if USE_BATCH:
        scale = tl.load(scale_ptr + cols, mask=mask_c, other=0.0)
        tl.store(k1_ptr + cols, -scale * rstd * rstd * sgx * inv_count, mask=mask_c)
        tl.store(k0_ptr + cols, -scale * sg * inv_count, mask=mask_c)


@triton.jit
def _bn_bwd_apply_kernel(
    # pointers
    g_ptr,
    x_ptr,
    res_ptr,
    mean_ptr,
    scale_ptr,
    b_ptr,
    k1_ptr,
    k0_ptr,
    dx_ptr,
    dres_ptr,
    # sizes
    M,
    C,
    HW,
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
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_BATCH: tl.constexpr,
    WRITE_DX: tl.constexpr,
    WRITE_DRES: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``dx = scale·g_u + k1·(x - μ) + k0`` and ``d residual = g_u`` (dx and d residual share strides)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    mask = (rows < M)[:, None] & mask_c[None, :]
    x = tl.load(
        x_ptr + _row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    g = tl.load(
        g_ptr + _row_offsets(rows, HW, sg_n, sg_hw)[:, None] + (cols * sg_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    mean = tl.load(mean_ptr + cols, mask=mask_c, other=0.0)
    scale = tl.load(scale_ptr + cols, mask=mask_c, other=0.0)
    xc = x - mean[None, :]
    if ACTIVATION != 0:
        u = xc * scale[None, :]
        if HAS_BIAS:
            u += tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            r_offs = _row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
            u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
        g = _activation_grad(g, u, ACTIVATION)
    d_offs = _row_offsets(rows, HW, sd_n, sd_hw)[:, None] + (cols * sd_c)[None, :]
    if WRITE_DRES:
        tl.store(dres_ptr + d_offs, g.to(dres_ptr.dtype.element_ty), mask=mask)
    if WRITE_DX:
        dx = g * scale[None, :]
        if USE_BATCH:
            k1 = tl.load(k1_ptr + cols, mask=mask_c, other=0.0)
            k0 = tl.load(k0_ptr + cols, mask=mask_c, other=0.0)
            dx += xc * k1[None, :] + k0[None, :]
        tl.store(dx_ptr + d_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# GroupNorm: statistics per (sample, group) over C/G channels × H·W pixels; one program each


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
    # Pivot (the group's first element) keeps Σd² - (Σd)²/count well conditioned.
    pivot = tl.load(x_ptr + n * sx_n + c_first * sx_c).to(tl.float32)
    acc = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
    acc_sq = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
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
            d = tl.where(mask, x - pivot, 0.0)
            acc += d
            acc_sq += d * d
    mean_d = tl.sum(tl.sum(acc, axis=1), axis=0) * inv_count
    var = tl.maximum(tl.sum(tl.sum(acc_sq, axis=1), axis=0) * inv_count - mean_d * mean_d, 0.0)
    mean = pivot + mean_d
    rstd = 1.0 / tl.sqrt(var + eps)
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
            y = _activate(u, ACTIVATION)
            y_offs = n * sy_n + (hws * sy_hw)[:, None] + (cols * sy_c)[None, :]
            tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


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
        w = tl.zeros((BLOCK_C,), dtype=tl.float32) + 1.0
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
        acc_g = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
        acc_gx = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
        for hw0 in range(0, HW, BLOCK_HW):
            hws = hw0 + tl.arange(0, BLOCK_HW).to(tl.int64)
            mask = (hws < HW)[:, None] & mask_c[None, :]
            x = tl.load(
                x_ptr + n * sx_n + (hws * sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            g = tl.load(
                g_ptr + n * sg_n + (hws * sg_hw)[:, None] + (cols * sg_c)[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            xhat = (x - mean) * rstd
            if ACTIVATION != 0:
                u = xhat * w[None, :]
                if HAS_BIAS:
                    u += bias[None, :]
                if HAS_RESIDUAL:
                    r_offs = n * sr_n + (hws * sr_hw)[:, None] + (cols * sr_c)[None, :]
                    u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
                g = _activation_grad(g, u, ACTIVATION)
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
            w = tl.zeros((BLOCK_C,), dtype=tl.float32) + 1.0
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
            for hw0 in range(0, HW, BLOCK_HW):
                hws = hw0 + tl.arange(0, BLOCK_HW).to(tl.int64)
                mask = (hws < HW)[:, None] & mask_c[None, :]
                x = tl.load(
                    x_ptr + n * sx_n + (hws * sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
                ).to(tl.float32)
                g = tl.load(
                    g_ptr + n * sg_n + (hws * sg_hw)[:, None] + (cols * sg_c)[None, :], mask=mask, other=0.0
                ).to(tl.float32)
                xhat = (x - mean) * rstd
                if ACTIVATION != 0:
                    u = xhat * w[None, :]
                    if HAS_BIAS:
                        u += bias[None, :]
                    if HAS_RESIDUAL:
                        r_offs = n * sr_n + (hws * sr_hw)[:, None] + (cols * sr_c)[None, :]
                        u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
                    g = _activation_grad(g, u, ACTIVATION)
                d_offs = n * sd_n + (hws * sd_hw)[:, None] + (cols * sd_c)[None, :]
                if WRITE_DRES:
                    tl.store(dres_ptr + d_offs, g.to(dres_ptr.dtype.element_ty), mask=mask)
                if WRITE_DX:
                    dx = rstd * (g * w[None, :] - c_g - xhat * c_gx)
                    tl.store(dx_ptr + d_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# LayerNorm over channels (ConvNeXt LayerNorm2d): statistics per pixel over C channels


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
        x_ptr + _row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    mean = tl.sum(x, axis=1) * inv_c
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) * inv_c + eps)
    tl.store(mean_ptr + rows, mean, mask=mask_m)
    tl.store(rstd_ptr + rows, rstd, mask=mask_m)
    u = xc * rstd[:, None]
    if HAS_WEIGHT:
        u = u * tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        u += tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        r_offs = _row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
        u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    y = _activate(u, ACTIVATION)
    y_offs = _row_offsets(rows, HW, sy_n, sy_hw)[:, None] + (cols * sy_c)[None, :]
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
    w = tl.zeros((BLOCK_C,), dtype=tl.float32) + 1.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    acc_dw = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_db = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    start = pid * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = start + r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask_m = rows < M
        mask = mask_m[:, None] & mask_c[None, :]
        x = tl.load(
            x_ptr + _row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        g = tl.load(
            g_ptr + _row_offsets(rows, HW, sg_n, sg_hw)[:, None] + (cols * sg_c)[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=mask_m, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=mask_m, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if ACTIVATION != 0:
            u = xhat * w[None, :]
            if HAS_BIAS:
                u += bias[None, :]
            if HAS_RESIDUAL:
                r_offs = _row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
                u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
            g = _activation_grad(g, u, ACTIVATION)
        g = tl.where(mask, g, 0.0)
        acc_db += g
        acc_dw += g * xhat
        d_offs = _row_offsets(rows, HW, sd_n, sd_hw)[:, None] + (cols * sd_c)[None, :]
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
# Host side: layout, launch geometry, launchers (check → allocate → launch; checks live in norm_ops)


def row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """``(s_n, s_hw, s_c)`` of a 4-D tensor that is dense in NCHW or channels_last order.

    With ``W > 1`` a dense tensor has ``s_h = W·s_w``, so a pixel index ``hw`` is at ``hw·s_w``; with
    ``W == 1`` it is at ``h·s_h``.
    """
    s_hw = t.stride(3) if t.shape[3] > 1 else t.stride(2)
    return t.stride(0), s_hw, t.stride(1)


def _launch_context(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def _num_warps(elements: int) -> int:
    return 8 if elements >= 8192 else 4


def _channel_tile(channels: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C) for per-channel (BatchNorm) kernels: ≤ 64 channels wide, ~4K elements a tile.

    Untuned: these are starting points, not measured on GPU. The interpreter gets the same shapes
    (numpy handles a [64, 64] tile at once; fewer programs is what keeps it fast).
    """
    block_c = min(triton.next_power_of_2(max(channels, 1)), 64)
    block_m = max(16, 4096 // block_c)
    return block_m, block_c


def _parallel_target(device: torch.device) -> int:
    """How many programs a reduction grid aims for: a few per SM on GPU, 2 in the interpreter (so the
    multi-chunk merge is exercised by the CPU tests)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _row_chunks(rows: int, block_m: int, programs: int) -> tuple[int, int]:
    """Split ``rows`` into chunks that are multiples of ``block_m``; return (rows per chunk, chunks)."""
    per = triton.cdiv(max(rows, 1), max(programs, 1))
    per = triton.cdiv(per, block_m) * block_m
    return per, triton.cdiv(max(rows, 1), per)


def batch_norm_act_forward_triton(
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
    """BatchNorm(+residual)(+act) forward; returns ``(y, mean, var)`` (fp32, biased batch variance)."""
    n, c, h, w = x.shape
    m, hw = n * h * w, h * w
    y = torch.empty_like(x)
    dev = x.device
    mean = torch.empty(c, device=dev, dtype=torch.float32)
    var = torch.empty(c, device=dev, dtype=torch.float32)
    scale = torch.empty(c, device=dev, dtype=torch.float32)
    block_m, block_c = _channel_tile(c)
    c_blocks = triton.cdiv(c, block_c)
    sx = row_strides(x)
    with _launch_context(x):
        pivoted = use_batch_stats and sums is None
        if pivoted:
            rows_per, parts = _row_chunks(m, block_m, max(1, _parallel_target(dev) // c_blocks))
            psum = torch.empty((parts, c), device=dev, dtype=torch.float32)
            psumsq = torch.empty((parts, c), device=dev, dtype=torch.float32)
            _bn_partial_stats_kernel[(parts, c_blocks)](
                x,
                psum,
                psumsq,
                m,
                c,
                hw,
                rows_per,
                *sx,
                BLOCK_M=block_m,
                BLOCK_C=block_c,
                num_warps=_num_warps(block_m * block_c),
            )
        elif use_batch_stats:
            psum, psumsq, parts = sums, sumsq, 1
        else:
            psum = psumsq = mean
            parts = 0
        _bn_finalize_kernel[(triton.cdiv(c, 128),)](
            psum,
            psumsq,
            x,
            running_mean if running_mean is not None else mean,
            running_var if running_var is not None else var,
            weight if weight is not None else mean,
            mean,
            var,
            scale,
            c,
            parts,
            1.0 / m,
            eps,
            sx[2],
            USE_BATCH=use_batch_stats,
            PIVOTED=pivoted,
            HAS_WEIGHT=weight is not None,
            BLOCK_C=128,
        )
        res = residual if residual is not None else x
        _bn_apply_kernel[(triton.cdiv(m, block_m), c_blocks)](
            x,
            res,
            y,
            mean,
            scale,
            bias if bias is not None else mean,
            m,
            c,
            hw,
            *sx,
            *row_strides(res),
            *row_strides(y),
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            ACTIVATION=activation_code(activation),
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=_num_warps(block_m * block_c),
        )
    return y, mean, var


def batch_norm_act_backward_triton(
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
    """``(dx, dγ, dβ, d residual)``; entries not asked for in ``grad_mask`` are None. dγ/dβ are fp32."""
    want_x, want_w, want_b, want_r = grad_mask
    n, c, h, w = x.shape
    m, hw = n * h * w, h * w
    dev = x.device
    block_m, block_c = _channel_tile(c)
    c_blocks = triton.cdiv(c, block_c)
    act = activation_code(activation)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight.float()
    res = residual if residual is not None else x
    bias_t = bias if bias is not None else mean
    sg, sx, sr = row_strides(grad_y), row_strides(x), row_strides(res)
    need_reduce = want_w or want_b or (want_x and use_batch_stats)
    dw = db = None
    k1 = k0 = mean  # unread unless USE_BATCH
    with _launch_context(x):
        if need_reduce:
            rows_per, parts = _row_chunks(m, block_m, max(1, _parallel_target(dev) // c_blocks))
            pg = torch.empty((parts, c), device=dev, dtype=torch.float32)
            pgx = torch.empty((parts, c), device=dev, dtype=torch.float32)
            _bn_bwd_reduce_kernel[(parts, c_blocks)](
                grad_y,
                x,
                res,
                mean,
                scale,
                bias_t,
                pg,
                pgx,
                m,
                c,
                hw,
                rows_per,
                *sg,
                *sx,
                *sr,
                HAS_BIAS=bias is not None,
                HAS_RESIDUAL=residual is not None,
                ACTIVATION=act,
                BLOCK_M=block_m,
                BLOCK_C=block_c,
                num_warps=_num_warps(block_m * block_c),
            )
            dw = torch.empty(c, device=dev, dtype=torch.float32)
            db = torch.empty(c, device=dev, dtype=torch.float32)
            k1 = torch.empty(c, device=dev, dtype=torch.float32)
            k0 = torch.empty(c, device=dev, dtype=torch.float32)
            _bn_bwd_finalize_kernel[(triton.cdiv(c, 128),)](
                pg,
                pgx,
                var,
                scale,
                dw,
                db,
                k1,
                k0,
                c,
                parts,
                1.0 / m,
                eps,
                USE_BATCH=use_batch_stats,
                BLOCK_C=128,
            )
        dx = torch.empty_like(x) if want_x else None
        dres = torch.empty_like(x, dtype=residual.dtype) if (want_r and residual is not None) else None
        if dx is not None or dres is not None:
            out = dx if dx is not None else dres
            _bn_bwd_apply_kernel[(triton.cdiv(m, block_m), c_blocks)](
                grad_y,
                x,
                res,
                mean,
                scale,
                bias_t,
                k1,
                k0,
                dx if dx is not None else out,
                dres if dres is not None else out,
                m,
                c,
                hw,
                *sg,
                *sx,
                *sr,
                *row_strides(out),
                HAS_BIAS=bias is not None,
                HAS_RESIDUAL=residual is not None,
                USE_BATCH=use_batch_stats,
                WRITE_DX=dx is not None,
                WRITE_DRES=dres is not None,
                ACTIVATION=act,
                BLOCK_M=block_m,
                BLOCK_C=block_c,
                num_warps=_num_warps(block_m * block_c),
            )
    return dx, (dw if want_w else None), (db if want_b else None), dres


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
    y = torch.empty_like(x)
    mean = torch.empty(n * num_groups, device=x.device, dtype=torch.float32)
    rstd = torch.empty(n * num_groups, device=x.device, dtype=torch.float32)
    block_hw, block_c = _group_tile(cg, hw)
    res = residual if residual is not None else x
    with _launch_context(x):
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
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            ACTIVATION=activation_code(activation),
            BLOCK_HW=block_hw,
            BLOCK_C=block_c,
            num_warps=_num_warps(block_hw * block_c),
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
    dx = torch.empty_like(x) if want_x else None
    dres = torch.empty_like(x, dtype=residual.dtype) if (want_r and residual is not None) else None
    out = dx if dx is not None else (dres if dres is not None else x)
    res = residual if residual is not None else x
    with _launch_context(x):
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
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            WRITE_DX=dx is not None,
            WRITE_DRES=dres is not None,
            ACTIVATION=activation_code(activation),
            BLOCK_HW=block_hw,
            BLOCK_C=block_c,
            num_warps=_num_warps(block_hw * block_c),
        )
    dw = pdw.sum(0) if want_w else None
    db = pdb.sum(0) if want_b else None
    return dx, dw, db, dres


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
    y = torch.empty_like(x)
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    res = residual if residual is not None else x
    with _launch_context(x):
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
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            ACTIVATION=activation_code(activation),
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=_num_warps(block_m * block_c),
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
    rows_per, programs = _row_chunks(m, block_m, _parallel_target(x.device))
    pdw = torch.empty((programs, c), device=x.device, dtype=torch.float32)
    pdb = torch.empty((programs, c), device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x) if want_x else None
    dres = torch.empty_like(x, dtype=residual.dtype) if (want_r and residual is not None) else None
    out = dx if dx is not None else (dres if dres is not None else x)
    res = residual if residual is not None else x
    with _launch_context(x):
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
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            WRITE_DX=dx is not None,
            WRITE_DRES=dres is not None,
            ACTIVATION=activation_code(activation),
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=_num_warps(block_m * block_c),
        )
    dw = pdw.sum(0) if want_w else None
    db = pdb.sum(0) if want_b else None
    return dx, dw, db, dres
