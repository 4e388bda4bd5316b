"""Numerical tolerances for comparing kernels with their references, in one place.

Keyed by (op family, dtype). fp32 is tight because the Triton interpreter and the
references both accumulate in fp32; half types are loose because their outputs are
rounded to 8 (bf16) or 11 (fp16) mantissa bits.
"""

from __future__ import annotations

import math

import torch

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
    # A few optimizer steps of a tiny model, fused vs eager, fp32: reductions in a different order change
    # last bits, which the steps then amplify. Measured differences are ~1e-7 on the test models.
    ("train", torch.float32): (1e-5, 1e-5),
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
