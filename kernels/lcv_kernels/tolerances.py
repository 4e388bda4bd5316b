"""Numerical tolerances for comparing kernels with their references, in one place.

Keyed by (op family, dtype). fp32 is tight because the Triton interpreter and the
references both accumulate in fp32; half types are loose because their outputs are
rounded to 8 (bf16) or 11 (fp16) mantissa bits.
"""

from __future__ import annotations

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
