"""Numerical tolerances for comparing kernels with their references, in one place.

Keyed by (op family, dtype). fp32 is tight because the Triton interpreter and the
references both accumulate in fp32; half types are loose because their outputs are
rounded to 8 (bf16) or 11 (fp16) mantissa bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # (family, dtype): (atol, rtol)
    ("conv", torch.float32): (1e-4, 1e-4),
    ("conv", torch.float16): (1e-2, 1e-2),
    ("conv", torch.bfloat16): (5e-2, 5e-2),
    ("norm", torch.float32): (1e-4, 1e-4),
    ("norm", torch.float16): (1e-2, 1e-2),
    ("norm", torch.bfloat16): (5e-2, 5e-2),
    # Gradients vs float64 autograd: backward chains two or three reductions (over N·H·W and over C·R·S),
    # so ten times the forward tolerance. Sums over many elements scale atol further at the call site.
    ("conv_grad", torch.float32): (1e-3, 1e-3),
    ("norm_grad", torch.float32): (1e-3, 1e-3),
    # Half-type gradients, fused vs eager autograd in the same dtype (the kernel selection's check, bounded by
    # the largest reference value): both sides are rounded to 8 or 11 bits, so twice the forward tolerance.
    ("conv_grad", torch.float16): (2e-2, 2e-2),
    ("conv_grad", torch.bfloat16): (1e-1, 1e-1),
    ("norm_grad", torch.float16): (2e-2, 2e-2),
    ("norm_grad", torch.bfloat16): (1e-1, 1e-1),
    # Optimizer steps (fused vs eager, compiled vs eager, resumed, DDP): trajectory_tolerance below, from the
    # network's length and the number of steps (a fixed entry here was fitted to one CPU's ~1e-7).
}


def tolerance(family: str, dtype: torch.dtype) -> tuple[float, float]:
    """Return ``(atol, rtol)`` for an op family and dtype, or raise naming the missing key."""
    try:
        return TOLERANCES[(family, dtype)]
    except KeyError:
        known = sorted({f for f, _ in TOLERANCES})
        raise KeyError(f"no tolerance for family={family!r} dtype={dtype}; families: {known}") from None


#: Headroom over the typical rounding error of a sum (its standard deviation): two implementations differ by
#: two independent errors, and the largest of many outputs sits a few deviations out.
REDUCTION_SAFETY = 8.0


def reduction_tolerance(
    dtype: torch.dtype, length: int, accumulation: torch.dtype = torch.float32
) -> tuple[float, float]:
    """``(atol, rtol)`` for two computations of values that each sum ``length`` terms, from the dtypes alone.

    Why this form: a sum of ``K`` terms accumulated in ``accumulation`` picks up one rounding of relative size
    ``eps(accumulation)`` per addition. Their signs vary, so the error grows like ``sqrt(K)`` (a random walk;
    the worst case ``K * eps`` is far too loose for large K), and its scale is the sum's magnitude, so it is
    used relative to ``max|reference|`` (the bound ``atol + rtol * max|reference|``; atol covers outputs near
    zero). Two CPUs (AVX2's 8 lanes against AVX-512's 16) or two kernels add in another order, so their
    results differ by about that much, not by what one machine happened to show. Outputs stored in a
    narrower ``dtype`` add one rounding of ``eps(dtype)`` on each side. Nothing here was measured: a table
    entry fitted to one CPU's results is what failed on another.
    """
    if length < 1:
        raise ValueError(f"length must be a positive number of summed terms, got {length}")
    acc = accumulation if torch.finfo(accumulation).eps <= torch.finfo(dtype).eps else dtype
    rounding = 2 * torch.finfo(dtype).eps if dtype != acc else 0.0
    tol = rounding + REDUCTION_SAFETY * torch.finfo(acc).eps * math.sqrt(length)
    return tol, tol


def bound(tolerance: tuple[float, float], reference: torch.Tensor) -> float:
    """The absolute bound ``atol + rtol * max|reference|`` that a ``reduction_tolerance`` pair means.

    Why max and not elementwise: a sum's rounding scales with the sum's magnitude (with its terms', really),
    so an output that cancels to near zero carries the error of its large neighbours."""
    atol, rtol = tolerance
    return atol + rtol * float(reference.detach().abs().max()) if reference.numel() else atol


def trajectory_tolerance(dtype: torch.dtype, length: int, steps: int) -> tuple[float, float]:
    """``(atol, rtol)`` for weights (or losses) after ``steps`` optimizer steps computed two ways.

    Why this form: each step's gradients are sums of up to ``length`` terms (a weight gradient sums over
    the batch's N·H·W), so each carries :func:`reduction_tolerance`'s error; the step moves the weights by
    less than their own size (a stable run), so that error lands in the weights at most at their scale,
    and every later step starts from the perturbed weights, so the errors of the steps add up (linearly:
    one step's error is carried, not averaged, by the next). Relative to ``max|reference|`` like
    :func:`reduction_tolerance`. Assumes a handful of steps of a tiny model; a long run diverges
    chaotically and needs a statistical check instead.
    """
    if steps < 1:
        raise ValueError(f"steps must be a positive number of optimizer steps, got {steps}")
    atol, rtol = reduction_tolerance(dtype, length)
    return steps * atol, steps * rtol


_SUMMING = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def network_length(network: nn.Module, batch_shape: Sequence[int]) -> int:
    """An upper bound on the terms summed along one value's path through ``network``, forward and backward,
    for :func:`reduction_tolerance` and :func:`trajectory_tolerance`.

    Why this sum: as far as rounding goes, a chain of sums is one long sum (each layer's error is carried
    into the next at the next's scale). Forward, a conv or linear sums its fan-in; a norm layer's
    statistics sum over at most the batch's ``N*H*W`` positions; backward, each weight gradient sums over
    those positions too. ``batch_shape`` is the input's ``(N, C, *spatial)``.
    """
    if len(batch_shape) < 2:
        raise ValueError(f"batch_shape must be (N, C, ...), got {tuple(batch_shape)}")
    positions = math.prod(batch_shape) // batch_shape[1]
    total = 0
    for module in network.modules():
        if isinstance(module, _SUMMING):
            total += module.weight[0].numel() + positions
        elif isinstance(module, _NORMS):
            total += positions
    return max(total, 1)


#: One level of an 8-bit image, in [0, 1] units.
UINT8_STEP = 1.0 / 255.0


def image_tolerance(
    length: int, *, scale: float = 1.0, gain: float = 1.0, dtype: torch.dtype = torch.float32
) -> float:
    """Absolute tolerance for two float computations of the same image ops (another kernel, a compiled
    graph, another library's formula of the same arithmetic).

    ``length``: the terms behind one output, along the chain: a resample's taps (per axis, added), a
    contrast mean's ``H*W`` pixels, one per elementwise step (a blend, a multiply, the hue round trip's
    few operations). ``scale``: the largest value (1 for [0, 1] images, 255 for levels). ``gain``: how much
    the later steps magnify an error (the product of the blend factors above 1, ``1/std`` of a Normalize
    after them). Why: each step rounds relative to its values' magnitude, so the error is
    :func:`reduction_tolerance` of the whole chain at the image's scale, times what later steps amplify.
    """
    atol, rtol = reduction_tolerance(dtype, length)
    return gain * (atol + rtol * scale)


def resample_tolerance(
    taps: int, size: int, *, scale: float = 1.0, gain: float = 1.0, dtype: torch.dtype = torch.float32
) -> float:
    """:func:`image_tolerance` of ``taps`` terms plus the rounding of where each output samples its input.

    Why: two resamplers that compute the source position differently (half-pixel centres, a round trip
    through grid_sample's [-1, 1]) round a position of up to ``size`` pixels relative to ``size``, and an
    edge from 0 to full ``scale`` in one pixel turns that shift of the position into a change of the
    value by ``scale`` per pixel."""
    position = REDUCTION_SAFETY * torch.finfo(dtype).eps * size
    return image_tolerance(taps, scale=scale, gain=gain, dtype=dtype) + gain * position * scale


def uint8_tolerance(
    steps: float, length: int, *, scale: float = 1.0, gain: float = 1.0, dtype: torch.dtype = torch.float32
) -> float:
    """:func:`image_tolerance` plus ``steps`` levels of 8-bit quantisation, at ``scale`` (1/255 in [0, 1]).

    Why: a reference that rounds its output to uint8 (PIL, OpenCV's integer paths, a JPEG decoder) is
    half a level from the exact value (``steps=0.5``); one that truncates, or rounds an intermediate
    image too, is up to a whole level per rounding. Those levels are exact facts of the reference's
    arithmetic, not rounding noise, so they add to the float tolerance."""
    return steps * scale * UINT8_STEP + image_tolerance(length, scale=scale, gain=gain, dtype=dtype)
