"""Plain-PyTorch reference of the fused convolution, and the argument checks shared by every path.

The reference defines the semantics the Triton kernel must match (see :func:`conv2d_fused_reference`),
and it is also what the registered op runs on a CPU without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels._common import ACTIVATIONS, apply_activation, check_dtype


def pair(value: int | Sequence[int], name: str) -> list[int]:
    """Normalise an int or a pair of ints to ``[h, w]``; raise naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return [value, value]
    if isinstance(value, str):
        raise ValueError(f"{name}={value!r}: string padding is not supported; pass integers")  # noqa: TRY004
    values = list(value)
    if len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    return values


def conv2d_output_hw(
    h: int, w: int, r: int, s: int, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> tuple[int, int]:
    """Output height and width of a 2-D convolution (PyTorch's formula, floor division)."""
    p = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    q = (w + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    return p, q


def check_conv2d_fused_args(
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
    """Validate the fused conv's arguments with messages that name the problem; return ``(N, K, P, Q)``."""
    if x.dim() != 4:
        raise ValueError(
            f"x must be a 4-D NHWC tensor (N, C, H, W) in channels_last memory format, got shape {tuple(x.shape)}"
        )
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D (C_out, C_in, kH, kW), got shape {tuple(weight.shape)}")
    check_dtype(x, "x")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} does not match x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if not x.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(
            "x must be in channels_last (NHWC) memory format; "
            "call x.contiguous(memory_format=torch.channels_last) first"
        )
    n, c, h, w = x.shape
    k, c_w, r, s = weight.shape
    if c_w != c:
        raise ValueError(
            f"mismatched channels: x has {c} input channels but weight expects {c_w} (weight shape {tuple(weight.shape)}); "
            "grouped convolution is not supported by the fused op"
        )
    if len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        raise ValueError(
            f"stride, padding and dilation must have 2 entries, got {stride}, {padding}, {dilation}"
        )
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError(
            f"need stride >= 1, dilation >= 1, padding >= 0; got {stride}, {dilation}, {padding}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    p, q = conv2d_output_hw(h, w, r, s, stride, padding, dilation)
    if p <= 0 or q <= 0:
        raise ValueError(
            f"output would be empty ({p}x{q}) for a {h}x{w} input, {r}x{s} kernel, "
            f"stride={list(stride)}, padding={list(padding)}, dilation={list(dilation)}"
        )
    for name, vec in (("bias", bias), ("scale", scale), ("shift", shift)):
        if vec is None:
            continue
        if vec.dim() != 1 or vec.shape[0] != k:
            raise ValueError(
                f"{name} must be a 1-D tensor with one entry per output channel ({k}), got shape {tuple(vec.shape)}"
            )
        check_dtype(vec, name)
        if vec.device != x.device:
            raise ValueError(f"{name} is on {vec.device} but x is on {x.device}")
    if residual is not None:
        if tuple(residual.shape) != (n, k, p, q):
            raise ValueError(
                f"residual must have the output's shape {(n, k, p, q)}, got {tuple(residual.shape)}"
            )
        check_dtype(residual, "residual")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")
    return n, k, p, q


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every kernel dtype; float64 stays float64 (used only by the reference path, e.g. gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def epilogue_reference(
    z: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """``act(z * scale + shift + residual)`` in fp32 (or z's dtype if wider), per-channel over dim 1."""
    acc = accumulation_dtype(z.dtype)
    u = z.to(acc)
    if scale is not None:
        u = u * scale.to(acc).view(1, -1, 1, 1)
    if shift is not None:
        u = u + shift.to(acc).view(1, -1, 1, 1)
    if residual is not None:
        u = u + residual.to(acc)
    return apply_activation(u, activation)


def conv2d_fused_reference(
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reference semantics of the fused op, differentiable by plain autograd.

    With ``z = conv2d(x, weight) + bias`` (computed in fp32):

    * ``y = act(z * scale + shift + residual)``, cast to ``x.dtype``, channels_last;
    * if ``stats``: ``sum[k] = Σ_{n,h,w} z`` and ``sumsq[k] = Σ_{n,h,w} z²`` in fp32, i.e. the statistics of
      the tensor a following BatchNorm would normalise (before scale/shift/residual/activation).

    Returns ``(y, sum, sumsq)``; the sums are ``None`` when ``stats`` is False. ``groups > 1`` is allowed here
    (the fused op falls back to this function for grouped and depthwise convolutions).
    """
    stride_, padding_, dilation_ = (
        pair(stride, "stride"),
        pair(padding, "padding"),
        pair(dilation, "dilation"),
    )
    acc = accumulation_dtype(x.dtype)
    z = F.conv2d(
        x.to(acc),
        weight.to(acc),
        None if bias is None else bias.to(acc),
        stride_,
        padding_,
        dilation_,
        groups,
    )
    sums = sumsq = None
    if stats:
        sums = z.sum(dim=(0, 2, 3))
        sumsq = (z * z).sum(dim=(0, 2, 3))
    y = epilogue_reference(z, scale, shift, residual, activation)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last), sums, sumsq


def batch_stats_from_sums(
    sums: torch.Tensor, sumsq: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and *biased* variance from the epilogue's sums (``var = E[z²] - E[z]²``, clamped at 0)."""
    mean = sums / count
    var = (sumsq / count - mean * mean).clamp_min(0.0)
    return mean, var
