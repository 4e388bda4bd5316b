"""Host-side plumbing the three normalization ops share: argument checks, launch geometry, gradient packing
and the module helpers. Each op's kernels, op and module live in its own file (``batch_norm_act.py``,
``group_norm_act.py``, ``layer_norm2d_act.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
from torch import nn

from lcv_kernels._common import (
    accumulation_dtype,
    activation_code,
    apply_activation,
    as_dense,
    cdiv,
    check_activation,
    check_dtype,
    checked_activation_name,
    dense_layout,
    empty_in_layout_of,
    in_layout_of,
    next_power_of_2,
    run_triton_or_reference,
)

# ---------------------------------------------------------------------------------------------------------
# Argument checks (shared by the real and fake implementations, so errors are the same when compiling)


def check_input(x: torch.Tensor, op: str) -> None:
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


def check_vector(v: torch.Tensor | None, name: str, length: int, x: torch.Tensor, op: str) -> None:
    if v is None:
        return
    if v.dim() != 1 or v.shape[0] != length:
        raise ValueError(f"{op}: {name} must be a 1-D tensor of {length} entries, got shape {tuple(v.shape)}")
    if not v.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {v.dtype}")
    if v.device != x.device:
        raise ValueError(f"{op}: {name} is on {v.device} but x is on {x.device}")


def check_residual(residual: torch.Tensor | None, x: torch.Tensor, op: str) -> None:
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


def check_common(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str,
    op: str,
) -> None:
    """The checks every norm op makes: input, affine vectors of C entries, residual, activation."""
    check_input(x, op)
    check_vector(weight, "weight", x.shape[1], x, op)
    check_vector(bias, "bias", x.shape[1], x, op)
    check_residual(residual, x, op)
    check_activation(activation, op)


# ---------------------------------------------------------------------------------------------------------
# Launch geometry


def row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """``(s_n, s_hw, s_c)`` of a 4-D tensor dense in NCHW or channels_last order.

    With ``W > 1`` a dense tensor has ``s_h = W·s_w``, so pixel ``hw`` is at ``hw·s_w``; with ``W == 1`` it is
    at ``h·s_h``.
    """
    s_hw = t.stride(3) if t.shape[3] > 1 else t.stride(2)
    return t.stride(0), s_hw, t.stride(1)


def epilogue_flags(
    weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None, activation: str
) -> dict[str, Any]:
    """The epilogue's ``tl.constexpr`` switches every norm kernel takes (forward and backward), as launch
    keywords: each combination compiles its own specialisation, with the unused loads removed."""
    return {
        "HAS_WEIGHT": weight is not None,
        "HAS_BIAS": bias is not None,
        "HAS_RESIDUAL": residual is not None,
        "ACTIVATION": activation_code(activation),
    }


def num_warps(elements: int) -> int:
    return 8 if elements >= 8192 else 4


def channel_tile(channels: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C) for per-channel (BatchNorm) kernels: ≤ 64 channels wide, ~4K elements a tile.

    Untuned starting points, not measured on GPU. The interpreter gets the same shapes (numpy handles a
    [64, 64] tile at once; fewer programs is what keeps it fast).
    """
    block_c = min(next_power_of_2(max(channels, 1)), 64)
    return max(16, 4096 // block_c), block_c


def parallel_target(device: torch.device) -> int:
    """How many programs a reduction grid aims for: a few per SM on GPU, 2 in the interpreter (so the
    multi-part merges are exercised by the CPU tests)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def row_chunks(rows: int, block_m: int, programs: int) -> tuple[int, int]:
    """Split ``rows`` into chunks that are multiples of ``block_m``; return (rows per chunk, chunks)."""
    per = cdiv(max(rows, 1), max(programs, 1))
    per = cdiv(per, block_m) * block_m
    return per, cdiv(max(rows, 1), per)


# ---------------------------------------------------------------------------------------------------------
# Autograd plumbing: custom ops cannot return None, so unrequested gradients travel as empty tensors


def empty_grad(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,), dtype=torch.float32)


#: What a norm op's backward returns: (dx, dγ, dβ, d residual), an empty tensor for each one not asked for.
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def pack_grads(grads: tuple[torch.Tensor | None, ...], x: torch.Tensor) -> Grads:
    dx, dw, db, dres = (empty_grad(x) if g is None else g for g in grads)
    return dx, dw, db, dres


def fake_grads(
    x: torch.Tensor, residual: torch.Tensor | None, grad_mask: list[bool]
) -> tuple[torch.Tensor, ...]:
    """What the backward ops return: dx in x's layout, fp32 dγ/dβ, d residual in x's layout."""
    acc = accumulation_dtype(x.dtype)
    c = x.shape[1]
    want_x, want_w, want_b, want_r = grad_mask
    return (
        empty_in_layout_of(x) if want_x else empty_grad(x),
        x.new_empty((c,), dtype=acc) if want_w else empty_grad(x),
        x.new_empty((c,), dtype=acc) if want_b else empty_grad(x),
        empty_in_layout_of(x, residual.dtype) if (want_r and residual is not None) else empty_grad(x),
    )


_Module = TypeVar("_Module", bound=nn.Module)


def unpack_grads(
    grads: tuple[torch.Tensor, ...], mask: list[bool], weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    dx, dw, db, dres = (g if want else None for g, want in zip(grads, mask, strict=True))
    if dw is not None:
        assert weight is not None  # autograd asks for no gradient of an absent weight
        dw = dw.to(weight.dtype)
    if db is not None:
        assert bias is not None
        db = db.to(bias.dtype)
    return dx, dw, db, dres


def norm_backward(ctx: Any, grad_y: torch.Tensor | None, backward_op: Any, *op_args: Any) -> tuple:
    """The autograd formula of a norm op: ``(dx, dγ, dβ, d residual)`` from its ``..._backward`` op, which
    receives ``(grad_y, x, weight, bias, residual, *statistics, *op_args, grad_mask)``; saved tensors are
    ``(x, weight, bias, residual, *statistics)``."""
    x, weight, bias, residual, *statistics = ctx.saved_tensors
    mask = needed_grads(ctx, weight, bias, residual)
    if grad_y is None or not any(mask):
        return (None, None, None, None)
    packed = backward_op(as_dense(grad_y, x), x, weight, bias, residual, *statistics, *op_args, mask)
    return unpack_grads(packed, mask, weight, bias)


def run_backward(x: torch.Tensor, triton_impl: Any, reference_impl: Any, *args: Any) -> Grads:
    """A backward op's body: the gradients from Triton or the reference, packed for the op's return."""
    return pack_grads(run_triton_or_reference(x, triton_impl, reference_impl, *args), x)


def needed_grads(ctx: Any, weight: Any, bias: Any, residual: Any) -> list[bool]:
    need = ctx.needs_input_grad
    return [
        bool(need[0]),
        bool(need[1]) and weight is not None,
        bool(need[2]) and bias is not None,
        bool(need[3]) and residual is not None,
    ]


# ---------------------------------------------------------------------------------------------------------
# Reference building blocks (the ``*_reference`` modules)


@overload
def channel(v: torch.Tensor, acc: torch.dtype) -> torch.Tensor: ...
@overload
def channel(v: None, acc: torch.dtype) -> None: ...
def channel(v: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    """A per-channel vector shaped to broadcast over (N, C, H, W), in the accumulation dtype."""
    return None if v is None else v.to(acc).view(1, -1, 1, 1)


def affine(
    xhat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """``x̂·γ + β + residual``: the pre-activation every norm op shares."""
    acc = xhat.dtype
    u = xhat if weight is None else xhat * channel(weight, acc)
    if bias is not None:
        u = u + channel(bias, acc)
    if residual is not None:
        u = u + residual.to(acc)
    return u


def grads_out(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    gu: torch.Tensor,
    grad_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The four gradients as the backward ops return them (dx and d residual in x's layout)."""
    want_x, want_w, want_b, want_r = grad_mask
    return (
        in_layout_of(dx, x) if want_x else None,
        dw if want_w else None,
        db if want_b else None,
        in_layout_of(gu, x, residual.dtype) if (want_r and residual is not None) else None,
    )


# ---------------------------------------------------------------------------------------------------------
# Module helpers


def residual_like(residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if residual is None else as_dense(residual, x)


def fuse_residual(
    run: Callable[[str, torch.Tensor | None], torch.Tensor],
    out_dtype: torch.dtype,
    activation: str,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """``run(activation, residual)`` when the residual has the output's dtype (the fused path); otherwise
    add it afterwards, so eager type promotion (e.g. a bf16 norm output + an fp32 residual) is kept."""
    if residual is None or residual.dtype == out_dtype:
        return run(activation, residual)
    return apply_activation(run("none", None) + residual, activation)


def autocast_to_fp32(x: torch.Tensor) -> bool:
    """CUDA autocast computes group/layer norm in fp32 (output fp32); the fused ops follow it. (CPU autocast
    leaves them in the input dtype, and so do we.)"""
    return x.is_cuda and torch.is_autocast_enabled("cuda")


def share_state(src: nn.Module, cls: type[_Module], act: nn.Module | None) -> _Module:
    """A ``cls`` instance that *is* ``src`` in state: same attributes, parameter and buffer dicts, plus the
    fused activation's name."""
    activation = checked_activation_name(act)
    fused = cls.__new__(cls)
    nn.Module.__init__(fused)
    fused.__dict__.update(
        {k: v for k, v in src.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
    )
    fused._parameters = src._parameters
    fused._buffers = src._buffers
    fused._modules = dict(src._modules)
    fused.activation = activation  # type: ignore[assignment]  # a str: nn.Module types attributes as modules
    return fused
