"""Triton implicit-GEMM 2-D convolution for NHWC tensors, with a fused per-channel epilogue.

GEMM view: M = N·P·Q output pixels, N_gemm = K output channels, K_gemm = R·S·C (kernel taps × input
channels). One program computes a [BLOCK_M, BLOCK_N] output tile; its reduction loop is flattened over
(tap, channel block) so the software pipeliner sees one loop (as Inductor's template does). Channels are
contiguous in NHWC, so each input tile load is a row of BLOCK_K contiguous values per pixel.

The epilogue runs on the fp32 accumulator before the single store:
``z = acc + bias``; optional per-channel ``Σz`` and ``Σz²`` (atomically added into two [K] fp32 buffers, so a
training BatchNorm needs no second read of the output); ``y = act(z * scale + shift + residual)``.

All offsets are int64 (program ids are widened first), so tensors over 2**31 elements are addressed safely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import activation_code, interpreter_enabled
from kernels.conv_reference import conv2d_output_hw

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps). num_warps stays at 4 for the flattened-tap loop:
# Triton has miscompiled that loop shape with 8 warps (pytorch#173068).
_GPU_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 128, 64, 3, 4),
    (128, 128, 32, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 64, 32, 4, 4),
    (128, 64, 16, 4, 4),
)
# The interpreter runs every program in numpy: one config (no benchmarking), few programs.
_INTERPRETER_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = ((64, 16, 16, 1, 4),)


def _configs() -> list[triton.Config]:
    table = _INTERPRETER_CONFIGS if interpreter_enabled() else _GPU_CONFIGS
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=st, num_warps=nw)
        for bm, bn, bk, st, nw in table
    ]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop channel blocks much wider than C (C=3 first layers) and output blocks much wider than K."""
    c, k = named_args["C"], named_args["K"]
    kept = [
        cfg
        for cfg in configs
        if cfg.kwargs["BLOCK_K"] <= max(16, triton.next_power_of_2(c))
        and cfg.kwargs["BLOCK_N"] <= max(16, triton.next_power_of_2(k))
    ]
    return kept or configs[-1:]


@triton.autotune(
    configs=_configs(),
    key=[
        "N",
        "H",
        "W",
        "C",
        "K",
        "P",
        "Q",
        "R",
        "S",
        "STRIDE_H",
        "STRIDE_W",
        "PAD_H",
        "PAD_W",
        "DIL_H",
        "DIL_W",
        "HAS_BIAS",
        "HAS_SCALE",
        "HAS_SHIFT",
        "HAS_RESIDUAL",
        "ACTIVATION",
        "STATS",
    ],
    prune_configs_by={"early_config_prune": _prune_configs},
    reset_to_zero=["sum_ptr", "sumsq_ptr"],
)
@triton.jit
def _conv2d_nhwc_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    bias_ptr,
    scale_ptr,
    shift_ptr,
    res_ptr,
    sum_ptr,
    sumsq_ptr,
    N,
    H,
    W,
    C,
    K,
    P,
    Q,
    M,
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
    STRIDE_H,
    STRIDE_W,
    PAD_H,
    PAD_W,
    DIL_H,
    DIL_W,
    R: tl.constexpr,
    S: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STATS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Output-channel blocks vary fastest, so programs that share an input tile run together (L2 reuse).
    pid = tl.program_id(0).to(tl.int64)
    num_n = tl.cdiv(K, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < K
    img = offs_m // (P * Q)
    pq = offs_m % (P * Q)
    out_h = pq // Q
    out_w = pq % Q
    in_h0 = out_h * STRIDE_H - PAD_H
    in_w0 = out_w * STRIDE_W - PAD_W

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_blocks = tl.cdiv(C, BLOCK_K)
    for t in range(R * S * c_blocks):
        tap = t // c_blocks
        c0 = (t % c_blocks) * BLOCK_K
        r = tap // S
        s = tap % S
        in_h = in_h0 + r * DIL_H
        in_w = in_w0 + s * DIL_W
        pix_ok = mask_m & (in_h >= 0) & (in_h < H) & (in_w >= 0) & (in_w < W)
        offs_c = c0 + tl.arange(0, BLOCK_K).to(tl.int64)
        mask_c = offs_c < C
        x_tile = tl.load(
            x_ptr + (img * sx_n + in_h * sx_h + in_w * sx_w)[:, None] + (offs_c * sx_c)[None, :],
            mask=pix_ok[:, None] & mask_c[None, :],
            other=0.0,
        )
        # Packed weight: [R, S, C, K] contiguous, i.e. K-major rows of the GEMM's B matrix.
        w_rows = tap.to(tl.int64) * C + offs_c
        w_tile = tl.load(
            w_ptr + (w_rows * K)[:, None] + offs_n[None, :],
            mask=mask_c[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = tl.dot(x_tile, w_tile, acc, input_precision=DOT_PRECISION)

    z = acc
    if HAS_BIAS:
        z = z + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if STATS:
        z_valid = tl.where(mask_out, z, 0.0)
        tl.atomic_add(sum_ptr + offs_n, tl.sum(z_valid, axis=0), mask=mask_n)
        tl.atomic_add(sumsq_ptr + offs_n, tl.sum(z_valid * z_valid, axis=0), mask=mask_n)
    u = z
    if HAS_SCALE:
        u = u * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_SHIFT:
        u = u + tl.load(shift_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        res_offs = (img * sr_n + out_h * sr_h + out_w * sr_w)[:, None] + (offs_n * sr_k)[None, :]
        u = u + tl.load(res_ptr + res_offs, mask=mask_out, other=0.0).to(tl.float32)
    if ACTIVATION == 1:
        u = tl.maximum(u, 0.0)
    elif ACTIVATION == 2:
        u = 0.5 * u * (1.0 + tl.erf(u * 0.7071067811865476))
    elif ACTIVATION == 3:
        u = u / (1.0 + tl.exp(-u))
    y_offs = (img * sy_n + out_h * sy_h + out_w * sy_w)[:, None] + (offs_n * sy_k)[None, :]
    tl.store(y_ptr + y_offs, u.to(y_ptr.dtype.element_ty), mask=mask_out)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(K, C, R, S) weight → contiguous (R, S, C, K): the K-major GEMM operand the kernel reads."""
    return weight.permute(2, 3, 1, 0).contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    """Precision of ``tl.dot``: like cuDNN under torch's flag for fp32 (TF32 by default).

    For 16-bit inputs the setting does not change the product; "tf32" is Triton's own default there. The
    interpreter multiplies exactly in numpy whatever is asked, so it gets "ieee".
    """
    if interpreter_enabled():
        return "ieee"
    if dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
        return "ieee"
    return "tf32"


def conv2d_fused_triton(
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
    """Launch the fused conv. Arguments must already be validated (see ``check_conv2d_fused_args``).

    Returns ``(y, sum, sumsq)``; the sums are empty fp32 tensors when ``stats`` is False.
    """
    n, c, h, w = x.shape
    k, _, r, s = weight.shape
    p, q = conv2d_output_hw(h, w, r, s, stride, padding, dilation)
    y = torch.empty((n, k, p, q), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    sums = torch.zeros((k if stats else 0,), device=x.device, dtype=torch.float32)
    sumsq = torch.zeros((k if stats else 0,), device=x.device, dtype=torch.float32)
    w_packed = pack_weight(weight)
    # Absent optional operands get a harmless stand-in pointer; their constexpr flag keeps them unread.
    bias_t = bias if bias is not None else y
    scale_t = scale if scale is not None else y
    shift_t = shift if shift is not None else y
    res_t = residual if residual is not None else y
    sum_t = sums if stats else y
    sumsq_t = sumsq if stats else y
    m = n * p * q

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]),)

    with torch.cuda.device(x.device) if x.is_cuda else _nullcontext():
        _conv2d_nhwc_fwd_kernel[grid](
            x,
            w_packed,
            y,
            bias_t,
            scale_t,
            shift_t,
            res_t,
            sum_t,
            sumsq_t,
            n,
            h,
            w,
            c,
            k,
            p,
            q,
            m,  # a Python int: Triton passes it as int64 once it exceeds int32
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
            DOT_PRECISION=_dot_precision(x.dtype),
        )
    return y, sums, sumsq


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
