"""Plain-PyTorch reference of ``lcv::conv_bn_act``: the semantics its Triton kernel must match.

It is also what the op runs on a CPU without ``TRITON_INTERPRET=1``, and, differentiable by plain autograd,
what grouped convolutions fall back to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lcv_kernels._common import accumulation_dtype, apply_activation


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


def epilogue_reference(
    z: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """``act(z * scale + shift + residual)`` in fp32 (or z's dtype if wider), per channel over dim 1."""
    acc = accumulation_dtype(z.dtype)
    u = z.to(acc)
    if scale is not None:
        u = u * scale.to(acc).view(1, -1, 1, 1)
    if shift is not None:
        u = u + shift.to(acc).view(1, -1, 1, 1)
    if residual is not None:
        u = u + residual.to(acc)
    return apply_activation(u, activation)


def conv_bn_act_reference(
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
    """Reference semantics of the fused conv.

    With ``z = conv2d(x, weight) + bias`` computed in fp32 (float64 for float64 inputs):

    * ``y = act(z * scale + shift + residual)``, cast to ``x.dtype``, channels_last;
    * if ``stats``: the per-channel ``mean`` and *biased* ``var`` of ``z`` over N, H, W (fp32), i.e. the batch
      statistics a following training-mode BatchNorm normalises with (before scale/shift/residual/act).

    Returns ``(y, mean, var)``; the statistics are None when ``stats`` is False.
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
    mean = var = None
    if stats:
        var, mean = torch.var_mean(z, dim=(0, 2, 3), unbiased=False)
    y = epilogue_reference(z, scale, shift, residual, activation)
    return y.to(x.dtype).contiguous(memory_format=torch.channels_last), mean, var
