"""``torch.library`` registration of the fused convolution (namespace ``lcv``) and its functional API.

``lcv::conv2d_fused`` is a ``custom_op``: opaque to Inductor (its Triton kernel is launched as is), with a
fake implementation for tracing and an autograd formula, so ``torch.compile(fullgraph=True)`` traces models
that use it without graph breaks. Where it runs:

* CUDA tensors: the Triton kernel (``kernels.conv``);
* CPU tensors with ``TRITON_INTERPRET=1``: the same Triton kernel in the interpreter (slow; for tests);
* CPU tensors otherwise: the PyTorch reference (``kernels.conv_reference``).

Backward uses PyTorch's own ``aten.convolution_backward`` (cuDNN on GPU) for the weight gradient and, by
default, the input gradient: cuDNN's dgrad/wgrad are hard to beat, and the epilogue's backward is
elementwise work that Inductor fuses when compiled. ``LCV_CONV_DGRAD=triton`` computes the input gradient
of stride-1 convs with our forward kernel instead (a stride-1 conv's dgrad is a conv with the flipped,
transposed weight); ``benchmarks/conv.py`` times both so the default can follow the measurement. If the forward epilogue is not the identity (scale/shift/residual/activation), backward
recomputes the pre-epilogue conv output ``z`` with one extra forward conv instead of saving it, so the
forward keeps its single output write.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kernels._common import activation_grad, use_triton
from kernels.conv_reference import (
    accumulation_dtype,
    check_conv2d_fused_args,
    conv2d_fused_reference,
    epilogue_reference,
    pair,
)

__all__ = ["DGRAD_ENV", "conv2d_fused", "dgrad_impl"]


@torch.library.custom_op("lcv::conv2d_fused", mutates_args=())
def _conv2d_fused_op(
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
    check_conv2d_fused_args(x, weight, bias, scale, shift, residual, stride, padding, dilation, activation)
    if use_triton(x):
        from kernels.conv import conv2d_fused_triton  # triton import deferred: CPU-only users never pay it

        return conv2d_fused_triton(
            x, weight, bias, scale, shift, residual, stride, padding, dilation, activation, stats
        )
    # The caller already applied autocast's cast; the reference must compute in the dtypes it was given.
    with torch.autocast(x.device.type, enabled=False):
        y, sums, sumsq = conv2d_fused_reference(
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
    if not stats:
        # two distinct tensors: custom-op outputs may not alias each other
        sums, sumsq = x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.float32)
    return y, sums, sumsq


@_conv2d_fused_op.register_fake
def _conv2d_fused_fake(x, weight, bias, scale, shift, residual, stride, padding, dilation, activation, stats):
    n, k, p, q = check_conv2d_fused_args(
        x, weight, bias, scale, shift, residual, stride, padding, dilation, activation
    )
    y = x.new_empty((n, k, p, q)).contiguous(memory_format=torch.channels_last)
    width = k if stats else 0
    return y, x.new_empty((width,), dtype=torch.float32), x.new_empty((width,), dtype=torch.float32)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, scale, shift, residual, stride, padding, dilation, activation, stats = inputs
    y = output[0]
    # Leave unused output gradients as None: a consumer that reads the BN sums without differentiating
    # through them (kernels.norm_ops) must not cost backward full-size work on all-zero sum gradients.
    ctx.set_materialize_grads(False)
    ctx.stride, ctx.padding, ctx.dilation = stride, padding, dilation
    ctx.activation, ctx.stats = activation, stats
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.save_for_backward(x, weight, bias, scale, shift, residual, y)


def _channel_sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dim=(0, 2, 3))


def _backward(
    ctx: Any, grad_y: torch.Tensor | None, grad_sum: torch.Tensor | None, grad_sumsq: torch.Tensor | None
):
    x, weight, bias, scale, shift, residual, y = ctx.saved_tensors
    identity = scale is None and shift is None and residual is None and ctx.activation == "none"
    needs_sums = ctx.stats and (grad_sum is not None or grad_sumsq is not None)
    needs_z = (
        needs_sums or ctx.activation in ("gelu", "silu") or (scale is not None and ctx.needs_input_grad[3])
    )
    acc = accumulation_dtype(x.dtype)
    z = None
    if needs_z:
        if identity:
            z = y.to(acc)
        else:  # recompute conv + bias rather than keep a second full-size activation alive
            z = _conv2d_fused_op(
                x, weight, bias, None, None, None, ctx.stride, ctx.padding, ctx.dilation, "none", False
            )[0].to(acc)
    grad_u = torch.zeros_like(y, dtype=acc) if grad_y is None else grad_y.to(acc)
    if ctx.activation == "relu":  # relu' follows from the output: no recompute for eval-mode-BN blocks
        grad_u = grad_u * (y > 0)
    elif ctx.activation != "none":
        u = epilogue_reference(z, scale, shift, residual, "none")
        grad_u = grad_u * activation_grad(u, ctx.activation)
    grad_residual = (
        grad_u.to(ctx.residual_dtype) if residual is not None and ctx.needs_input_grad[5] else None
    )
    grad_shift = (
        _channel_sum(grad_u).to(shift.dtype) if shift is not None and ctx.needs_input_grad[4] else None
    )
    grad_scale = (
        _channel_sum(grad_u * z).to(scale.dtype) if scale is not None and ctx.needs_input_grad[3] else None
    )
    grad_z = grad_u * scale.to(acc).view(1, -1, 1, 1) if scale is not None else grad_u
    if needs_sums:
        if grad_sum is not None:
            grad_z = grad_z + grad_sum.view(1, -1, 1, 1)
        if grad_sumsq is not None:
            grad_z = grad_z + 2.0 * z * grad_sumsq.view(1, -1, 1, 1)
    grad_bias = _channel_sum(grad_z).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
    grad_x = grad_w = None
    want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if want_x and _triton_dgrad_applies(x, weight, ctx.stride, ctx.padding, ctx.dilation):
        grad_x = triton_conv2d_input_grad(grad_z.to(x.dtype), weight, ctx.padding, ctx.dilation)
        want_x = False
    if want_x or want_w:
        # CPU has no fast half-precision convolution backward: do it in fp32 there.
        compute = x.dtype if x.is_cuda else acc
        aten_grad_x, grad_w, _ = torch.ops.aten.convolution_backward(
            grad_z.to(compute).contiguous(memory_format=torch.channels_last),
            x.to(compute),
            weight.to(compute),
            None,
            ctx.stride,
            ctx.padding,
            ctx.dilation,
            False,
            [0, 0],
            1,
            [want_x, want_w, False],
        )
        if want_x:
            grad_x = aten_grad_x.to(x.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
    return grad_x, grad_w, grad_bias, grad_scale, grad_shift, grad_residual, None, None, None, None, None


#: Environment switch for the input gradient: "aten" (default, cuDNN on GPU) or "triton".
DGRAD_ENV = "LCV_CONV_DGRAD"


def dgrad_impl() -> str:
    """Which implementation computes grad_input: ``$LCV_CONV_DGRAD``, "aten" unless set to "triton".

    Read when the backward runs (eager) or is traced (torch.compile bakes the choice into the graph).
    """
    value = os.environ.get(DGRAD_ENV, "aten")
    if value not in ("aten", "triton"):
        raise ValueError(f"{DGRAD_ENV}={value!r}; expected 'aten' or 'triton'")
    return value


def _triton_dgrad_applies(x, weight, stride, padding, dilation) -> bool:
    """Stride-1 convs only: their input gradient is itself a stride-1 conv, run by our forward kernel."""
    if dgrad_impl() != "triton" or not use_triton(x) or list(stride) != [1, 1]:
        return False
    r, s = weight.shape[2], weight.shape[3]
    return dilation[0] * (r - 1) >= padding[0] and dilation[1] * (s - 1) >= padding[1]


def triton_conv2d_input_grad(
    grad_z: torch.Tensor, weight: torch.Tensor, padding: Sequence[int], dilation: Sequence[int]
) -> torch.Tensor:
    """grad_input of a stride-1 conv = conv(grad_z, weight flipped in space with in/out swapped), padded
    by ``dilation * (k - 1) - padding``."""
    weight_t = weight.flip(2, 3).transpose(0, 1)
    pad = [dilation[0] * (weight.shape[2] - 1) - padding[0], dilation[1] * (weight.shape[3] - 1) - padding[1]]
    grad_z = grad_z.contiguous(memory_format=torch.channels_last)
    return _conv2d_fused_op(
        grad_z, weight_t, None, None, None, None, [1, 1], pad, list(dilation), "none", False
    )[0]


_conv2d_fused_op.register_autograd(_backward, setup_context=_setup_context)


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


def conv2d_fused(
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
    ``y = act(z * scale + shift + residual)`` in ``x.dtype`` and channels_last layout. Each epilogue
    operand is optional; ``activation`` is one of ``"none"``, ``"relu"``, ``"gelu"`` (exact erf form),
    ``"silu"``. With ``stats=True`` it returns ``(y, sum, sumsq)``, where ``sum[k] = Σ_{n,h,w} z`` and
    ``sumsq[k] = Σ_{n,h,w} z²`` (fp32, over batch and space, of ``z`` — conv plus bias, *before*
    scale/shift/residual/activation), the statistics a training BatchNorm needs.

    ``groups > 1`` (grouped / depthwise) is not implemented in Triton: it falls back to the differentiable
    PyTorch reference (``F.conv2d`` + elementwise epilogue), with the same semantics.
    """
    stride_, padding_, dilation_ = (
        pair(stride, "stride"),
        pair(padding, "padding"),
        pair(dilation, "dilation"),
    )
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    x, weight = _autocast_operands(x, weight)
    if groups != 1:
        y, sums, sumsq = conv2d_fused_reference(
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
    else:
        y, sums, sumsq = _conv2d_fused_op(
            x, weight, bias, scale, shift, residual, stride_, padding_, dilation_, activation, stats
        )
    if stats:
        return y, sums, sumsq
    return y
