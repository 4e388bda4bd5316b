"""Triton, and the device code the conv and norm kernels share: activations, row offsets, channel statistics.

Triton ships with PyTorch's Linux wheels only. Where it is missing, ``triton``/``tl`` are stand-ins that let
the op modules define their kernels and raise on a launch; every op then runs its PyTorch reference
(``lcv_kernels._common.use_triton`` is False), so nothing is lost on such a machine but speed.

Channel statistics (conv → BatchNorm, BatchNorm's own pass) never use ``E[z²] - E[z]²`` and never atomics:
each tile writes its row count, mean and ``M2 = Σ(z - mean)²`` per channel to a ``[parts, C]`` buffer, and
:func:`merge_channel_stats` combines them in a fixed order (Chan et al.'s pairwise update), so the variance is
as accurate at a mean of 1000 as at 0 and the result is bit-identical from run to run. The tiles summarise
values minus a per-channel shift (the conv bias, BatchNorm's first value of the channel) that is added back
once, so the mean keeps fp32's resolution of the spread, not of the offset.
"""

from __future__ import annotations

from typing import Any

import torch

from lcv_kernels._common import cdiv, launch_context, next_power_of_2

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover - exercised in a subprocess by the tests
    TRITON_IMPORT_ERROR = _err

    class _NoTritonKernel:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}); cannot launch {self.fn}")

    class _NoTriton:
        """Enough of ``triton``'s module surface to define (not run) kernels."""

        @staticmethod
        def jit(fn: Any = None, **_kwargs: Any) -> Any:
            return _NoTritonKernel(fn) if fn is not None else _NoTritonKernel

        @staticmethod
        def autotune(*_args: Any, **_kwargs: Any) -> Any:
            return lambda kernel: kernel

        class Config:
            def __init__(self, kwargs: dict, num_warps: int = 4, num_stages: int = 2, **_: Any) -> None:
                self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages

        cdiv = staticmethod(cdiv)
        next_power_of_2 = staticmethod(next_power_of_2)

    triton = _NoTriton()
    tl = None  # only used inside kernel bodies and (string) annotations

__all__ = [
    "TRITON_IMPORT_ERROR",
    "activate",
    "activation_grad",
    "chan_merge",
    "grad_through_epilogue",
    "load_channel_vector",
    "merge_channel_stats",
    "row_offsets",
    "tile_mean_m2",
    "tl",
    "triton",
]


@triton.jit
def activate(u, ACTIVATION: tl.constexpr):
    """The epilogue activation; codes follow ``lcv_kernels._common.ACTIVATIONS`` (GELU is the exact erf form)."""
    if ACTIVATION == 1:
        u = tl.maximum(u, 0.0)
    elif ACTIVATION == 2:
        u = 0.5 * u * (1.0 + tl.erf(u * 0.7071067811865476))
    elif ACTIVATION == 3:
        u = u / (1.0 + tl.exp(-u))
    return u


@triton.jit
def activation_grad(g, u, ACTIVATION: tl.constexpr):
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
def load_channel_vector(ptr, cols, mask, PRESENT: tl.constexpr, ABSENT: tl.constexpr):
    """A per-channel vector as fp32, or the constant ``ABSENT`` where the operand is missing (1 for γ, 0 for
    β)."""
    if PRESENT:
        v = tl.load(ptr + cols, mask=mask, other=ABSENT).to(tl.float32)
    else:
        v = tl.zeros(cols.shape, dtype=tl.float32) + ABSENT
    return v


@triton.jit
def grad_through_epilogue(
    g, xn, scale, bias, res_ptr, res_offs, mask, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr
):
    """``g·act'(u)`` for a norm's epilogue ``u = xn·scale + bias (+ residual)``, ``u`` recomputed from the
    normalised input (never stored); the identity without an activation (the branch compiles out)."""
    if ACTIVATION != 0:
        u = xn * scale + bias
        if HAS_RESIDUAL:
            u += tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
        g = activation_grad(g, u, ACTIVATION)
    return g


@triton.jit
def row_offsets(rows, HW, s_n, s_hw):
    """Offset of row ``m = n·HW + hw`` of an (N, C, H, W) tensor seen as N·H·W rows of C channels: only the
    row part; the caller adds ``c · s_c``."""
    n = rows // HW
    return n * s_n + (rows - n * HW) * s_hw


@triton.jit
def tile_mean_m2(z, valid, count):
    """Per column of a [ROWS, COLS] fp32 tile: the mean and ``M2 = Σ(z - mean)²`` over the ``valid`` rows
    (``count`` of them, > 0). Centred in registers with the corrected two-pass formula: the deviations from a
    first mean also correct that mean's rounding (``Σd``), so a mean of 1000 costs no accuracy."""
    first = tl.sum(tl.where(valid, z, 0.0), axis=0) / count
    d = tl.where(valid, z - first[None, :], 0.0)
    d_sum = tl.sum(d, axis=0)
    return first + d_sum / count, tl.sum(d * d, axis=0) - d_sum * d_sum / count


@triton.jit
def chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Combine two (count, mean, M2) summaries (Chan, Golub & LeVeque); an empty side changes nothing."""
    n = n_a + n_b
    w_b = n_b / tl.maximum(n, 1.0)
    delta = mean_b - mean_a
    return n, mean_a + delta * w_b, m2_a + m2_b + delta * delta * n_a * w_b


@triton.jit
def _merge_channel_stats_kernel(
    # pointers
    count_ptr,
    mean_parts_ptr,
    m2_parts_ptr,
    shift_ptr,
    mean_ptr,
    var_ptr,
    # sizes
    C,
    NUM_PARTS,
    # meta
    HAS_SHIFT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per channel: merge ``NUM_PARTS`` (count, mean, M2) rows into the mean and the biased variance.

    A block of ``BLOCK_P`` parts is combined at once (count-weighted mean, then the centred spread of the
    part means); blocks are merged one after another (Chan). Both orders are fixed: deterministic.
    """
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = cols < C
    n = tl.zeros((BLOCK_C,), dtype=tl.float32)
    mean = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p0 in range(0, NUM_PARTS, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        counts = tl.load(count_ptr + parts, mask=parts < NUM_PARTS, other=0.0)
        used = (counts > 0.0)[:, None] & mask_c[None, :]
        offs = parts[:, None] * C + cols[None, :]
        part_mean = tl.where(used, tl.load(mean_parts_ptr + offs, mask=used, other=0.0), 0.0)
        part_m2 = tl.where(used, tl.load(m2_parts_ptr + offs, mask=used, other=0.0), 0.0)
        n_b = tl.sum(counts, axis=0)
        # Weight the parts' deviations from their plain average, not the means themselves: products of counts
        # and means of 1000 would round away the spread.
        ref = tl.sum(part_mean, axis=0) / tl.maximum(tl.sum(used.to(tl.float32), axis=0), 1.0)
        deviation = tl.where(used, part_mean - ref[None, :], 0.0)
        mean_b = ref + tl.sum(deviation * counts[:, None], axis=0) / tl.maximum(n_b, 1.0)
        spread = tl.where(used, part_mean - mean_b[None, :], 0.0)
        m2_b = tl.sum(part_m2 + spread * spread * counts[:, None], axis=0)
        n, mean, m2 = chan_merge(n, mean, m2, n_b, mean_b, m2_b)
    if HAS_SHIFT:  # the parts summarise x - shift: add it back once, at the end
        mean += tl.load(shift_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(mean_ptr + cols, mean, mask=mask_c)
    tl.store(var_ptr + cols, m2 / tl.maximum(n, 1.0), mask=mask_c)


def merge_channel_stats(
    counts: torch.Tensor, mean_parts: torch.Tensor, m2_parts: torch.Tensor, shift: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, biased variance)`` (fp32, ``[C]``) from per-part summaries: ``counts[P]`` rows
    in each part (0 for a part that was never written), ``mean_parts`` and ``m2_parts`` of shape ``[P, C]``.

    ``shift`` (a dense ``[C]`` vector) says the parts summarise ``x - shift``: every partial mean then stays
    near 0, where fp32 is finest, and the shift is added back once.
    """
    parts, channels = mean_parts.shape
    mean = torch.empty(channels, device=mean_parts.device, dtype=torch.float32)
    var = torch.empty(channels, device=mean_parts.device, dtype=torch.float32)
    block_c = min(64, triton.next_power_of_2(max(channels, 1)))
    block_p = max(1, min(128, 4096 // block_c, triton.next_power_of_2(max(parts, 1))))
    with launch_context(mean_parts):
        _merge_channel_stats_kernel[(triton.cdiv(channels, block_c),)](
            counts,
            mean_parts,
            m2_parts,
            shift if shift is not None else mean,
            mean,
            var,
            channels,
            parts,
            HAS_SHIFT=shift is not None,
            BLOCK_P=block_p,
            BLOCK_C=block_c,
        )
    return mean, var
