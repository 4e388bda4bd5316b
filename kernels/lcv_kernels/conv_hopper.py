"""A persistent TMA convolution for Hopper (sm_90a), NHWC fp16/bf16: the implicit GEMM without per-element masks.

Why a second conv kernel: ``conv_bn_act``'s kernel builds every im2col address and padding mask per element
and loads with ``cp.async`` (312 SASS instructions per 8 HGMMA on a 3x3, one tile per CTA, nothing
pipelined at C=64; issue 38). Here every operand tile comes through a TMA tensor descriptor, so the loop
body is a few coordinates and a barrier wait per K step:

* 1x1 stride-1 convs are a plain GEMM ``[N*H*W, C] @ [C, K]`` over 2-D descriptors (``MODE_GEMM``);
* RxS stride-1 convs load a 4-D box ``[TN, TH, TW, BLOCK_K]`` of the NHWC input at (image, row + r - pad,
  column + s - pad, channel) for each tap: rows/columns outside the image (the padding) and channels past C
  are the descriptor's out-of-bounds zero fill, not masks (``MODE_CONV``);
* stride-2 convs see the input as ``[N, H/2, 2, W/2, 2*C]`` (row parity and column parity become
  coordinates), so the same box walks every other row and column (``MODE_CONV_S2``; H, W even, C a
  multiple of BLOCK_K);
* stride-2 convs whose C rows are not 16 bytes (the C=3 stem) are repacked space-to-depth (2x2: C=3 ->
  12 channels padded to 16) and run as a stride-1 conv over that (``MODE_S2D``: 7x7/2 becomes 4x4/1).

Each program loops over output tiles (persistent, ``NUM_PROGRAMS`` programs) and the K loop is software
pipelined by Triton (``num_stages`` TMA stages in flight, mbarrier waits, wgmma). The output tile leaves
through a TMA store (out-of-bounds rows are clipped by the descriptor). Nothing autotunes without a GPU, so
:data:`CONFIGS` holds one static config per layer shape; :func:`select_config` falls back to a rule.

Not selected by ``kernels="auto"`` (no GPU has timed it yet); correctness is checked under
``TRITON_INTERPRET=1`` and the compiled SASS offline (:mod:`lcv_kernels.conv_hopper_sass`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from lcv_kernels._common import cdiv, interpreter_enabled
from lcv_kernels._triton import chan_merge, merge_channel_stats, tile_mean_m2, tl, triton

MODE_GEMM = 0
MODE_CONV = 1
MODE_CONV_S2 = 2
#: A host-side mode: a stride-2 conv whose C rows are not 16-byte aligned (the C=3 stem) runs as a
#: stride-1 ``MODE_CONV`` over the space-to-depth input (:func:`s2d_geometry`).
MODE_S2D = 3

#: Hopper's SM count (H100/H200 SXM): the persistent grid's default size.
HOPPER_SMS = 132


@dataclasses.dataclass(frozen=True)
class HopperConvConfig:
    """One launch config: an output tile of ``TN x TH x TW`` positions (``block_m`` rows; 1-D for the GEMM
    mode, where only ``block_m`` counts) by ``block_n`` output channels, ``block_k`` input channels a K
    step, and the pipeline depth and warps."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    tile: tuple[int, int, int] = (1, 1, 1)  # (TN, TH, TW) for the conv modes; their product is block_m

    def describe(self) -> str:
        """A short label for tables: ``BMxBNxBK sS wW [TNxTHxTW]``."""
        tile = "" if self.tile == (1, 1, 1) else f" tile {'x'.join(map(str, self.tile))}"
        return f"{self.block_m}x{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps}{tile}"


#: A layer shape: (C_in, H, W, C_out, kernel, stride, padding), as in ``benchmarks/conv.py``.
Shape = tuple[int, int, int, int, int, int, int]


def _gemm(bm: int, bn: int, bk: int, stages: int, warps: int) -> HopperConvConfig:
    return HopperConvConfig(bm, bn, bk, stages, warps)


def _conv(tile: tuple[int, int, int], bn: int, bk: int, stages: int, warps: int) -> HopperConvConfig:
    return HopperConvConfig(tile[0] * tile[1] * tile[2], bn, bk, stages, warps, tile)


#: Static per-shape configs (ResNet-50 v1.5, ResNet-18 and airbench94 layers), chosen offline from a sweep of
#: sm_90a compiles (tile, BLOCK_K 64/128, 4/8 warps: the SASS bar of issue 38, then the deepest pipeline that
#: fits 227 KB of shared memory): never timed on a GPU. One warpgroup (4 warps) per CTA throughout: with two,
#: each issues half the HGMMA for the same per-step overhead (250-380 instructions per 8 HGMMA in the sweep).
#: BLOCK_N is not bounded by C: 256x64 tiles where K or C is 64; 128x128 with BLOCK_K 128 for C >= 128
#: (BLOCK_K 64 x 4 stages for the deep 1x1s). 128x256 tiles need 8 warps (256 accumulator registers a
#: thread at 4) and missed the bar.
CONFIGS: dict[Shape, HopperConvConfig] = {
    # ResNet-50 (v1.5: the stride on the 3x3)
    (64, 56, 56, 64, 1, 1, 0): _gemm(256, 64, 64, 4, 4),
    (64, 56, 56, 64, 3, 1, 1): _conv((1, 16, 16), 64, 64, 4, 4),
    (64, 56, 56, 256, 1, 1, 0): _gemm(256, 64, 64, 4, 4),
    (256, 56, 56, 64, 1, 1, 0): _gemm(256, 64, 64, 4, 4),
    (128, 56, 56, 128, 3, 2, 1): _conv((1, 8, 16), 128, 128, 3, 4),
    (128, 28, 28, 128, 3, 1, 1): _conv((1, 8, 16), 128, 128, 3, 4),
    (1024, 14, 14, 256, 1, 1, 0): _gemm(
        128, 128, 64, 4, 4
    ),  # BLOCK_K 128 x 3 stages: 24 bytes over with statistics on 3.6
    (256, 14, 14, 256, 3, 1, 1): _conv((2, 8, 8), 128, 128, 3, 4),
    (512, 7, 7, 512, 3, 1, 1): _conv((2, 8, 8), 128, 128, 3, 4),
    (512, 7, 7, 2048, 1, 1, 0): _gemm(
        128, 128, 64, 4, 4
    ),  # BLOCK_K 128 x 3 stages: 24 bytes over with statistics on 3.6
    # ResNet-18 (its stride-1 3x3 shapes are ResNet-50's): stride-2 3x3s and 1x1 downsamples
    (64, 56, 56, 128, 3, 2, 1): _conv((1, 16, 16), 64, 64, 4, 4),
    (64, 56, 56, 128, 1, 2, 0): _conv((1, 16, 16), 64, 64, 4, 4),
    (128, 28, 28, 256, 3, 2, 1): _conv((2, 8, 8), 128, 128, 3, 4),
    (128, 28, 28, 256, 1, 2, 0): _conv((4, 8, 8), 64, 64, 4, 4),
    (256, 14, 14, 512, 3, 2, 1): _conv((2, 8, 8), 128, 128, 3, 4),
    (256, 14, 14, 512, 1, 2, 0): _conv((2, 8, 8), 128, 128, 3, 4),
    # the stem through space-to-depth: a 4x1 conv over 64 channels (see kernel_geometry)
    (3, 224, 224, 64, 7, 2, 3): _conv((1, 16, 16), 64, 64, 4, 4),
    # airbench94 (after the 2x2 whitening conv; batch 1024)
    (24, 31, 31, 64, 3, 1, 1): _conv((1, 16, 16), 64, 32, 4, 4),
    (64, 15, 15, 64, 3, 1, 1): _conv((1, 16, 16), 64, 64, 4, 4),
    (64, 15, 15, 256, 3, 1, 1): _conv((1, 16, 16), 64, 64, 4, 4),
    (256, 7, 7, 256, 3, 1, 1): _conv((2, 8, 8), 128, 128, 3, 4),
    (256, 3, 3, 256, 3, 1, 1): _conv((16, 4, 4), 64, 64, 4, 4),
}


def s2d_channels(c: int) -> int:
    """Channels of the space-to-depth input: the 4 parities x C, padded to a multiple of 16 (3 -> 16)."""
    return cdiv(4 * c, 16) * 16


def s2d_geometry(shape: Shape) -> tuple[Shape, int, int]:
    """A stride-2 conv as a stride-1 conv over the space-to-depth (2x2) input: ``(shape', P, Q)``.

    Input ``z[n, i, j, (b*2 + d)*C + c] = x[n, c, 2i + b, 2j + d]`` (zero past H, W and past 4C), of size
    ``ceil(H/2) x ceil(W/2)``. With ``PZ = ceil(pad/2)`` and ``u = 2*PZ - pad``, input row
    ``2p + r - pad = 2(p + a - PZ) + b`` where ``r + u = 2a + b``: an ``R' = ceil((R + u)/2)`` tap conv with
    padding ``PZ`` whose weight is ``w'[k, (b*2 + d)*C + c, a, e] = w[k, c, 2a + b - u, 2e + d - u]`` (zero
    where that tap is outside ``0..R-1``). The output keeps the original ``P x Q`` (the kernel takes P and Q
    as given; a symmetric pad of PZ could make one more row, which is never computed)."""
    c, h, w, k, r, stride, pad = shape
    pz = (pad + 1) // 2
    u = 2 * pz - pad
    p, q = (h + 2 * pad - r) // 2 + 1, (w + 2 * pad - r) // 2 + 1
    return (s2d_channels(c), cdiv(h, 2), cdiv(w, 2), k, cdiv(r + u, 2), 1, pz), p, q


def space_to_depth(x: torch.Tensor) -> torch.Tensor:
    """``[N, C, H, W]`` -> channels_last ``[N, s2d_channels(C), ceil(H/2), ceil(W/2)]`` (see
    :func:`s2d_geometry`): one copy of the input, which the stem's 16-byte TMA rows need anyway."""
    n, c, h, w = x.shape
    hz, wz = cdiv(h, 2), cdiv(w, 2)
    z = x.new_zeros((n, hz, wz, 2, 2, c))
    z[:, : h - h // 2, :, 0, 0] = x[:, :, 0::2, 0::2].permute(0, 2, 3, 1)
    z[:, : h - h // 2, : w // 2, 0, 1] = x[:, :, 0::2, 1::2].permute(0, 2, 3, 1)
    z[:, : h // 2, :, 1, 0] = x[:, :, 1::2, 0::2].permute(0, 2, 3, 1)
    z[:, : h // 2, : w // 2, 1, 1] = x[:, :, 1::2, 1::2].permute(0, 2, 3, 1)
    out = x.new_zeros((n, hz, wz, s2d_channels(c)))
    out[..., : 4 * c] = z.reshape(n, hz, wz, 4 * c)
    return out.permute(0, 3, 1, 2)


def s2d_weight(weight: torch.Tensor, padding: int) -> torch.Tensor:
    """``[K, C, R, R]`` of a stride-2 conv -> ``[K, s2d_channels(C), R', R']`` of the equivalent stride-1 conv
    over :func:`space_to_depth`'s input (the mapping in :func:`s2d_geometry`)."""
    k, c, r, _ = weight.shape
    u = 2 * ((padding + 1) // 2) - padding
    r2 = cdiv(r + u, 2)
    # pad the taps to 2*R' (u zeros before, the rest after), then split each tap index into (a, b)
    full = weight.new_zeros((k, c, 2 * r2, 2 * r2))
    full[:, :, u : u + r, u : u + r] = weight
    full = full.reshape(k, c, r2, 2, r2, 2).permute(0, 3, 5, 1, 2, 4).reshape(k, 4 * c, r2, r2)
    out = weight.new_zeros((k, s2d_channels(c), r2, r2))
    out[:, : 4 * c] = full
    return out


def fold_columns(z: torch.Tensor, taps: int, pad: int, q: int) -> torch.Tensor:
    """Fold a stride-1 conv's ``taps`` column taps into channels: channels_last ``[N, C, H, W]`` ->
    ``[N, taps*C, H, q]`` with channel ``e*C + c`` at column j holding ``z[..., c, :, j + e - pad]`` (zero
    outside). The ``taps x taps`` conv becomes ``taps x 1`` (no column padding) over ``taps*C`` channels:
    BLOCK_K 64 K steps instead of 16-channel ones (one 16-channel K step costs ~120 SASS instructions for 4
    HGMMA), at the price of an input ``taps`` times larger."""
    n, c, h, w = z.shape
    padded = torch.nn.functional.pad(z, (pad, max(0, q + taps - 1 - pad - w)))
    cols = [padded[..., e : e + q] for e in range(taps)]
    return torch.cat(cols, dim=1).contiguous(memory_format=torch.channels_last)


def fold_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[K, C, R, S]`` -> ``[K, S*C, R, 1]`` with channel ``e*C + c`` = tap column ``e`` of channel ``c``:
    the weight of :func:`fold_columns`' input."""
    k, c, r, taps = weight.shape
    return weight.permute(0, 3, 1, 2).reshape(k, taps * c, r, 1)


@dataclasses.dataclass(frozen=True)
class KernelGeometry:
    """What the kernel runs for a layer: its input (C, H, W), K, an R x S kernel with row/column padding,
    the output P x Q and the ``MODE_*``."""

    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    pad_h: int
    pad_w: int
    p: int
    q: int
    mode: int


def kernel_geometry(shape: Shape) -> KernelGeometry:
    """The layer itself, or for ``MODE_S2D`` layers the space-to-depth conv (:func:`s2d_geometry`) with its
    column taps folded into channels (:func:`fold_columns`): the stem's 7x7/2 over C=3 runs as a 4x1/1 conv
    over 4 x 16 = 64 channels, keeping the original P x Q."""
    c, h, w, k, r, stride, pad = shape
    mode = layer_mode(shape)
    if mode == MODE_S2D:
        (c2, h2, _, _, r2, _, pad2), p, q = s2d_geometry(shape)
        return KernelGeometry(r2 * c2, h2, q, k, r2, 1, pad2, 0, p, q, MODE_CONV)
    p, q = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    return KernelGeometry(c, h, w, k, r, r, pad, pad, p, q, mode)


def layer_mode(shape: Shape) -> int:
    """Which loop a layer shape takes, or raise naming why the TMA kernel cannot run it."""
    c, h, w, k, r, stride, pad = shape
    if (k * 2) % 16:
        raise ValueError(f"TMA needs K a multiple of 8 (16-byte rows), got K={k}")
    if (c * 2) % 16:
        if stride == 2:
            return MODE_S2D
        raise ValueError(f"TMA needs C a multiple of 8 (16-byte rows) below stride 2, got C={c}")
    if r == 1 and stride == 1 and pad == 0:
        return MODE_GEMM
    if stride == 1:
        if (r * r * c * 2) % 16:
            raise ValueError(f"TMA needs R*S*C a multiple of 8 (packed weight rows), got {r * r * c}")
        return MODE_CONV
    if stride == 2:
        if h % 2 or w % 2:
            raise ValueError(f"the stride-2 TMA view needs an even H and W, got {h}x{w}")
        return MODE_CONV_S2
    raise ValueError(f"stride {stride} is not supported by the TMA conv (1 or 2)")


def select_config(shape: Shape) -> HopperConvConfig:
    """The table's config for ``shape``, else a rule: 128x128 tiles (256x64 for K <= 64), BLOCK_K 64 (32
    for C <= 32), 4 stages, 8 warps; a square spatial tile of 128 positions for the conv modes."""
    if shape in CONFIGS:
        return CONFIGS[shape]
    if layer_mode(shape) == MODE_S2D:
        return _conv((1, 16, 16), 64, 64, 4, 4)
    c, _, _, k, _, _, _ = shape
    bk = 32 if c <= 32 else 64
    if layer_mode(shape) == MODE_GEMM:
        return _gemm(256, 64, bk, 4, 8) if k <= 64 else _gemm(128, 128, bk, 4, 8)
    return _conv((1, 8, 16), 64 if k <= 64 else 128, bk, 4, 8)


def check_config(shape: Shape, config: HopperConvConfig) -> None:
    """Raise naming the first rule a config breaks for a shape (tile sizes TMA and wgmma accept)."""
    geometry = kernel_geometry(shape)
    c, mode = geometry.c, geometry.mode
    for name, value in (
        ("block_m", config.block_m),
        ("block_n", config.block_n),
        ("block_k", config.block_k),
    ):
        if value & (value - 1) or value < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if config.block_n > 256 or config.block_k > 128:
        raise ValueError(f"TMA boxes are at most 256 wide: block_n={config.block_n} block_k={config.block_k}")
    if mode != MODE_GEMM and config.tile[0] * config.tile[1] * config.tile[2] != config.block_m:
        raise ValueError(f"tile {config.tile} does not hold block_m={config.block_m} positions")
    if mode == MODE_CONV_S2 and c % config.block_k:
        raise ValueError(
            f"the stride-2 view needs C a multiple of block_k, got C={c} block_k={config.block_k}"
        )


@triton.jit
def _tile_stats(
    acc, valid, part, k0, count_ptr, mean_part_ptr, m2_part_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """One output tile's per-channel (count, mean, M2) of the fp32 accumulator into row ``part`` (its M
    tile) of the ``[parts, K]`` buffers: each slot written by one tile, never read back here (no atomics)."""
    count = tl.sum(valid.to(tl.float32), axis=0)
    mean, m2 = tile_mean_m2(acc, valid[:, None], count)
    cols = k0 + tl.arange(0, BLOCK_N)
    tl.store(mean_part_ptr + part * K + cols, mean, mask=cols < K)
    tl.store(m2_part_ptr + part * K + cols, m2, mask=cols < K)
    tl.store(count_ptr + part, count, mask=k0 == 0)  # a mask, not an `if`: keeps the tile loops fusable


@triton.jit
def _merge_groups_kernel(
    count_ptr,
    mean_part_ptr,
    m2_part_ptr,
    group_count_ptr,
    group_mean_ptr,
    group_m2_ptr,
    K,
    NUM_PARTS,
    SPAN,
    BLOCK_C: tl.constexpr,
):
    """First merge level: program (g, c) folds parts ``[g*SPAN, (g+1)*SPAN)`` of channels block c into one
    (count, mean, M2) row ``g``, part after part in order (Chan): a grid of groups x channel blocks, so a
    64-channel layer still spreads its merge over >= 132 programs, and the order is fixed."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < K
    n = tl.zeros((BLOCK_C,), dtype=tl.float32)
    mean = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for part in range(g * SPAN, tl.minimum(g * SPAN + SPAN, NUM_PARTS)):
        n_b = tl.load(count_ptr + part)
        mean_b = tl.load(mean_part_ptr + part * K + cols, mask=mask, other=0.0)
        m2_b = tl.load(m2_part_ptr + part * K + cols, mask=mask, other=0.0)
        n, mean, m2 = chan_merge(n, mean, m2, n_b, mean_b, m2_b)
    tl.store(group_mean_ptr + g * K + cols, mean, mask=mask)
    tl.store(group_m2_ptr + g * K + cols, m2, mask=mask)
    if tl.program_id(1) == 0:
        tl.store(group_count_ptr + g, tl.max(n, axis=0))


#: The first merge level's minimum grid: one wave of an H100/H200 (issue 38).
MERGE_MIN_PROGRAMS = 132


_MERGE_BLOCK_C = 64


def merge_grid(parts: int, channels: int) -> tuple[int, int, int]:
    """``(groups, channel blocks, parts a group)`` of the first merge level: groups x channel blocks >=
    :data:`MERGE_MIN_PROGRAMS` wherever there are enough parts."""
    channel_blocks = cdiv(channels, _MERGE_BLOCK_C)
    groups = max(1, min(parts, cdiv(MERGE_MIN_PROGRAMS, channel_blocks)))
    span = max(1, parts // groups)  # rounded down: cdiv(parts, span) >= groups
    return cdiv(parts, span), channel_blocks, span


def merge_stats(
    counts: torch.Tensor, mean_parts: torch.Tensor, m2_parts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, biased variance) from per-tile summaries, in two fixed-order levels: groups of
    parts over a grid of >= :data:`MERGE_MIN_PROGRAMS` programs (where there are that many parts), then
    :func:`lcv_kernels._triton.merge_channel_stats` over the groups. Bit-identical from run to run."""
    parts, channels = mean_parts.shape
    groups, channel_blocks, span = merge_grid(parts, channels)
    group_count = torch.empty(groups, device=counts.device, dtype=torch.float32)
    group_mean = torch.empty(groups, channels, device=counts.device, dtype=torch.float32)
    group_m2 = torch.empty(groups, channels, device=counts.device, dtype=torch.float32)
    _merge_groups_kernel[(groups, channel_blocks)](
        counts,
        mean_parts,
        m2_parts,
        group_count,
        group_mean,
        group_m2,
        channels,
        parts,
        span,
        BLOCK_C=_MERGE_BLOCK_C,
    )
    return merge_channel_stats(group_count, group_mean, group_m2)


@triton.jit
def _bn_relu(a, scale, shift, ASM: tl.constexpr):
    """``relu(a * scale + shift)`` on a ``[M, C]`` fp16/bf16 tile with per-column scale/shift in its dtype.
    Compiled (``ASM``): one packed ``fma.rn.relu`` a pair of elements (Triton's own ops widen 16-bit
    arithmetic to fp32 and convert back: 3x the instructions, 182 per 8 HGMMA on the 64-channel 1x1).
    The interpreter cannot run inline PTX and takes the plain ops (fp32 math, one rounding)."""
    if ASM:
        sc = tl.broadcast_to(scale[None, :], a.shape)
        sh = tl.broadcast_to(shift[None, :], a.shape)
        if a.dtype == tl.bfloat16:
            out = tl.inline_asm_elementwise(
                "fma.rn.relu.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, sc, sh], dtype=tl.bfloat16,
                is_pure=True, pack=2,
            )  # fmt: skip
        else:
            out = tl.inline_asm_elementwise(
                "fma.rn.relu.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, sc, sh], dtype=tl.float16,
                is_pure=True, pack=2,
            )  # fmt: skip
    else:
        out = tl.maximum(a.to(tl.float32) * scale[None, :] + shift[None, :], 0.0).to(a.dtype)
    return out


@triton.jit
def _conv_hopper_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    count_ptr,
    mean_part_ptr,
    m2_part_ptr,
    ss_ptr,
    N,
    H: tl.constexpr,
    W: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    S: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    P: tl.constexpr,
    Q: tl.constexpr,
    MODE: tl.constexpr,
    TN: tl.constexpr,
    TH: tl.constexpr,
    TW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr,
    STATS: tl.constexpr,
    PROLOGUE: tl.constexpr = False,
    ASM_PROLOGUE: tl.constexpr = False,
):
    KC: tl.constexpr = (C + BLOCK_K - 1) // BLOCK_K  # channel blocks a tap
    K_STEPS: tl.constexpr = R * S * KC
    N_TILES: tl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
    # Output tiles: M tiles (images x rows x columns blocks) by N tiles, N fastest (neighbours share the
    # input tile in L2).
    if MODE == 0:  # MODE_GEMM
        m = N * H * W
        x_desc = tl.make_tensor_descriptor(
            x_ptr, shape=[m, C], strides=[C, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        y_desc = tl.make_tensor_descriptor(
            y_ptr, shape=[m, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_N]
        )
        m_tiles = tl.cdiv(m, BLOCK_M)
    elif MODE == 1:  # MODE_CONV
        x_desc = tl.make_tensor_descriptor(
            x_ptr, shape=[N, H, W, C], strides=[H * W * C, W * C, C, 1], block_shape=[TN, TH, TW, BLOCK_K]
        )
        y_desc = tl.make_tensor_descriptor(
            y_ptr, shape=[N, P, Q, K], strides=[P * Q * K, Q * K, K, 1], block_shape=[TN, TH, TW, BLOCK_N]
        )
        m_tiles = tl.cdiv(N, TN) * ((P + TH - 1) // TH) * ((Q + TW - 1) // TW)
    else:
        # [N, H/2, row parity, W/2, column parity * C + c]: stride 2 as coordinates.
        x_desc = tl.make_tensor_descriptor(
            x_ptr,
            shape=[N, H // 2, 2, W // 2, 2 * C],
            strides=[H * W * C, 2 * W * C, W * C, 2 * C, 1],
            block_shape=[TN, TH, 1, TW, BLOCK_K],
        )
        y_desc = tl.make_tensor_descriptor(
            y_ptr, shape=[N, P, Q, K], strides=[P * Q * K, Q * K, K, 1], block_shape=[TN, TH, TW, BLOCK_N]
        )
        m_tiles = tl.cdiv(N, TN) * ((P + TH - 1) // TH) * ((Q + TW - 1) // TW)
    w_desc = tl.make_tensor_descriptor(
        w_ptr, shape=[K, R * S * C], strides=[R * S * C, 1], block_shape=[BLOCK_N, BLOCK_K]
    )
    if PROLOGUE:  # the [2, C] (scale; shift) of the input's BN + ReLU, in the input dtype
        ss_desc = tl.make_tensor_descriptor(ss_ptr, shape=[2, C], strides=[C, 1], block_shape=[2, BLOCK_K])
    num_tiles = m_tiles * N_TILES
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True, num_stages=STAGES):
        tile_m = tile // N_TILES
        k0 = (tile - tile_m * N_TILES) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if MODE == 0:
            m0 = tile_m * BLOCK_M
            for kk in range(K_STEPS):
                a = x_desc.load([m0, kk * BLOCK_K])
                if PROLOGUE:
                    # the previous BN + ReLU on the loaded tile: relu(x * scale + shift) per input channel,
                    # in the input dtype (packed 2-wide FMA/max: half the instructions of fp32 math).
                    # scale/shift come through TMA too ([2, C]): channels past C read 0, so they stay
                    # 0; rows past M become relu(shift), but the store clips them and the stats mask them.
                    sc, sh = tl.split(ss_desc.load([0, kk * BLOCK_K]).permute(1, 0))
                    a = _bn_relu(a, sc, sh, ASM_PROLOGUE)
                b = w_desc.load([k0, kk * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            y_desc.store([m0, k0], acc.to(y_desc.dtype))
            if STATS:
                valid = (m0 + tl.arange(0, BLOCK_M)) < m
                _tile_stats(acc, valid, tile_m, k0, count_ptr, mean_part_ptr, m2_part_ptr, K, BLOCK_N)
        else:
            q_tiles: tl.constexpr = (Q + TW - 1) // TW
            p_tiles: tl.constexpr = (P + TH - 1) // TH
            n0 = tile_m // (p_tiles * q_tiles)
            rest = tile_m - n0 * (p_tiles * q_tiles)
            p0 = (rest // q_tiles) * TH
            q0 = (rest - (rest // q_tiles) * q_tiles) * TW
            n0 = n0 * TN
            for kk in range(K_STEPS):
                tap = kk // KC
                c0 = (kk - tap * KC) * BLOCK_K
                r = tap // S
                s = tap - r * S
                if MODE == 1:
                    a = x_desc.load([n0, p0 + r - PAD_H, q0 + s - PAD_W, c0])
                else:
                    # input row 2*p + r - PAD_H = 2*(p + half) + parity; offsets kept non-negative for //.
                    OFF_H: tl.constexpr = 2 * ((PAD_H + 1) // 2)
                    OFF_W: tl.constexpr = 2 * ((PAD_W + 1) // 2)
                    eh = r - PAD_H + OFF_H
                    ew = s - PAD_W + OFF_W
                    a = x_desc.load(
                        [n0, p0 + eh // 2 - OFF_H // 2, eh % 2, q0 + ew // 2 - OFF_W // 2, (ew % 2) * C + c0]
                    )
                b = w_desc.load([k0, tap * C + c0])
                acc = tl.dot(a.reshape(BLOCK_M, BLOCK_K), b.T, acc)
            y_desc.store([n0, p0, q0, k0], acc.to(y_desc.dtype).reshape(TN, TH, TW, BLOCK_N))
            if STATS:
                pos = tl.arange(0, BLOCK_M)
                valid = (n0 + pos // (TH * TW) < N) & (p0 + (pos // TW) % TH < P) & (q0 + pos % TW < Q)
                _tile_stats(acc, valid, tile_m, k0, count_ptr, mean_part_ptr, m2_part_ptr, K, BLOCK_N)


#: Packed weights by ``id`` of the weight tensor: (a weak reference to it, its version, the packing). The
#: reference guards against a new tensor reusing a freed one's id or memory with the same version count.
_PACKED: dict[tuple[int, int | None], tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def pack_weight(weight: torch.Tensor, s2d_padding: int | None = None) -> torch.Tensor:
    """``[K, C, R, S]`` -> ``[K, R*S*C]`` (tap-major K dimension, channels contiguous), cached per weight
    tensor and version (an optimizer step bumps it) so a training step packs once, not once a call. With
    ``s2d_padding`` the weight is first rewritten for the space-to-depth input (:func:`s2d_weight`, then
    :func:`fold_weight`)."""
    key = (id(weight), s2d_padding)
    entry = _PACKED.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        return entry[2]
    source = weight.detach()
    if s2d_padding is not None:
        source = fold_weight(s2d_weight(source, s2d_padding))
    packed = source.permute(0, 2, 3, 1).reshape(source.shape[0], -1).contiguous()
    for dead in [dead for dead, (ref, _, _) in _PACKED.items() if ref() is None]:
        del _PACKED[dead]
    _PACKED[key] = (weakref.ref(weight), weight._version, packed)
    return packed


def _allocate_scratch(size: int, alignment: int, stream: Any) -> torch.Tensor:
    """Global memory for device-side tensor descriptors (Triton asks for it at launch)."""
    return torch.empty(size, dtype=torch.int8, device=_SCRATCH_DEVICE[0])


_SCRATCH_DEVICE: list[torch.device] = [torch.device("cpu")]


def conv_hopper(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: int = 1,
    padding: int = 0,
    config: HopperConvConfig | None = None,
    num_programs: int = HOPPER_SMS,
    prologue: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``conv2d(x, weight, stride=stride, padding=padding)`` (no bias, square kernel, groups 1) for a
    channels_last ``x``; returns a channels_last tensor. ``config`` defaults to :func:`select_config`.
    ``prologue=(scale, shift)`` (per input channel, fp32) convolves ``relu(x * scale + shift)`` instead:
    the previous BatchNorm's normalisation and ReLU applied to each loaded tile (1x1 stride-1 convs only;
    elsewhere the zero padding would not stay zero)."""
    return _launch(x, weight, stride, padding, config, num_programs, stats=False, prologue=prologue)[0]


def conv_hopper_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: int = 1,
    padding: int = 0,
    config: HopperConvConfig | None = None,
    num_programs: int = HOPPER_SMS,
    prologue: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`conv_hopper` plus the per-channel mean and biased variance of its fp32 result (what a
    training BatchNorm normalises with), from the epilogue's per-tile summaries: ``(y, mean, var)``. With
    ``prologue`` this is one link of a conv -> BN -> ReLU -> conv chain: one read of x, one write of y."""
    y, parts = _launch(x, weight, stride, padding, config, num_programs, stats=True, prologue=prologue)
    assert parts is not None
    mean, var = merge_stats(*parts)
    return y, mean, var


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: int,
    padding: int,
    config: HopperConvConfig | None,
    num_programs: int,
    stats: bool,
    prologue: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Check, allocate and launch; with ``stats`` also return the ``(counts, mean_parts, m2_parts)``
    buffers (one row per M tile)."""
    if (
        x.dim() != 4
        or weight.dim() != 4
        or weight.shape[1] != x.shape[1]
        or weight.shape[2] != weight.shape[3]
    ):
        raise ValueError(
            f"need x [N,C,H,W] and a square weight [K,C,R,R], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if not x.is_contiguous(memory_format=torch.channels_last):
        raise ValueError("x must be channels_last (NHWC in memory)")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} vs {weight.dtype}")
    n, c, h, w = x.shape
    k, _, r, _ = weight.shape
    shape = (c, h, w, k, r, stride, padding)
    config = config or select_config(shape)
    check_config(shape, config)
    g = kernel_geometry(shape)
    mode, p, q = g.mode, g.p, g.q
    if prologue is not None:
        if mode != MODE_GEMM:
            raise ValueError("the BN+ReLU prologue runs on 1x1 stride-1 convs only (padding must stay zero)")
        if any(t.shape != (c,) or t.dtype != torch.float32 or t.device != x.device for t in prologue):
            raise ValueError(f"prologue scale and shift must be fp32 [C={c}] on {x.device}")
        scale_shift = torch.stack(prologue).to(x.dtype)  # rounded once here, not per tile
    if layer_mode(shape) == MODE_S2D:
        packed = pack_weight(weight, s2d_padding=padding)
        x = fold_columns(space_to_depth(x), g.r, g.pad_h, q)  # square: the column padding is the row's
    else:
        packed = pack_weight(weight)
    y = torch.empty((n, k, p, q), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    _SCRATCH_DEVICE[0] = x.device
    triton.set_allocator(_allocate_scratch)
    tn, th, tw = config.tile
    m_tiles = cdiv(n, tn) * cdiv(p, th) * cdiv(q, tw)
    if mode == MODE_GEMM:
        m_tiles = cdiv(n * g.h * g.w, config.block_m)
    grid = (max(1, min(num_programs, m_tiles * cdiv(k, config.block_n))),)
    parts = None
    if stats:
        parts = (
            torch.empty(m_tiles, device=x.device, dtype=torch.float32),
            torch.empty(m_tiles, k, device=x.device, dtype=torch.float32),
            torch.empty(m_tiles, k, device=x.device, dtype=torch.float32),
        )
    dummy = parts[0] if parts else y
    _conv_hopper_kernel[grid](
        x,
        packed,
        y,
        *(parts or (dummy, dummy, dummy)),
        scale_shift if prologue is not None else dummy,
        n,
        H=g.h,
        W=g.w,
        C=g.c,
        K=k,
        R=g.r,
        S=g.s,
        PAD_H=g.pad_h,
        PAD_W=g.pad_w,
        P=p,
        Q=q,
        MODE=mode,
        TN=tn,
        TH=th,
        TW=tw,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_PROGRAMS=grid[0],
        STAGES=config.num_stages,
        STATS=stats,
        PROLOGUE=prologue is not None,
        ASM_PROLOGUE=not interpreter_enabled(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y, parts
