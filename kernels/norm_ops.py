"""``torch.library`` registration of the fused normalization ops (namespace ``lcv``) and their functional API.

Ops (each a ``custom_op`` with a fake implementation and an autograd formula that calls a backward op,
so ``torch.compile(fullgraph=True)`` traces forward and backward without graph breaks):

* ``lcv::batch_norm_act``  → ``(y, mean, var)``; ``lcv::batch_norm_act_backward``
* ``lcv::group_norm_act``  → ``(y, mean, rstd)``; ``lcv::group_norm_act_backward``
* ``lcv::layer_norm2d_act`` → ``(y, mean, rstd)``; ``lcv::layer_norm2d_act_backward``

Where they run: CUDA tensors → the Triton kernels (``kernels.norm``); CPU tensors with ``TRITON_INTERPRET=1``
→ the same kernels in the interpreter; CPU otherwise → the op references (``kernels.norm_reference``).

The returned statistics are not differentiable (they are marked so): the only consumer is the in-place
running-statistics update, which ``nn.BatchNorm2d`` also does without autograd. BatchNorm's optional
``sums``/``sumsq`` inputs (a conv epilogue's ``Σz``, ``Σz²``) are hints that replace the statistics pass;
they get no gradient because the backward formula already differentiates through the batch statistics of
``x``. The ops are functional (custom ops that mutate cannot have autograd), so the running statistics are
updated by :func:`batch_norm_act` from the returned ``mean``/``var`` with the same formula as PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels._common import ACTIVATIONS, check_dtype, use_triton
from kernels.conv_reference import accumulation_dtype
from kernels.norm_reference import (
    batch_norm_act_backward_reference,
    batch_norm_act_forward_reference,
    group_norm_act_backward_reference,
    group_norm_act_forward_reference,
    layer_norm2d_act_backward_reference,
    layer_norm2d_act_forward_reference,
)

__all__ = ["batch_norm_act", "group_norm_act", "layer_norm2d_act", "dense_layout", "update_running_stats"]


# ---------------------------------------------------------------------------------------------------------
# Argument checks (shared by the real and fake implementations, so errors are the same when compiling)


def dense_layout(t: torch.Tensor) -> torch.memory_format | None:
    """``torch.channels_last`` or ``torch.contiguous_format`` if ``t`` is dense in that order, else None."""
    if t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.is_contiguous():
        return torch.contiguous_format
    return None


def _check_input(x: torch.Tensor, op: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be a 4-D (N, C, H, W) tensor, got shape {tuple(x.shape)}")
    check_dtype(x, "x")
    if dense_layout(x) is None:
        raise ValueError(
            f"{op}: x must be dense in NCHW or channels_last memory format (got strides {x.stride()}); "
            "call x.contiguous() or x.contiguous(memory_format=torch.channels_last) first"
        )
    if x.numel() == 0:
        raise ValueError(f"{op}: x is empty (shape {tuple(x.shape)})")


def _check_vector(v: torch.Tensor | None, name: str, length: int, x: torch.Tensor, op: str) -> None:
    if v is None:
        return
    if v.dim() != 1 or v.shape[0] != length:
        raise ValueError(f"{op}: {name} must be a 1-D tensor of {length} entries, got shape {tuple(v.shape)}")
    if not v.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {v.dtype}")
    if v.device != x.device:
        raise ValueError(f"{op}: {name} is on {v.device} but x is on {x.device}")


def _check_residual(residual: torch.Tensor | None, x: torch.Tensor, op: str) -> None:
    if residual is None:
        return
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{op}: residual dtype {residual.dtype} does not match x dtype {x.dtype}")
    if residual.device != x.device:
        raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    if dense_layout(residual) is None:
        raise ValueError(f"{op}: residual must be dense in NCHW or channels_last memory format")


def _check_activation(activation: str, op: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def check_batch_norm_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    sums: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    use_batch_stats: bool,
    activation: str,
) -> None:
    """Raise with a message naming the problem; shared by the op and its fake."""
    op = "batch_norm_act"
    _check_input(x, op)
    c = x.shape[1]
    for name, v in (
        ("weight", weight),
        ("bias", bias),
        ("running_mean", running_mean),
        ("running_var", running_var),
    ):
        _check_vector(v, name, c, x, op)
    _check_residual(residual, x, op)
    _check_activation(activation, op)
    if not use_batch_stats and (running_mean is None or running_var is None):
        raise ValueError(f"{op}: running_mean and running_var are required when not using batch statistics")
    if (sums is None) != (sumsq is None):
        raise ValueError(f"{op}: pass both sums and sumsq, or neither")
    if sums is not None:
        if not use_batch_stats:
            raise ValueError(f"{op}: sums/sumsq are batch statistics; they need use_batch_stats=True")
        for name, v in (("sums", sums), ("sumsq", sumsq)):
            _check_vector(v, name, c, x, op)
            if v.dtype != torch.float32:
                raise TypeError(
                    f"{op}: {name} must be float32 (the conv epilogue's fp32 sums), got {v.dtype}"
                )
    if use_batch_stats and x.numel() // c <= 1:
        raise ValueError(
            f"{op}: expected more than 1 value per channel when using batch statistics, "
            f"got input size {tuple(x.shape)}"
        )


def check_group_norm_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    activation: str,
) -> None:
    op = "group_norm_act"
    _check_input(x, op)
    c = x.shape[1]
    if not isinstance(num_groups, int) or num_groups < 1 or c % num_groups != 0:
        raise ValueError(f"{op}: the number of channels ({c}) must be divisible by num_groups ({num_groups})")
    _check_vector(weight, "weight", c, x, op)
    _check_vector(bias, "bias", c, x, op)
    _check_residual(residual, x, op)
    _check_activation(activation, op)


def check_layer_norm2d_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
) -> None:
    op = "layer_norm2d_act"
    _check_input(x, op)
    c = x.shape[1]
    _check_vector(weight, "weight", c, x, op)
    _check_vector(bias, "bias", c, x, op)
    _check_residual(residual, x, op)
    _check_activation(activation, op)


# ---------------------------------------------------------------------------------------------------------
# Shared autograd plumbing


def _as_dense_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Incoming gradients can be expanded or strided: give the kernels a dense tensor in ``like``'s layout."""
    if dense_layout(t) is not None:
        return t
    return t.contiguous(memory_format=dense_layout(like) or torch.contiguous_format)


def _empty_grad(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,), dtype=torch.float32)


def _pack_grads(grads: tuple, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Custom ops cannot return None: unrequested gradients become empty tensors (and None again outside)."""
    return tuple(_empty_grad(x) if g is None else g for g in grads)


def _fake_grads(
    x: torch.Tensor, residual: torch.Tensor | None, grad_mask: list[bool]
) -> tuple[torch.Tensor, ...]:
    acc = accumulation_dtype(x.dtype)
    c = x.shape[1]
    want_x, want_w, want_b, want_r = grad_mask
    return (
        torch.empty_like(x) if want_x else _empty_grad(x),
        x.new_empty((c,), dtype=acc) if want_w else _empty_grad(x),
        x.new_empty((c,), dtype=acc) if want_b else _empty_grad(x),
        torch.empty_like(x, dtype=residual.dtype) if (want_r and residual is not None) else _empty_grad(x),
    )


def _unpack_grads(
    grads: tuple[torch.Tensor, ...], mask: list[bool], weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    dx, dw, db, dres = (g if want else None for g, want in zip(grads, mask, strict=True))
    if dw is not None:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return dx, dw, db, dres


def _grad_mask(ctx: Any, weight: Any, bias: Any, residual: Any) -> list[bool]:
    need = ctx.needs_input_grad
    return [
        bool(need[0]),
        bool(need[1]) and weight is not None,
        bool(need[2]) and bias is not None,
        bool(need[3]) and residual is not None,
    ]


# ---------------------------------------------------------------------------------------------------------
# BatchNorm


@torch.library.custom_op("lcv::batch_norm_act", mutates_args=())
def _batch_norm_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    sums: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    use_batch_stats: bool,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_batch_norm_args(
        x, weight, bias, residual, running_mean, running_var, sums, sumsq, use_batch_stats, activation
    )
    if use_triton(x):
        from kernels.norm import batch_norm_act_forward_triton  # deferred: CPU-only users never import triton

        return batch_norm_act_forward_triton(
            x,
            weight,
            bias,
            residual,
            running_mean,
            running_var,
            sums,
            sumsq,
            use_batch_stats,
            eps,
            activation,
        )
    with torch.autocast(x.device.type, enabled=False):
        return batch_norm_act_forward_reference(
            x,
            weight,
            bias,
            residual,
            running_mean,
            running_var,
            sums,
            sumsq,
            use_batch_stats,
            eps,
            activation,
        )


@_batch_norm_act_op.register_fake
def _batch_norm_act_fake(
    x, weight, bias, residual, running_mean, running_var, sums, sumsq, use_batch_stats, eps, activation
):
    check_batch_norm_args(
        x, weight, bias, residual, running_mean, running_var, sums, sumsq, use_batch_stats, activation
    )
    acc = accumulation_dtype(x.dtype)
    c = x.shape[1]
    return torch.empty_like(x), x.new_empty((c,), dtype=acc), x.new_empty((c,), dtype=acc)


@torch.library.custom_op("lcv::batch_norm_act_backward", mutates_args=())
def _batch_norm_act_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    use_batch_stats: bool,
    eps: float,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from kernels.norm import batch_norm_act_backward_triton

        grads = batch_norm_act_backward_triton(
            grad_y, x, weight, bias, residual, mean, var, use_batch_stats, eps, activation, grad_mask
        )
    else:
        with torch.autocast(x.device.type, enabled=False):
            grads = batch_norm_act_backward_reference(
                grad_y, x, weight, bias, residual, mean, var, use_batch_stats, eps, activation, grad_mask
            )
    return _pack_grads(grads, x)


@_batch_norm_act_backward_op.register_fake
def _batch_norm_act_backward_fake(
    grad_y, x, weight, bias, residual, mean, var, use_batch_stats, eps, activation, grad_mask
):
    return _fake_grads(x, residual, grad_mask)


def _batch_norm_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, residual, _rm, _rv, _sums, _sumsq, use_batch_stats, eps, activation = inputs
    _, mean, var = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, var)
    ctx.use_batch_stats, ctx.eps, ctx.activation = use_batch_stats, eps, activation
    ctx.save_for_backward(x, weight, bias, residual, mean, var)


def _batch_norm_backward(ctx: Any, grad_y: torch.Tensor | None, _gm: Any, _gv: Any) -> tuple:
    x, weight, bias, residual, mean, var = ctx.saved_tensors
    mask = _grad_mask(ctx, weight, bias, residual)
    grads: tuple = (None, None, None, None)
    if grad_y is not None and any(mask):
        packed = _batch_norm_act_backward_op(
            _as_dense_like(grad_y, x),
            x,
            weight,
            bias,
            residual,
            mean,
            var,
            ctx.use_batch_stats,
            ctx.eps,
            ctx.activation,
            mask,
        )
        grads = _unpack_grads(packed, mask, weight, bias)
    return (*grads, None, None, None, None, None, None, None)


_batch_norm_act_op.register_autograd(_batch_norm_backward, setup_context=_batch_norm_setup_context)


@torch.no_grad()
def update_running_stats(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int,
    momentum: float | torch.Tensor,
) -> None:
    """PyTorch's update, in place: ``r = (1 - m)·r + m·stat`` with the *unbiased* batch variance."""
    unbiased = var * (count / (count - 1))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype) * momentum)
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)


def batch_norm_act(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float | torch.Tensor = 0.1,
    eps: float = 1e-5,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.batch_norm(x, ...) + residual)`` in one elementwise pass over ``x`` (NCHW or channels_last).

    Same arguments and running-statistics semantics as ``F.batch_norm``: with ``training=True`` the batch
    statistics normalise ``x`` and, if running buffers are given, update them in place with ``momentum``
    (a float, or a 0-dim tensor such as ``1 / num_batches_tracked`` for a cumulative average); with
    ``training=False`` the running statistics are folded into a per-channel scale/shift. ``sums``/``sumsq``
    (fp32 ``Σx``, ``Σx²`` per channel, e.g. from ``conv2d_fused(..., stats=True)``) replace the statistics
    pass over ``x``. The output has ``x``'s dtype and memory format.
    """
    use_batch_stats = bool(training)
    y, mean, var = _batch_norm_act_op(
        x,
        weight,
        bias,
        residual,
        running_mean,
        running_var,
        sums,
        sumsq,
        use_batch_stats,
        float(eps),
        activation,
    )
    if training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, x.numel() // x.shape[1], momentum)
    return y


# ---------------------------------------------------------------------------------------------------------
# GroupNorm


@torch.library.custom_op("lcv::group_norm_act", mutates_args=())
def _group_norm_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    num_groups: int,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_group_norm_args(x, weight, bias, residual, num_groups, activation)
    if use_triton(x):
        from kernels.norm import group_norm_act_forward_triton

        return group_norm_act_forward_triton(x, weight, bias, residual, num_groups, eps, activation)
    with torch.autocast(x.device.type, enabled=False):
        return group_norm_act_forward_reference(x, weight, bias, residual, num_groups, eps, activation)


@_group_norm_act_op.register_fake
def _group_norm_act_fake(x, weight, bias, residual, num_groups, eps, activation):
    check_group_norm_args(x, weight, bias, residual, num_groups, activation)
    acc = accumulation_dtype(x.dtype)
    stats = x.shape[0] * num_groups
    return torch.empty_like(x), x.new_empty((stats,), dtype=acc), x.new_empty((stats,), dtype=acc)


@torch.library.custom_op("lcv::group_norm_act_backward", mutates_args=())
def _group_norm_act_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    num_groups: int,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from kernels.norm import group_norm_act_backward_triton

        grads = group_norm_act_backward_triton(
            grad_y, x, weight, bias, residual, mean, rstd, num_groups, activation, grad_mask
        )
    else:
        with torch.autocast(x.device.type, enabled=False):
            grads = group_norm_act_backward_reference(
                grad_y, x, weight, bias, residual, mean, rstd, num_groups, activation, grad_mask
            )
    return _pack_grads(grads, x)


@_group_norm_act_backward_op.register_fake
def _group_norm_act_backward_fake(
    grad_y, x, weight, bias, residual, mean, rstd, num_groups, activation, grad_mask
):
    return _fake_grads(x, residual, grad_mask)


def _group_norm_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, residual, num_groups, _eps, activation = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.num_groups, ctx.activation = num_groups, activation
    ctx.save_for_backward(x, weight, bias, residual, mean, rstd)


def _group_norm_backward(ctx: Any, grad_y: torch.Tensor | None, _gm: Any, _gr: Any) -> tuple:
    x, weight, bias, residual, mean, rstd = ctx.saved_tensors
    mask = _grad_mask(ctx, weight, bias, residual)
    grads: tuple = (None, None, None, None)
    if grad_y is not None and any(mask):
        packed = _group_norm_act_backward_op(
            _as_dense_like(grad_y, x),
            x,
            weight,
            bias,
            residual,
            mean,
            rstd,
            ctx.num_groups,
            ctx.activation,
            mask,
        )
        grads = _unpack_grads(packed, mask, weight, bias)
    return (*grads, None, None, None)


_group_norm_act_op.register_autograd(_group_norm_backward, setup_context=_group_norm_setup_context)


def _autocast_to_fp32(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CUDA autocast runs group_norm/layer_norm in fp32 (output fp32); do the same so results match eager.
    (CPU autocast leaves them in the input dtype, and so do we.)"""
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        x = x.float()
        residual = None if residual is None else residual.float()
    return x, residual


def group_norm_act(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.group_norm(x, num_groups, weight, bias, eps) + residual)`` as one fused op (fwd and bwd)."""
    x, residual = _autocast_to_fp32(x, residual)
    return _group_norm_act_op(x, weight, bias, residual, num_groups, float(eps), activation)[0]


# ---------------------------------------------------------------------------------------------------------
# LayerNorm over channels (ConvNeXt LayerNorm2d)


@torch.library.custom_op("lcv::layer_norm2d_act", mutates_args=())
def _layer_norm2d_act_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_layer_norm2d_args(x, weight, bias, residual, activation)
    if use_triton(x):
        from kernels.norm import layer_norm2d_act_forward_triton

        return layer_norm2d_act_forward_triton(x, weight, bias, residual, eps, activation)
    with torch.autocast(x.device.type, enabled=False):
        return layer_norm2d_act_forward_reference(x, weight, bias, residual, eps, activation)


@_layer_norm2d_act_op.register_fake
def _layer_norm2d_act_fake(x, weight, bias, residual, eps, activation):
    check_layer_norm2d_args(x, weight, bias, residual, activation)
    acc = accumulation_dtype(x.dtype)
    rows = x.numel() // x.shape[1]
    return torch.empty_like(x), x.new_empty((rows,), dtype=acc), x.new_empty((rows,), dtype=acc)


@torch.library.custom_op("lcv::layer_norm2d_act_backward", mutates_args=())
def _layer_norm2d_act_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    activation: str,
    grad_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from kernels.norm import layer_norm2d_act_backward_triton

        grads = layer_norm2d_act_backward_triton(
            grad_y, x, weight, bias, residual, mean, rstd, activation, grad_mask
        )
    else:
        with torch.autocast(x.device.type, enabled=False):
            grads = layer_norm2d_act_backward_reference(
                grad_y, x, weight, bias, residual, mean, rstd, activation, grad_mask
            )
    return _pack_grads(grads, x)


@_layer_norm2d_act_backward_op.register_fake
def _layer_norm2d_act_backward_fake(grad_y, x, weight, bias, residual, mean, rstd, activation, grad_mask):
    return _fake_grads(x, residual, grad_mask)


def _layer_norm2d_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, residual, _eps, activation = inputs
    _, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.activation = activation
    ctx.save_for_backward(x, weight, bias, residual, mean, rstd)


def _layer_norm2d_backward(ctx: Any, grad_y: torch.Tensor | None, _gm: Any, _gr: Any) -> tuple:
    x, weight, bias, residual, mean, rstd = ctx.saved_tensors
    mask = _grad_mask(ctx, weight, bias, residual)
    grads: tuple = (None, None, None, None)
    if grad_y is not None and any(mask):
        packed = _layer_norm2d_act_backward_op(
            _as_dense_like(grad_y, x), x, weight, bias, residual, mean, rstd, ctx.activation, mask
        )
        grads = _unpack_grads(packed, mask, weight, bias)
    return (*grads, None, None)


_layer_norm2d_act_op.register_autograd(_layer_norm2d_backward, setup_context=_layer_norm2d_setup_context)


def layer_norm2d_act(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(LayerNorm over the channels of x + residual)`` (ConvNeXt ``LayerNorm2d``) as one fused op.

    Equivalent to ``F.layer_norm(x.permute(0, 2, 3, 1), (C,), weight, bias, eps).permute(0, 3, 1, 2)``
    without the two layout copies; the output keeps ``x``'s memory format.
    """
    x, residual = _autocast_to_fp32(x, residual)
    return _layer_norm2d_act_op(x, weight, bias, residual, float(eps), activation)[0]
