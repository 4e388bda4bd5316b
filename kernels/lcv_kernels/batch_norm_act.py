"""``batch_norm_act``: BatchNorm2d with a fused residual add and activation, forward and backward.

Kernels view ``(N, C, H, W)`` as ``M = N·H·W`` rows of ``C`` channels through three strides
``(s_n, s_hw, s_c)``, so one kernel serves channels_last and NCHW (Triton specialises a stride of 1, so loads
coalesce along the contiguous axis). Arithmetic is fp32 whatever the storage dtype.

* forward: ``x̂ = (x - μ)·rstd``, ``u = x̂·γ + β (+ residual)``, ``y = act(u)``. With batch statistics, a
  statistics pass writes each row chunk's (count, mean, M2) per channel and ``merge_channel_stats`` combines
  them in a fixed order (well conditioned at any mean, deterministic); a conv epilogue's
  ``batch_mean``/``batch_var`` replace that pass. The statistics are of ``x`` minus each channel's first
  value, added back once: the partial means then carry fp32's resolution of the spread, not of the mean. Then
  one elementwise pass.
* backward: ``g_u = g_y·act'(u)`` (``u`` recomputed from ``x``), ``dβ = Σ g_u``, ``dγ = Σ g_u·x̂``,
  ``d residual = g_u``, and ``dx = γ·rstd·(g_u - mean(g_u) - x̂·mean(g_u·x̂))`` with batch statistics
  (``γ·rstd·g_u`` in eval): one reduction pass into ``[chunks, C]`` partials, a per-channel finalize, one
  elementwise pass.

Op ``lcv::batch_norm_act`` → ``(y, mean, var)`` and ``lcv::batch_norm_act_backward``; the statistics outputs
are not differentiable (their only consumer is the running-statistics update, which ``nn.BatchNorm2d`` also
does outside autograd). The op is functional: :func:`batch_norm_act` updates the running statistics from the
returned ``mean``/``var`` exactly as PyTorch does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lcv_kernels._common import (
    accumulation_dtype,
    activation_code,
    as_dense,
    check_activation,
    dense_vector,
    empty_in_layout_of,
    launch_context,
    run_triton_or_reference,
)
from lcv_kernels._norm_common import (
    channel_tile,
    check_common,
    check_vector,
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
from lcv_kernels._triton import (
    activate,
    chan_merge,
    grad_through_epilogue,
    load_channel_vector,
    merge_channel_stats,
    row_offsets,
    tile_mean_m2,
    tl,
    triton,
)
from lcv_kernels.batch_norm_act_reference import (
    batch_norm_act_backward_reference,
    batch_norm_act_forward_reference,
)

__all__ = [
    "FusedBatchNormAct",
    "batch_norm_act",
    "batch_norm_act_forward",
    "batch_norm_scale_shift",
    "update_running_stats",
]

# ---------------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _bn_partial_stats_kernel(
    # pointers
    x_ptr,
    pivot_ptr,
    count_ptr,
    mean_part_ptr,
    m2_part_ptr,
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
    """(count, mean, M2) per channel of ``x - pivot`` over one chunk of rows: each [BLOCK_M, BLOCK_C] tile is
    centred in registers, then merged into the chunk's running summary (Chan's update)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    pivot = tl.load(pivot_ptr + cols, mask=mask_c, other=0.0)
    n = tl.zeros((BLOCK_C,), dtype=tl.float32)
    mean = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    start = pid_m * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = start + r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        valid = rows < M
        mask = valid[:, None] & mask_c[None, :]
        offs = row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) - pivot[None, :]
        count = tl.sum(valid.to(tl.float32), axis=0)
        tile_mean, tile_m2 = tile_mean_m2(x, valid[:, None], tl.maximum(count, 1.0))
        n, mean, m2 = chan_merge(n, mean, m2, count, tile_mean, tile_m2)
    tl.store(mean_part_ptr + pid_m * C + cols, mean, mask=mask_c)
    tl.store(m2_part_ptr + pid_m * C + cols, m2, mask=mask_c)
    if pid_c == 0:
        tl.store(count_ptr + pid_m, tl.max(n, axis=0))


@triton.jit
def _bn_apply_kernel(
    # pointers
    x_ptr,
    res_ptr,
    y_ptr,
    mean_ptr,
    var_ptr,
    w_ptr,
    b_ptr,
    # sizes and scalars
    M,
    C,
    HW,
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
    """``y = act((x - mean)·γ·rsqrt(var + eps) + β (+ residual))``: one read of x (and the residual), one
    write."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    mask_c = cols < C
    mask = (rows < M)[:, None] & mask_c[None, :]
    x = tl.load(
        x_ptr + row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    mean = tl.load(mean_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.load(var_ptr + cols, mask=mask_c, other=1.0).to(tl.float32) + eps)
    scale = scale * load_channel_vector(w_ptr, cols, mask_c, HAS_WEIGHT, 1.0)
    u = (x - mean[None, :]) * scale[None, :] + load_channel_vector(b_ptr, cols, mask_c, HAS_BIAS, 0.0)[
        None, :
    ]
    if HAS_RESIDUAL:
        r_offs = row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
        u += tl.load(res_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    y = activate(u, ACTIVATION)
    y_offs = row_offsets(rows, HW, sy_n, sy_hw)[:, None] + (cols * sy_c)[None, :]
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
    bias = load_channel_vector(b_ptr, cols, mask_c, HAS_BIAS, 0.0)
    acc_g = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_gx = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    start = pid_m * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = start + r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows < M)[:, None] & mask_c[None, :]
        x = tl.load(
            x_ptr + row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        g = tl.load(
            g_ptr + row_offsets(rows, HW, sg_n, sg_hw)[:, None] + (cols * sg_c)[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        xc = x - mean[None, :]
        r_offs = row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
        g = grad_through_epilogue(
            g, xc, scale[None, :], bias[None, :], res_ptr, r_offs, mask, HAS_RESIDUAL, ACTIVATION
        )
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
    ``dx = scale·g_u + k1·(x - μ) + k0`` (zero without batch statistics). Partials summed in a fixed order."""
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
        x_ptr + row_offsets(rows, HW, sx_n, sx_hw)[:, None] + (cols * sx_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    g = tl.load(
        g_ptr + row_offsets(rows, HW, sg_n, sg_hw)[:, None] + (cols * sg_c)[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    mean = tl.load(mean_ptr + cols, mask=mask_c, other=0.0)
    scale = tl.load(scale_ptr + cols, mask=mask_c, other=0.0)
    bias = load_channel_vector(b_ptr, cols, mask_c, HAS_BIAS, 0.0)
    xc = x - mean[None, :]
    r_offs = row_offsets(rows, HW, sr_n, sr_hw)[:, None] + (cols * sr_c)[None, :]
    g = grad_through_epilogue(
        g, xc, scale[None, :], bias[None, :], res_ptr, r_offs, mask, HAS_RESIDUAL, ACTIVATION
    )
    d_offs = row_offsets(rows, HW, sd_n, sd_hw)[:, None] + (cols * sd_c)[None, :]
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
# Launchers: check → allocate → launch (the checks run in the op)


def batch_stats_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of ``x`` over N, H, W (fp32): chunk summaries, then one merge."""
    n, c, h, w = x.shape
    m = n * h * w
    block_m, block_c = channel_tile(c)
    c_blocks = triton.cdiv(c, block_c)
    rows_per, parts = row_chunks(m, block_m, max(1, parallel_target(x.device) // c_blocks))
    counts = torch.empty((parts,), device=x.device, dtype=torch.float32)
    mean_parts = torch.empty((parts, c), device=x.device, dtype=torch.float32)
    m2_parts = torch.empty((parts, c), device=x.device, dtype=torch.float32)
    # Each channel's first value, subtracted from all of them: the summaries then hold numbers of the size of
    # the spread, not of the mean (a mean of 1000 would otherwise round every partial mean to 6e-5).
    pivot = x[0, :, 0, 0].to(torch.float32).contiguous()
    with launch_context(x):
        _bn_partial_stats_kernel[(parts, c_blocks)](
            x,
            pivot,
            counts,
            mean_parts,
            m2_parts,
            m,
            c,
            h * w,
            rows_per,
            *row_strides(x),
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=num_warps(block_m * block_c),
        )
    return merge_channel_stats(counts, mean_parts, m2_parts, shift=pivot)


def batch_norm_act_forward_triton(
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
    """BatchNorm(+residual)(+act) forward; returns ``(y, mean, var)`` (fp32, biased batch variance)."""
    n, c, h, w = x.shape
    m = n * h * w
    if not use_batch_stats:
        assert running_mean is not None and running_var is not None  # check_batch_norm_act_args
        mean, var = running_mean.to(torch.float32, copy=True), running_var.to(torch.float32, copy=True)
    elif batch_mean is not None:
        assert batch_var is not None  # given together (check_batch_norm_act_args)
        mean, var = batch_mean.to(torch.float32, copy=True), batch_var.to(torch.float32, copy=True)
    else:
        mean, var = batch_stats_triton(x)
    weight, bias = dense_vector(weight), dense_vector(bias)
    y = empty_in_layout_of(x)
    block_m, block_c = channel_tile(c)
    res = residual if residual is not None else x
    with launch_context(x):
        _bn_apply_kernel[(triton.cdiv(m, block_m), triton.cdiv(c, block_c))](
            x,
            res,
            y,
            mean,
            var,
            weight if weight is not None else mean,
            bias if bias is not None else mean,
            m,
            c,
            h * w,
            eps,
            *row_strides(x),
            *row_strides(res),
            *row_strides(y),
            **epilogue_flags(weight, bias, residual, activation),
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=num_warps(block_m * block_c),
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
    block_m, block_c = channel_tile(c)
    c_blocks = triton.cdiv(c, block_c)
    act = activation_code(activation)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight.float()
    bias = dense_vector(bias)
    res = residual if residual is not None else x
    bias_t = bias if bias is not None else mean
    sg, sx, sr = row_strides(grad_y), row_strides(x), row_strides(res)
    need_reduce = want_w or want_b or (want_x and use_batch_stats)
    dw = db = None
    k1 = k0 = mean  # unread unless USE_BATCH
    with launch_context(x):
        if need_reduce:
            rows_per, parts = row_chunks(m, block_m, max(1, parallel_target(dev) // c_blocks))
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
                num_warps=num_warps(block_m * block_c),
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
        dx = empty_in_layout_of(x) if want_x else None
        dres = empty_in_layout_of(x, residual.dtype) if (want_r and residual is not None) else None
        if dx is not None or dres is not None:
            out = dx if dx is not None else dres
            assert out is not None
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
                num_warps=num_warps(block_m * block_c),
            )
    return dx, (dw if want_w else None), (db if want_b else None), dres


# ---------------------------------------------------------------------------------------------------------
# torch.library ops


def check_batch_norm_act_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    batch_mean: torch.Tensor | None,
    batch_var: torch.Tensor | None,
    use_batch_stats: bool,
    activation: str,
) -> None:
    """Raise with a message naming the problem; shared by the op and its fake."""
    op = "batch_norm_act"
    check_common(x, weight, bias, residual, activation, op)
    c = x.shape[1]
    check_vector(running_mean, "running_mean", c, x, op)
    check_vector(running_var, "running_var", c, x, op)
    if not use_batch_stats and (running_mean is None or running_var is None):
        raise ValueError(f"{op}: running_mean and running_var are required when not using batch statistics")
    if (batch_mean is None) != (batch_var is None):
        raise ValueError(f"{op}: pass both batch_mean and batch_var, or neither")
    if batch_mean is not None:
        if not use_batch_stats:
            raise ValueError(
                f"{op}: batch_mean/batch_var are batch statistics; they need use_batch_stats=True"
            )
        check_vector(batch_mean, "batch_mean", c, x, op)
        check_vector(batch_var, "batch_var", c, x, op)
    if use_batch_stats and x.numel() // c <= 1:
        raise ValueError(
            f"{op}: expected more than 1 value per channel when using batch statistics, "
            f"got input size {tuple(x.shape)}"
        )


@torch.library.custom_op("lcv::batch_norm_act", mutates_args=())
def _batch_norm_act_op(
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
    args = (x, weight, bias, residual, running_mean, running_var, batch_mean, batch_var, use_batch_stats)
    check_batch_norm_act_args(*args, activation)
    return run_triton_or_reference(
        x, batch_norm_act_forward_triton, batch_norm_act_forward_reference, *args, eps, activation
    )


@_batch_norm_act_op.register_fake
def _batch_norm_act_fake(
    x,
    weight,
    bias,
    residual,
    running_mean,
    running_var,
    batch_mean,
    batch_var,
    use_batch_stats,
    eps,
    activation,
):
    check_batch_norm_act_args(
        x,
        weight,
        bias,
        residual,
        running_mean,
        running_var,
        batch_mean,
        batch_var,
        use_batch_stats,
        activation,
    )
    acc = accumulation_dtype(x.dtype)
    c = x.shape[1]
    return empty_in_layout_of(x), x.new_empty((c,), dtype=acc), x.new_empty((c,), dtype=acc)


@torch.library.custom_op("lcv::batch_norm_act_backward", mutates_args=())
def _batch_norm_act_backward_op(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (grad_y, x, weight, bias, residual, mean, var, use_batch_stats, eps, activation, grad_mask)
    return run_backward(x, batch_norm_act_backward_triton, batch_norm_act_backward_reference, *args)


@_batch_norm_act_backward_op.register_fake
def _batch_norm_act_backward_fake(
    grad_y, x, weight, bias, residual, mean, var, use_batch_stats, eps, activation, grad_mask
):
    return fake_grads(x, residual, grad_mask)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, residual, _rm, _rv, _bm, _bv, use_batch_stats, eps, activation = inputs
    _, mean, var = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, var)
    ctx.use_batch_stats, ctx.eps, ctx.activation = use_batch_stats, eps, activation
    ctx.save_for_backward(x, weight, bias, residual, mean, var)


def _backward(ctx: Any, grad_y: torch.Tensor | None, _grad_mean: Any, _grad_var: Any) -> tuple:
    grads = norm_backward(
        ctx, grad_y, _batch_norm_act_backward_op, ctx.use_batch_stats, ctx.eps, ctx.activation
    )
    return (*grads, None, None, None, None, None, None, None)


_batch_norm_act_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Functional API: the op plus PyTorch's running-statistics semantics


@torch.no_grad()
def update_running_stats(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int,
    momentum: float | torch.Tensor,
) -> None:
    """PyTorch's update, in place: ``r = (1 - m)·r + m·stat`` with the *unbiased* batch variance."""
    unbiased = var * (count / (count - 1))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype) * momentum)
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)


def batch_norm_scale_shift(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BatchNorm as a per-channel affine map: ``scale = γ·rsqrt(var + eps)``, ``shift = β -
    mean·scale`` (what a conv epilogue applies when BatchNorm is folded into it)."""
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    if bias is not None:
        shift = shift + bias
    return scale, shift


def batch_norm_act(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float | torch.Tensor = 0.1,
    eps: float = 1e-5,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    batch_mean: torch.Tensor | None = None,
    batch_var: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.batch_norm(x, ...) + residual)`` in one elementwise pass over ``x`` (NCHW or channels_last).

    Same arguments and running-statistics semantics as ``F.batch_norm``: with ``training=True`` the batch
    statistics normalise ``x`` and, if running buffers are given, update them in place with ``momentum`` (a
    float, or a 0-dim tensor such as ``1 / num_batches_tracked`` for a cumulative average); with
    ``training=False`` the running statistics are used. ``batch_mean``/``batch_var`` (fp32 per-channel mean
    and biased variance of ``x``, e.g. from ``conv_bn_act(..., stats=True)``) replace the statistics pass.
    The output has ``x``'s dtype and memory format.
    """
    y, mean, var = _batch_norm_act_op(
        x,
        weight,
        bias,
        residual,
        running_mean,
        running_var,
        batch_mean,
        batch_var,
        bool(training),
        float(eps),
        activation,
    )
    if training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, x.numel() // x.shape[1], momentum)
    return y


def batch_norm_act_forward(
    bn: nn.BatchNorm2d,
    x: torch.Tensor,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    *,
    batch_mean: torch.Tensor | None = None,
    batch_var: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(bn(x) + residual)`` for a plain ``nn.BatchNorm2d`` with its forward's semantics:
    ``num_batches_tracked`` incremented, ``momentum=None`` meaning a cumulative average, running statistics
    used in eval unless absent. ``batch_mean``/``batch_var`` are a conv epilogue's statistics of ``x``, if
    any."""
    if x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    momentum: float | torch.Tensor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            momentum = 1.0 / bn.num_batches_tracked  # a tensor: no host sync, no graph break
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    x = as_dense(x)

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return batch_norm_act(
            x,
            bn.running_mean if track else None,
            bn.running_var if track else None,
            bn.weight,
            bn.bias,
            use_batch,
            momentum,
            bn.eps,
            activation=act,
            residual=residual_like(res, x),
            batch_mean=batch_mean,
            batch_var=batch_var,
        )

    return fuse_residual(run, x.dtype, activation, residual)


class FusedBatchNormAct(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` followed by an activation, with an optional residual added before it:
    ``forward(x, residual=None) = act(bn(x) + residual)``, train and eval, via ``lcv::batch_norm_act``."""

    def __init__(self, num_features: int, activation: str = "relu", **kwargs: Any) -> None:
        check_activation(activation, type(self).__name__)
        super().__init__(num_features, **kwargs)
        self.activation = activation

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, act: nn.Module | None = None) -> FusedBatchNormAct:
        """Wrap an existing BatchNorm2d (and activation module), sharing its parameters and buffers."""
        if not isinstance(bn, nn.BatchNorm2d):
            raise TypeError(f"from_module expects nn.BatchNorm2d, got {type(bn).__name__}")
        return share_state(bn, cls, act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return batch_norm_act_forward(self, x, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"
