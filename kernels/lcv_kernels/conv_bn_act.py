"""``conv_bn_act``: 2-D convolution with a fused per-channel epilogue, the BatchNorm statistics of its output,
and the Conv2d → BatchNorm2d → activation block built on it.

Kernel (implicit GEMM over NHWC): M = N·P·Q output pixels, N_gemm = K output channels, K_gemm = R·S·C (taps ×
input channels). One program computes a [BLOCK_M, BLOCK_N] output tile; the reduction loop is flattened
over (tap, channel block) so the software pipeliner sees one loop, as Inductor's template does. The epilogue
runs on the fp32 accumulator before the single store: ``z = acc + bias``; optionally the tile's per-channel
(count, mean, M2) of ``acc`` for a training BatchNorm (merged by ``lcv_kernels._triton.merge_channel_stats``,
which adds the bias back: a conv bias of 300 costs the statistics no precision); then
``y = act(z * scale + shift + residual)``. Offsets are int32 unless a tensor spans 2**31 elements, when the
host picks the int64 variant.

Op ``lcv::conv_bn_act`` → ``(y, mean, var)`` (a ``custom_op``: opaque to Inductor, with a fake and an autograd
formula, so ``torch.compile(fullgraph=True)`` traces it without graph breaks). It runs the Triton kernel on
CUDA, in the interpreter on CPU with ``TRITON_INTERPRET=1``, and :mod:`lcv_kernels.conv_bn_act_reference`
otherwise. Backward: the epilogue's gradient is elementwise PyTorch (Inductor fuses it), and the convolution's
input and weight gradients come from ``lcv::conv_bn_act_backward``, which calls ``aten.convolution_backward``
(cuDNN on GPU) and returns them in fixed layouts. ``LCV_CONV_DGRAD=triton`` computes the input gradient of
stride-1 convs with the forward kernel instead (a stride-1 conv's dgrad is a conv with the flipped, transposed
weight); ``benchmarks/conv.py`` times both.

The statistics outputs are not differentiable: their one consumer, ``lcv::batch_norm_act``, differentiates
through the batch statistics of ``z`` itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import nn

from lcv_kernels._common import (
    accumulation_dtype,
    activation_code,
    activation_grad,
    check_activation,
    check_dtype,
    checked_activation_name,
    dense_layout,
    dense_vector,
    empty_dense,
    empty_in_layout_of,
    in_layout_of,
    interpreter_enabled,
    launch_context,
    needs_int64,
    unsupported_dtype_reason,
    use_triton,
)
from lcv_kernels._norm_common import fuse_residual
from lcv_kernels._triton import activate as _activate
from lcv_kernels._triton import merge_channel_stats, tile_mean_m2, tl, triton
from lcv_kernels.batch_norm_act import batch_norm_act_forward, batch_norm_scale_shift
from lcv_kernels.conv_bn_act_reference import (
    conv2d_output_hw,
    conv_bn_act_reference,
    epilogue_reference,
    pair,
)

__all__ = [
    "DGRAD_ENV",
    "FusedConvBNAct",
    "conv_bn_act",
    "conv_bn_act_forward",
    "conv_padding",
    "dgrad_impl",
    "why_conv_bn_act_not_fusable",
]

# ---------------------------------------------------------------------------------------------------------
# Triton kernel

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, kind). Each entry compiles for sm_90 without register
# spills (ptxas -v; fp16, bf16 and fp32/TF32; the full and the empty epilogue) on the ResNet-18/50 and
# airbench layers and the channel counts 3, 24, 40, 112 and 1000 that ``allowed_config`` lets it run on:
# measured with triton 3.6 and 3.8 on a study copy of this kernel, and for this kernel with the installed
# triton by tests/kernels/test_conv_bn_act.py. Kinds:
# * "1x1": 8 warps, for 1x1 filters only. They take a plain channel loop; the flattened (tap, channel block)
#   loop with ``//`` and ``%`` on its counter is what Triton miscompiled with 8 warps (pytorch#173068), so
#   every other filter stays at 4 warps;
# * "any": every filter;
# * "narrow": only, and always, when K is not a multiple of 4 (the weight tile and the output then move in 1-2
#   element pieces, and every larger tile spilled).
# 128x128 tiles at 4 warps are gone: their 128 fp32 accumulator registers a thread spilled with any epilogue;
# so is 64x128x32, which spilled 24 bytes on 1x1 layers in bf16 with the statistics epilogue.
GPU_CONFIGS: tuple[tuple[int, int, int, int, int, str], ...] = (
    (128, 128, 64, 3, 8, "1x1"),
    (128, 128, 32, 4, 8, "1x1"),
    (128, 64, 64, 4, 4, "any"),
    (64, 128, 64, 4, 4, "any"),
    (128, 64, 32, 4, 4, "any"),
    (64, 64, 64, 4, 4, "any"),
    (64, 64, 32, 4, 4, "any"),
    (128, 64, 16, 4, 4, "any"),
    (64, 64, 16, 4, 4, "any"),
    (64, 32, 32, 4, 4, "narrow"),
    (64, 32, 16, 4, 4, "narrow"),
)
# The interpreter runs every program in numpy: one config (no benchmarking), few programs.
INTERPRETER_CONFIGS: tuple[tuple[int, int, int, int, int, str], ...] = ((64, 16, 16, 1, 4, "any"),)
_CONFIG_KIND = {entry[:5]: entry[5] for entry in GPU_CONFIGS + INTERPRETER_CONFIGS}
#: The smallest tile height any config of this process may use: what the statistics buffers are sized for.
MIN_BLOCK_M = min(entry[0] for entry in (INTERPRETER_CONFIGS if interpreter_enabled() else GPU_CONFIGS))
#: M buckets stop growing here: beyond it every tile config has enough programs to fill the GPU.
M_BUCKET_CAP = 1 << 16


def _configs() -> list[triton.Config]:
    table = INTERPRETER_CONFIGS if interpreter_enabled() else GPU_CONFIGS
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=st, num_warps=nw)
        for bm, bn, bk, st, nw, _ in table
    ]


def allowed_config(
    config: tuple[int, int, int, int, int],
    *,
    R: int,
    S: int,
    C: int,
    K: int,
    Y_ALIGN: int,
    M_BUCKET: int,
    element_size: int,
    epilogue: bool,
) -> bool:
    """May ``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)`` run this launch? The first three rules keep
    what was measured spill-free (see ``GPU_CONFIGS``); the last two drop blocks far larger than the
    problem."""
    block_m, block_n, block_k, num_stages, num_warps = config
    kind = _CONFIG_KIND.get((block_m, block_n, block_k, num_stages, num_warps), "any")
    if kind == "1x1" and (R, S) != (1, 1):
        return False
    if (kind == "narrow") != (Y_ALIGN < 4):
        return False
    if element_size >= 4 and block_n >= 128 and epilogue:
        return False  # fp32 with a 128-wide N tile and epilogue operands spilled 16-64 bytes
    if block_k > max(16, triton.next_power_of_2(C)) or block_n > max(32, triton.next_power_of_2(K)):
        return False
    return block_m <= max(64, M_BUCKET)


def prune_configs(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list[triton.Config]:
    """The configs :func:`allowed_config` keeps for this launch (the smallest narrow one if none is left)."""
    args = {**named_args, **kwargs}
    epilogue = (
        any(args[f] for f in ("HAS_BIAS", "HAS_SCALE", "HAS_SHIFT", "HAS_RESIDUAL")) or args["ACTIVATION"]
    )
    kept = [
        cfg
        for cfg in configs
        if allowed_config(
            (
                cfg.kwargs["BLOCK_M"],
                cfg.kwargs["BLOCK_N"],
                cfg.kwargs["BLOCK_K"],
                cfg.num_stages,
                cfg.num_warps,
            ),
            R=args["R"],
            S=args["S"],
            C=args["C"],
            K=args["K"],
            Y_ALIGN=args["Y_ALIGN"],
            M_BUCKET=args["M_BUCKET"],
            element_size=args["x_ptr"].element_size(),
            epilogue=bool(epilogue),
        )
    ]
    return kept or configs[-1:]


def pow2_alignment(*values: int, cap: int = 16) -> int:
    """The largest power of two, at most ``cap``, that divides every value (zeros divide nothing away)."""
    alignment = cap
    for value in values:
        if value:
            alignment = min(alignment, abs(int(value)) & -abs(int(value)))
    return max(alignment, 1)


def m_bucket(m: int) -> int:
    """The autotune key's stand-in for M = N·P·Q: its power-of-two bucket, capped at ``M_BUCKET_CAP``."""
    return min(triton.next_power_of_2(max(int(m), 1)), M_BUCKET_CAP)


#: Autotune key: the layer's geometry, epilogue and alignment, and the batch only through M's bucket, so a
#: smaller last batch of an epoch reuses the tuned config (M itself is not specialised either: no recompile).
AUTOTUNE_KEY = [
    "M_BUCKET",
    "H",
    "W",
    "C",
    "K",
    "P",
    "Q",
    "STRIDE_H",
    "STRIDE_W",
    "PAD_H",
    "PAD_W",
    "DIL_H",
    "DIL_W",
    "R",
    "S",
    "HAS_BIAS",
    "HAS_SCALE",
    "HAS_SHIFT",
    "HAS_RESIDUAL",
    "ACTIVATION",
    "STATS",
    "INDEX_64",
    "X_ALIGN",
    "Y_ALIGN",
]


@triton.jit
def _multiple_of(value, D: tl.constexpr):
    """``value``, with the host's promise that ``D`` divides it written so Triton can use it: ``(v // D) * D``
    is ``v``, and its divisibility analysis then knows (an integer argument only ever carries "divisible by
    16", so channel counts of 24 or 40 would lose vector loads and cp.async without this)."""
    if D > 1:
        value = (value // D) * D
    return value


@triton.autotune(
    configs=_configs(),
    key=AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": prune_configs},
    reset_to_zero=["count_ptr"],
)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _conv_bn_act_kernel(
    # pointers
    x_ptr,
    w_ptr,
    y_ptr,
    bias_ptr,
    scale_ptr,
    shift_ptr,
    res_ptr,
    count_ptr,
    mean_part_ptr,
    m2_part_ptr,
    # sizes
    H,
    W,
    C,
    K,
    P,
    Q,
    M,
    M_BUCKET,
    # strides
    sx_n,
    sx_h,
    sx_w,
    sx_c,
    sy_n,
    sy_h,
    sy_w,
    sy_k,
    sr_n,
    sr_h,
    sr_w,
    sr_k,
    # convolution
    STRIDE_H,
    STRIDE_W,
    PAD_H,
    PAD_W,
    DIL_H,
    DIL_W,
    # meta
    R: tl.constexpr,
    S: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STATS: tl.constexpr,
    INDEX_64: tl.constexpr,
    X_ALIGN: tl.constexpr,
    Y_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The host's alignment promises: X_ALIGN divides C and x's pixel strides, Y_ALIGN divides K and the pixel
    # strides of y and the residual.
    C = _multiple_of(C, X_ALIGN)
    sx_n = _multiple_of(sx_n, X_ALIGN)
    sx_h = _multiple_of(sx_h, X_ALIGN)
    sx_w = _multiple_of(sx_w, X_ALIGN)
    K = _multiple_of(K, Y_ALIGN)
    sy_n = _multiple_of(sy_n, Y_ALIGN)
    sy_h = _multiple_of(sy_h, Y_ALIGN)
    sy_w = _multiple_of(sy_w, Y_ALIGN)

    # Output-channel blocks vary fastest, so programs that share an input tile run together (L2 reuse). Every
    # index below follows the width of these ranges.
    pid = tl.program_id(0)
    lanes_m = tl.arange(0, BLOCK_M)
    lanes_n = tl.arange(0, BLOCK_N)
    lanes_k = tl.arange(0, BLOCK_K)
    if INDEX_64:
        pid = pid.to(tl.int64)
        lanes_m = lanes_m.to(tl.int64)
        lanes_n = lanes_n.to(tl.int64)
        lanes_k = lanes_k.to(tl.int64)
    num_n = tl.cdiv(K, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n

    offs_m = pid_m * BLOCK_M + lanes_m
    offs_n = pid_n * BLOCK_N + lanes_n
    mask_m = offs_m < M
    mask_n = offs_n < K
    img = offs_m // (P * Q)
    pq = offs_m % (P * Q)
    out_h = pq // Q
    out_w = pq % Q
    in_h0 = out_h * STRIDE_H - PAD_H
    in_w0 = out_w * STRIDE_W - PAD_W
    x_img = img * sx_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if R * S == 1:
        # 1x1: one input pixel per output row and a plain channel loop (the loop shape 8 warps are safe for).
        pix_ok = mask_m & (in_h0 >= 0) & (in_h0 < H) & (in_w0 >= 0) & (in_w0 < W)
        x_row = x_img + in_h0 * sx_h + in_w0 * sx_w
        for c0 in range(0, C, BLOCK_K):
            offs_c = c0 + lanes_k
            mask_c = offs_c < C
            x_tile = tl.load(
                x_ptr + x_row[:, None] + (offs_c * sx_c)[None, :],
                mask=pix_ok[:, None] & mask_c[None, :],
                other=0.0,
            )
            w_tile = tl.load(
                w_ptr + (offs_c * K)[:, None] + offs_n[None, :],
                mask=mask_c[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(x_tile, w_tile, acc, input_precision=DOT_PRECISION)
    else:
        # The reduction loop flattened over (tap, channel block): one loop for the software pipeliner.
        c_blocks = tl.cdiv(C, BLOCK_K)
        for t in range(R * S * c_blocks):
            tap = t // c_blocks
            c0 = (t % c_blocks) * BLOCK_K
            r = tap // S
            s = tap % S
            in_h = in_h0 + r * DIL_H
            in_w = in_w0 + s * DIL_W
            pix_ok = mask_m & (in_h >= 0) & (in_h < H) & (in_w >= 0) & (in_w < W)
            offs_c = c0 + lanes_k
            mask_c = offs_c < C
            x_tile = tl.load(
                x_ptr + (x_img + in_h * sx_h + in_w * sx_w)[:, None] + (offs_c * sx_c)[None, :],
                mask=pix_ok[:, None] & mask_c[None, :],
                other=0.0,
            )
            # Packed weight: [R, S, C, K] contiguous, i.e. K-major rows of the GEMM's B matrix.
            w_tile = tl.load(
                w_ptr + ((tap * C + offs_c) * K)[:, None] + offs_n[None, :],
                mask=mask_c[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(x_tile, w_tile, acc, input_precision=DOT_PRECISION)

    mask_out = mask_m[:, None] & mask_n[None, :]
    if STATS:  # of z - bias (the accumulator): the merge adds the bias back once
        count = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
        tile_mean, tile_m2 = tile_mean_m2(acc, mask_m[:, None], count)
        tl.store(mean_part_ptr + pid_m * K + offs_n, tile_mean, mask=mask_n)
        tl.store(m2_part_ptr + pid_m * K + offs_n, tile_m2, mask=mask_n)
        if pid_n == 0:
            tl.store(count_ptr + pid_m, count)
    z = acc
    if HAS_BIAS:
        z = z + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    u = z
    if HAS_SCALE:
        u = u * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_SHIFT:
        u = u + tl.load(shift_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        sr_n = _multiple_of(sr_n, Y_ALIGN)
        sr_h = _multiple_of(sr_h, Y_ALIGN)
        sr_w = _multiple_of(sr_w, Y_ALIGN)
        res_offs = (img * sr_n + out_h * sr_h + out_w * sr_w)[:, None] + (offs_n * sr_k)[None, :]
        u = u + tl.load(res_ptr + res_offs, mask=mask_out, other=0.0).to(tl.float32)
    u = _activate(u, ACTIVATION)
    y_offs = (img * sy_n + out_h * sy_h + out_w * sy_w)[:, None] + (offs_n * sy_k)[None, :]
    tl.store(y_ptr + y_offs, u.to(y_ptr.dtype.element_ty), mask=mask_out)


# ---------------------------------------------------------------------------------------------------------
# Launcher: check → allocate → launch


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(K, C, R, S) weight → contiguous (R, S, C, K): the K-major GEMM operand the kernel reads."""
    return weight.permute(2, 3, 1, 0).contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """Precision of ``tl.dot``: for fp32 the same as cuDNN's under torch's flag (TF32 by default).

    For 16-bit inputs the setting does not change the product; "tf32" is Triton's own default there. The
    interpreter multiplies exactly in numpy whatever is asked, so it gets "ieee".
    """
    if interpreter_enabled():
        return "ieee"
    if dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
        return "ieee"
    return "tf32"


def pixel_alignment(t: torch.Tensor) -> int:
    """What divides the channel count and every pixel stride of an NHWC ``t`` (strides of size-1 dims never
    multiply a nonzero index, so they do not count): the kernel's alignment promise, 1 unless channels are
    contiguous."""
    if t.shape[1] > 1 and t.stride(1) != 1:
        return 1
    return pow2_alignment(t.shape[1], *(t.stride(d) for d in (0, 2, 3) if t.shape[d] > 1))


def check_conv_bn_act_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    activation: str,
) -> tuple[int, int, int, int]:
    """Validate with messages that name the problem; return ``(N, K, P, Q)``. Shared by op and fake."""
    op = "conv_bn_act"
    if x.dim() != 4:
        raise ValueError(
            f"{op}: x must be a 4-D (N, C, H, W) channels_last tensor, got shape {tuple(x.shape)}"
        )
    if weight.dim() != 4:
        raise ValueError(f"{op}: weight must be 4-D (C_out, C_in, kH, kW), got shape {tuple(weight.shape)}")
    check_dtype(x, "x")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight dtype {weight.dtype} does not match x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x is on {x.device}")
    if dense_layout(x) != torch.channels_last:
        raise ValueError(
            f"{op}: x must be in channels_last (NHWC) memory format; "
            "call x.contiguous(memory_format=torch.channels_last) first"
        )
    n, c, h, w = x.shape
    k, c_w, r, s = weight.shape
    if c_w != c:
        raise ValueError(
            f"{op}: x has {c} input channels but weight expects {c_w} (weight shape {tuple(weight.shape)}); "
            "grouped convolution is not supported by the fused op"
        )
    if x.numel() == 0 or weight.numel() == 0:
        raise ValueError(f"{op}: empty input {tuple(x.shape)} or weight {tuple(weight.shape)}")
    if len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        raise ValueError(
            f"{op}: stride, padding and dilation need 2 entries, got {stride}, {padding}, {dilation}"
        )
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError(
            f"{op}: need stride >= 1, dilation >= 1, padding >= 0; got {stride}, {dilation}, {padding}"
        )
    check_activation(activation, op)
    p, q = conv2d_output_hw(h, w, r, s, stride, padding, dilation)
    if p <= 0 or q <= 0:
        raise ValueError(
            f"{op}: output would be empty ({p}x{q}) for a {h}x{w} input, {r}x{s} kernel, "
            f"stride={list(stride)}, padding={list(padding)}, dilation={list(dilation)}"
        )
    for name, vec in (("bias", bias), ("scale", scale), ("shift", shift)):
        if vec is None:
            continue
        if vec.dim() != 1 or vec.shape[0] != k:
            raise ValueError(
                f"{op}: {name} must be a 1-D tensor with one entry per output channel ({k}), "
                f"got shape {tuple(vec.shape)}"
            )
        check_dtype(vec, name)
        if vec.device != x.device:
            raise ValueError(f"{op}: {name} is on {vec.device} but x is on {x.device}")
    if residual is not None:
        if tuple(residual.shape) != (n, k, p, q):
            raise ValueError(
                f"{op}: residual must have the output's shape {(n, k, p, q)}, got {tuple(residual.shape)}"
            )
        check_dtype(residual, "residual")
        if residual.device != x.device:
            raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    return n, k, p, q


def _empty_output(x: torch.Tensor, n: int, k: int, p: int, q: int) -> torch.Tensor:
    return empty_dense((n, k, p, q), x, torch.channels_last)


def _empty_stats(x: torch.Tensor, k: int, stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = k if stats else 0  # two distinct tensors: custom-op outputs may not alias each other
    return (
        x.new_empty((width,), dtype=torch.float32),
        x.new_empty((width,), dtype=torch.float32),
    )


def conv_bn_act_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    activation: str,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused conv on validated arguments; returns ``(y, mean, var)`` (empty stats unless asked)."""
    n, c, h, w = x.shape
    k, _, r, s = weight.shape
    p, q = conv2d_output_hw(h, w, r, s, stride, padding, dilation)
    m = n * p * q
    y = _empty_output(x, n, k, p, q)
    w_packed = pack_weight(weight)
    bias, scale, shift = dense_vector(bias), dense_vector(scale), dense_vector(shift)
    # Absent optional operands get a harmless stand-in pointer; their constexpr flag keeps them unread.
    res_t = residual if residual is not None else y
    counts = mean_parts = m2_parts = y
    if stats:
        # Per-tile statistics, sized for the smallest BLOCK_M any config may use; the kernel writes each
        # tile's row count (zeroed here and before every benchmark run), so unused rows count for nothing.
        tiles = triton.cdiv(m, MIN_BLOCK_M)
        counts = torch.zeros((tiles,), device=x.device, dtype=torch.float32)
        mean_parts = torch.empty((tiles, k), device=x.device, dtype=torch.float32)
        m2_parts = torch.empty((tiles, k), device=x.device, dtype=torch.float32)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]),)

    with launch_context(x):
        _conv_bn_act_kernel[grid](
            x,
            w_packed,
            y,
            bias if bias is not None else y,
            scale if scale is not None else y,
            shift if shift is not None else y,
            res_t,
            counts,
            mean_parts,
            m2_parts,
            h,
            w,
            c,
            k,
            p,
            q,
            m,
            m_bucket(m),
            x.stride(0),
            x.stride(2),
            x.stride(3),
            x.stride(1),
            y.stride(0),
            y.stride(2),
            y.stride(3),
            y.stride(1),
            res_t.stride(0),
            res_t.stride(2),
            res_t.stride(3),
            res_t.stride(1),
            stride[0],
            stride[1],
            padding[0],
            padding[1],
            dilation[0],
            dilation[1],
            R=r,
            S=s,
            HAS_BIAS=bias is not None,
            HAS_SCALE=scale is not None,
            HAS_SHIFT=shift is not None,
            HAS_RESIDUAL=residual is not None,
            ACTIVATION=activation_code(activation),
            STATS=stats,
            INDEX_64=needs_int64(x, y, residual, w_packed),
            X_ALIGN=pixel_alignment(x),
            Y_ALIGN=min(pixel_alignment(t) for t in (y, residual) if t is not None),
            DOT_PRECISION=dot_precision(x.dtype),
        )
    if not stats:
        return (y, *_empty_stats(x, k, False))
    mean, var = merge_channel_stats(counts, mean_parts, m2_parts, shift=bias)
    return y, mean, var


# ---------------------------------------------------------------------------------------------------------
# torch.library op: forward, fake, autograd


@torch.library.custom_op("lcv::conv_bn_act", mutates_args=())
def _conv_bn_act_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k, p, q = check_conv_bn_act_args(
        x, weight, bias, scale, shift, residual, stride, padding, dilation, activation
    )
    if use_triton(x):
        return conv_bn_act_triton(
            x, weight, bias, scale, shift, residual, stride, padding, dilation, activation, stats
        )
    # The caller already applied autocast's cast; the reference must compute in the dtypes it was given.
    with torch.autocast(x.device.type, enabled=False):
        y, mean, var = conv_bn_act_reference(
            x,
            weight,
            bias,
            stride=stride,
            padding=padding,
            dilation=dilation,
            scale=scale,
            shift=shift,
            residual=residual,
            activation=activation,
            stats=stats,
        )
    y = in_layout_of(y, _empty_output(x, n, k, p, q))
    if not stats:
        return (y, *_empty_stats(x, k, False))
    assert mean is not None and var is not None  # the reference returns them with stats=True
    return y, mean.float(), var.float()


@_conv_bn_act_op.register_fake
def _conv_bn_act_fake(x, weight, bias, scale, shift, residual, stride, padding, dilation, activation, stats):
    n, k, p, q = check_conv_bn_act_args(
        x, weight, bias, scale, shift, residual, stride, padding, dilation, activation
    )
    return (_empty_output(x, n, k, p, q), *_empty_stats(x, k, stats))


@torch.library.custom_op("lcv::conv_bn_act_backward", mutates_args=())
def _conv_bn_act_backward_op(
    grad_z: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    output_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of the convolution, in ``x``'s and ``weight``'s dense layouts with canonical
    strides (``aten.convolution_backward`` picks its output layout from the strides of size-1 dims too, which
    a compiled graph does not keep); an entry not asked for in ``output_mask`` is an empty tensor."""
    want_x, want_w = output_mask
    grad_x = grad_w = None
    if want_x and _triton_dgrad_applies(x, weight, stride, padding, dilation):
        grad_x = triton_conv_input_grad(grad_z, weight, padding, dilation)
        want_x = False
    if want_x or want_w:
        # CPU has no fast half-precision convolution backward: do it in fp32 there.
        compute = x.dtype if x.is_cuda else accumulation_dtype(x.dtype)
        x_in, stride_in = x, stride
        if _pointwise_strided_on_cpu(x, weight, stride, padding):
            x_in, stride_in = x[:, :, :: stride[0], :: stride[1]], [1, 1]
        aten_grad_x, aten_grad_w, _ = torch.ops.aten.convolution_backward(
            grad_z.to(compute),
            x_in.to(compute),
            weight.to(compute),
            None,
            stride_in,
            padding,
            dilation,
            False,
            [0, 0],
            1,
            [want_x, want_w, False],
        )
        if want_x and x_in is not x:  # the sampled pixels get the gradient, the skipped ones zero
            full = torch.zeros(x.shape, dtype=aten_grad_x.dtype, device=x.device)
            full[:, :, :: stride[0], :: stride[1]] = aten_grad_x
            aten_grad_x = full
        grad_x = aten_grad_x if want_x else grad_x
        grad_w = aten_grad_w
    return (
        x.new_empty((0,)) if grad_x is None else in_layout_of(grad_x, x),
        weight.new_empty((0,)) if grad_w is None else in_layout_of(grad_w, weight),
    )


def _pointwise_strided_on_cpu(
    x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int]
) -> bool:
    """A strided 1x1 convolution without padding, on the CPU: its backward runs as a stride-1 one on the
    pixels it samples (``x[:, :, ::sh, ::sw]``, the same products). oneDNN limited to AVX2 (torch 2.14.1,
    ``ONEDNN_MAX_CPU_ISA=AVX2``) returns a wrong weight gradient for the strided one on a channels_last
    input, from the second such call in a process on (errors of order 10 on unit-normal data;
    tests/kernels/test_conv_bn_act.py checks it)."""
    pointwise = weight.shape[2] == weight.shape[3] == 1 and list(padding) == [0, 0]
    return not x.is_cuda and pointwise and list(stride) != [1, 1]


@_conv_bn_act_backward_op.register_fake
def _conv_bn_act_backward_fake(grad_z, x, weight, stride, padding, dilation, output_mask):
    want_x, want_w = output_mask
    return (
        empty_in_layout_of(x) if want_x else x.new_empty((0,)),
        empty_in_layout_of(weight) if want_w else weight.new_empty((0,)),
    )


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, scale, shift, residual, stride, padding, dilation, activation, _stats = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)
    ctx.stride, ctx.padding, ctx.dilation, ctx.activation = stride, padding, dilation, activation
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.save_for_backward(x, weight, bias, scale, shift, residual, output[0])


def _channel_sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dim=(0, 2, 3))


def _backward(ctx: Any, grad_y: torch.Tensor | None, _grad_mean: Any, _grad_var: Any) -> tuple:
    x, weight, bias, scale, shift, residual, y = ctx.saved_tensors
    none = (None,) * 11
    if grad_y is None:
        return none
    need = ctx.needs_input_grad
    acc = accumulation_dtype(x.dtype)
    needs_z = ctx.activation in ("gelu", "silu") or (scale is not None and need[3])
    z = None
    if needs_z:  # recompute conv + bias rather than keep a second full-size activation alive
        z = _conv_bn_act_op(
            x, weight, bias, None, None, None, ctx.stride, ctx.padding, ctx.dilation, "none", False
        )
        z = z[0].to(acc)
    grad_u = grad_y.to(acc)
    if ctx.activation == "relu":  # relu' follows from the output: no recompute for eval-mode-BN blocks
        grad_u = grad_u * (y > 0)
    elif ctx.activation != "none":
        assert z is not None  # needs_z holds for gelu and silu
        grad_u = grad_u * activation_grad(
            epilogue_reference(z, scale, shift, residual, "none"), ctx.activation
        )
    grad_residual = grad_u.to(ctx.residual_dtype) if residual is not None and need[5] else None
    grad_shift = _channel_sum(grad_u).to(shift.dtype) if shift is not None and need[4] else None
    grad_scale = None
    if scale is not None and need[3]:
        assert z is not None  # needs_z holds when the scale needs a gradient
        grad_scale = _channel_sum(grad_u * z).to(scale.dtype)
    grad_z = grad_u * scale.to(acc).view(1, -1, 1, 1) if scale is not None else grad_u
    grad_bias = _channel_sum(grad_z).to(bias.dtype) if bias is not None and need[2] else None
    grad_x = grad_w = None
    if need[0] or need[1]:
        grad_x, grad_w = _conv_bn_act_backward_op(
            grad_z.to(x.dtype).contiguous(memory_format=torch.channels_last),
            x,
            weight,
            ctx.stride,
            ctx.padding,
            ctx.dilation,
            [bool(need[0]), bool(need[1])],
        )
        grad_x = grad_x if need[0] else None
        grad_w = grad_w.to(weight.dtype) if need[1] else None
    return grad_x, grad_w, grad_bias, grad_scale, grad_shift, grad_residual, None, None, None, None, None


_conv_bn_act_op.register_autograd(_backward, setup_context=_setup_context)


#: Environment switch for the input gradient: "aten" (default, cuDNN on GPU) or "triton".
DGRAD_ENV = "LCV_CONV_DGRAD"


def dgrad_impl() -> str:
    """Which implementation computes grad_input: ``$LCV_CONV_DGRAD``, "aten" unless set to "triton"."""
    value = os.environ.get(DGRAD_ENV, "aten")
    if value not in ("aten", "triton"):
        raise ValueError(f"{DGRAD_ENV}={value!r}; expected 'aten' or 'triton'")
    return value


def _triton_dgrad_applies(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> bool:
    """Stride-1 convs only: their input gradient is itself a stride-1 conv, run by our forward kernel."""
    if dgrad_impl() != "triton" or not use_triton(x) or list(stride) != [1, 1]:
        return False
    r, s = weight.shape[2], weight.shape[3]
    return dilation[0] * (r - 1) >= padding[0] and dilation[1] * (s - 1) >= padding[1]


def triton_conv_input_grad(
    grad_z: torch.Tensor, weight: torch.Tensor, padding: Sequence[int], dilation: Sequence[int]
) -> torch.Tensor:
    """grad_input of a stride-1 conv = conv(grad_z, weight flipped in space with in/out swapped), padded by
    ``dilation * (k - 1) - padding``."""
    weight_t = weight.flip(2, 3).transpose(0, 1)
    pad = [dilation[0] * (weight.shape[2] - 1) - padding[0], dilation[1] * (weight.shape[3] - 1) - padding[1]]
    grad_z = grad_z.contiguous(memory_format=torch.channels_last)
    return _conv_bn_act_op(
        grad_z, weight_t, None, None, None, None, [1, 1], pad, list(dilation), "none", False
    )[0]


# ---------------------------------------------------------------------------------------------------------
# Functional API


def _autocast_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under autocast, cast x and weight to the autocast dtype, as autocast does for ``F.conv2d``.

    The custom op itself is not autocast-aware (it would see a bf16 activation and an fp32 weight);
    epilogue vectors and the residual are accepted in any float dtype and applied in fp32.
    """
    device_type = x.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return x.to(dtype), weight.to(dtype)
    return x, weight


@overload
def conv_bn_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str = "none",
    stats: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def conv_bn_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str = "none",
    stats: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def conv_bn_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str = "none",
    stats: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def conv_bn_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str = "none",
    stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-D convolution of a channels_last tensor with a fused per-channel epilogue.

    Computes ``z = conv2d(x, weight) + bias`` with fp32 accumulation, then returns
    ``y = act(z * scale + shift + residual)`` in ``x.dtype`` and channels_last layout. Each epilogue operand
    is optional; ``activation`` is one of ``"none"``, ``"relu"``, ``"gelu"`` (exact erf form), ``"silu"``.
    With ``stats=True`` it returns ``(y, mean, var)``: the per-channel mean and biased variance of ``z`` over
    batch and space (fp32, not differentiable), the batch statistics a training BatchNorm needs.

    ``groups > 1`` (grouped / depthwise) has no Triton kernel: it runs the differentiable PyTorch reference
    (``F.conv2d`` + elementwise epilogue), with the same semantics.
    """
    stride_, padding_, dilation_ = (
        pair(stride, "stride"),
        pair(padding, "padding"),
        pair(dilation, "dilation"),
    )
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    x, weight = _autocast_operands(x, weight)
    if groups != 1:
        y, mean, var = conv_bn_act_reference(
            x,
            weight,
            bias,
            stride=stride_,
            padding=padding_,
            dilation=dilation_,
            groups=groups,
            scale=scale,
            shift=shift,
            residual=residual,
            activation=activation,
            stats=stats,
        )
        if stats:
            assert mean is not None and var is not None  # the reference returns them with stats=True
            return y, mean.detach().float(), var.detach().float()
        return y
    y, mean, var = _conv_bn_act_op(
        x, weight, bias, scale, shift, residual, stride_, padding_, dilation_, activation, stats
    )
    return (y, mean, var) if stats else y


# ---------------------------------------------------------------------------------------------------------
# Conv2d → BatchNorm2d → activation on existing modules


def conv_padding(conv: nn.Conv2d) -> list[int] | None:
    """Explicit ``[pad_h, pad_w]`` of a conv, or None when it is asymmetric (``"same"`` with an even effective
    kernel pads one side more, which the fused conv cannot express)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return [0, 0]
        pads = []
        for dilation, kernel in zip(conv.dilation, conv.kernel_size, strict=True):
            total = dilation * (kernel - 1)
            if total % 2:
                return None
            pads.append(total // 2)
        return pads
    return [int(p) for p in conv.padding]


def _cannot_express(conv: nn.Module, bn: nn.Module | None) -> str | None:
    """Why ``conv`` → ``bn`` is not something ``conv_bn_act`` computes at all, or None.

    The conv must be exactly an ``nn.Conv2d`` (a subclass may pad or convolve differently). ``bn`` may be a
    ``BatchNorm2d`` subclass: the op reads only the tensors and attributes BatchNorm2d defines, and whether
    a subclass's forward normalises as BatchNorm2d's does (timm's ``BatchNormAct2d`` does) is the caller's
    knowledge.
    """
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not an nn.Conv2d"
    if bn is not None and not isinstance(bn, nn.BatchNorm2d):
        return f"{type(bn).__name__} is not an nn.BatchNorm2d"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros' is fused)"
    if conv_padding(conv) is None:
        return f"padding={conv.padding!r} is asymmetric for kernel {tuple(conv.kernel_size)}"
    if bn is not None and bn.num_features != conv.out_channels:
        return f"bn has {bn.num_features} features but conv has {conv.out_channels} output channels"
    return None


def why_conv_bn_act_not_fusable(conv: nn.Module, bn: nn.Module | None) -> str | None:
    """None if :func:`conv_bn_act_forward` runs ``conv`` → ``bn`` on the Triton kernel, else the reason (what
    a model rewrite reports when it leaves the pair eager)."""
    reason = _cannot_express(conv, bn)
    if reason is None and conv.groups != 1:
        reason = f"grouped conv (groups={conv.groups}) has no Triton kernel"
    return reason or unsupported_dtype_reason(conv, bn)


def conv_bn_act_forward(
    conv: nn.Conv2d,
    bn: nn.BatchNorm2d | None,
    x: torch.Tensor,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(bn(conv(x)) + residual)`` on the tensors of existing modules, output channels_last.

    Training (batch statistics): ``lcv::conv_bn_act`` writes ``z`` and its per-channel mean and variance from
    the epilogue; ``lcv::batch_norm_act`` takes those (no statistics pass over ``z``), updates the running
    statistics and applies scale/shift, residual and activation in one pass. Eval: BatchNorm is folded into
    the conv epilogue (one kernel in all). Without ``bn``: conv (+ residual) + activation in one kernel.
    Grouped convs run the PyTorch reference of the conv.
    """
    reason = _cannot_express(conv, bn)
    if reason is not None:
        raise ValueError(f"conv_bn_act cannot fuse these modules: {reason}")
    x = x.contiguous(memory_format=torch.channels_last)
    padding = conv_padding(conv)
    assert padding is not None  # _cannot_express rejects the asymmetric padding that has none
    stride, dilation, groups = tuple(conv.stride), tuple(conv.dilation), conv.groups
    if bn is not None and (bn.training or (bn.running_mean is None and bn.running_var is None)):
        z, mean, var = conv_bn_act(
            x,
            conv.weight,
            conv.bias,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            stats=True,
        )
        return batch_norm_act_forward(bn, z, activation, residual, batch_mean=mean, batch_var=var)
    scale = shift = None
    if bn is not None:
        # Eval with running statistics: BatchNorm2d keeps both or neither, and neither returned above.
        assert bn.running_mean is not None and bn.running_var is not None
        scale, shift = batch_norm_scale_shift(bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return conv_bn_act(
            x,
            conv.weight,
            conv.bias,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            scale=scale,
            shift=shift,
            residual=res,
            activation=act,
        )

    return fuse_residual(run, out_dtype, activation, residual)


class FusedConvBNAct(nn.Module):
    """Conv2d (+ BatchNorm2d) (+ residual add) (+ activation) on channels_last tensors via
    ``lcv::conv_bn_act``.

    ``forward(x, residual=None)`` computes ``act(bn(conv(x)) + residual)``, the order of a ResNet block's
    tail.
    It *shares* the given ``nn.Conv2d`` and ``nn.BatchNorm2d`` (kept as ``.conv`` and ``.bn``), so parameters,
    buffers and optimizer state are the same tensors as before; inputs that are not channels_last are
    converted and the output is channels_last.
    """

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d | None = None, activation: str = "none") -> None:
        super().__init__()
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        if bn is not None and not isinstance(bn, nn.BatchNorm2d):
            raise TypeError(f"bn must be an nn.BatchNorm2d or None, got {type(bn).__name__}")
        reason = _cannot_express(conv, bn)
        if reason is not None:
            raise ValueError(f"FusedConvBNAct cannot fuse these modules: {reason}")
        check_activation(activation, type(self).__name__)
        self.conv = conv
        self.bn = bn
        self.activation = activation

    @classmethod
    def from_modules(
        cls, conv: nn.Conv2d, bn: nn.BatchNorm2d | None = None, act: nn.Module | None = None
    ) -> FusedConvBNAct:
        """Wrap existing modules, sharing (not copying) their parameters and buffers."""
        return cls(conv, bn, checked_activation_name(act))

    @classmethod
    def why_not_fusable(
        cls, conv: nn.Module, bn: nn.Module | None = None, act: nn.Module | None = None
    ) -> str | None:
        """None if ``from_modules(conv, bn, act)`` would succeed, else the reason it would raise."""
        try:
            cls.from_modules(conv, bn, act)  # type: ignore[arg-type]  # any modules: from_modules checks them
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return conv_bn_act_forward(self.conv, self.bn, x, self.activation, residual)
