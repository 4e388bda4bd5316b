"""Host-side helpers every op file shares: where to run, activations, dtypes, layouts, vectors.

Kept free of Triton so the PyTorch references (and a machine without Triton) never import it.
"""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

#: Activation names every fused epilogue understands, in the order of their integer codes.
ACTIVATIONS: tuple[str, ...] = ("none", "relu", "gelu", "silu")

#: Input dtypes the Triton kernels accept; accumulation is always fp32.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

#: Tensors with this many elements or more need 64-bit offsets in a kernel.
INT32_LIMIT = 2**31


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run (slowly) on CPU tensors in numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works; tried once, when a kernel is first asked for (the references never
    import Triton). Asked here, not of ``_triton``, which imports this module: no import cycle, even a lazy one."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for ``t``? Yes on CUDA, or on CPU when the interpreter is on.

    Otherwise callers run their PyTorch reference, so every op works on a machine without a GPU.
    """
    if t.is_cuda:
        return triton_available()
    return t.device.type == "cpu" and interpreter_enabled() and triton_available()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def run_triton_or_reference(x: torch.Tensor, triton_impl: Any, reference_impl: Any, *args: Any) -> Any:
    """What every op body does: the Triton launcher when :func:`use_triton`, else the PyTorch reference in
    exactly the dtypes it was given (autocast already cast the operands; it must not cast them again)."""
    if use_triton(x):
        return triton_impl(*args)
    with torch.autocast(x.device.type, enabled=False):
        return reference_impl(*args)


def launch_context(t: torch.Tensor) -> AbstractContextManager[object]:
    """Launch on ``t``'s GPU (Triton launches on the current device), or nothing for CPU tensors."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


# ---------------------------------------------------------------------------------------------------------
# Activations


def activation_code(name: str) -> int:
    """Integer code of an activation name for a ``tl.constexpr`` switch; raises naming the choices."""
    try:
        return ACTIVATIONS.index(name)
    except ValueError:
        raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}") from None


def check_activation(name: str, op: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {name!r}; expected one of {ACTIVATIONS}")


_ACTIVATION_MODULES: dict[type[nn.Module], str] = {
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Identity: "none",
}


def activation_name(module: nn.Module | None) -> str | None:
    """The epilogue's name for an activation module (``None`` → ``"none"``), or None when it cannot be
    fused (a module of another class, or the tanh-approximate GELU)."""
    if module is None:
        return "none"
    if type(module) is nn.GELU and module.approximate != "none":
        return None
    return _ACTIVATION_MODULES.get(type(module))


def checked_activation_name(module: nn.Module | None) -> str:
    """:func:`activation_name`, raising a ValueError that lists what can be fused."""
    name = activation_name(module)
    if name is None:
        supported = ", ".join(sorted(cls.__name__ for cls in _ACTIVATION_MODULES))
        raise ValueError(
            f"activation {type(module).__name__}"
            f"{'(approximate=' + repr(module.approximate) + ')' if isinstance(module, nn.GELU) else ''} "
            f"cannot be fused; supported: {supported} (GELU only in its exact erf form) or None"
        )
    return name


def apply_activation(u: torch.Tensor, name: str) -> torch.Tensor:
    """The plain-PyTorch activation matching the Triton epilogue (GELU is the exact erf form)."""
    if name == "none":
        return u
    if name == "relu":
        return torch.relu(u)
    if name == "gelu":
        return torch.nn.functional.gelu(u)
    if name == "silu":
        return torch.nn.functional.silu(u)
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")


def activation_grad(u: torch.Tensor, name: str) -> torch.Tensor:
    """d act(u) / du, elementwise, in plain PyTorch (the backward of a fused epilogue)."""
    if name == "none":
        return torch.ones_like(u)
    if name == "relu":
        return (u > 0).to(u.dtype)
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(u * 0.7071067811865476))
        pdf = torch.exp(-0.5 * u * u) * 0.3989422804014327
        return cdf + u * pdf
    if name == "silu":
        sig = torch.sigmoid(u)
        return sig * (1.0 + u * (1.0 - sig))
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")


# ---------------------------------------------------------------------------------------------------------
# Dtypes


def check_dtype(t: torch.Tensor, what: str) -> None:
    """Raise a TypeError naming ``what`` if ``t`` is not fp32, fp16 or bf16."""
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what} has dtype {t.dtype}; supported dtypes are {names}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every kernel dtype; float64 stays float64 (the references, e.g. under gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Layouts
#
# A 4-D tensor whose H and W are 1 (or whose C is 1) is contiguous in both NCHW and channels_last order, and
# the strides of its size-1 dims are arbitrary: Inductor may hand a kernel such a tensor with other strides
# than the ones it traced. Outputs are therefore never "like x" by strides; they are allocated from the
# shape and one memory format decided by contiguity checks (which ignore size-1 dims), so the fake and the
# real implementation of an op always agree on every stride.


def dense_layout(t: torch.Tensor) -> torch.memory_format | None:
    """``torch.channels_last`` if ``t`` is dense in that order (ties included), else
    ``torch.contiguous_format`` if dense in NCHW order, else None."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.is_contiguous():
        return torch.contiguous_format
    return None


def canonical_strides(
    shape: torch.Size | tuple[int, ...], memory_format: torch.memory_format
) -> tuple[int, ...]:
    """The strides ``torch.empty(shape, memory_format=...)`` gives: the one stride set fakes and kernels
    use."""
    sizes = [max(int(size), 1) for size in shape]
    if len(sizes) == 4 and memory_format == torch.channels_last:
        _, c, h, w = sizes
        return (h * w * c, 1, w * c, c)
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def empty_dense(
    shape: torch.Size | tuple[int, ...],
    like: torch.Tensor,
    memory_format: torch.memory_format,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A new tensor with the canonical strides of ``memory_format`` (what fakes and kernels both return)."""
    if len(shape) != 4:
        memory_format = torch.contiguous_format
    return torch.empty(
        tuple(shape), dtype=dtype or like.dtype, device=like.device, memory_format=memory_format
    )


def empty_in_layout_of(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output of ``t``'s shape in ``t``'s dense layout, with canonical strides."""
    return empty_dense(t.shape, t, dense_layout(t) or torch.contiguous_format, dtype)


def in_layout_of(values: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a fresh tensor of ``like``'s shape) with exactly the strides of
    :func:`empty_in_layout_of` ``(like, dtype)``: returned as is when it has them, else copied once."""
    dtype = dtype or like.dtype
    memory_format = dense_layout(like) or torch.contiguous_format
    if values.dtype == dtype and tuple(values.stride()) == canonical_strides(like.shape, memory_format):
        return values
    out = empty_dense(like.shape, like, memory_format, dtype)
    out.copy_(values)
    return out


def as_dense(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` if it is dense (NCHW or channels_last), else a dense copy in ``like``'s layout (or NCHW)."""
    if dense_layout(t) is not None:
        return t
    target = (dense_layout(like) if like is not None else None) or torch.contiguous_format
    return t.contiguous(memory_format=target)


def dense_vector(v: torch.Tensor | None) -> torch.Tensor | None:
    """A per-channel vector with unit stride: kernels index vectors as ``ptr + c``, so a strided
    (``t[::2]``) or expanded (stride 0) vector is copied once, here, before the launch."""
    if v is None or v.numel() <= 1 or v.stride(0) == 1:
        return v
    return v.contiguous()


def max_numel(*tensors: torch.Tensor | None) -> int:
    """The element count of the largest tensor's span (what decides 32- vs 64-bit offsets)."""
    span = 0
    for t in tensors:
        if t is not None and t.numel():
            span = max(span, 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())))
    return span


def needs_int64(*tensors: torch.Tensor | None) -> bool:
    """True when some tensor spans 2**31 elements or more: its kernel then computes offsets in int64."""
    return max_numel(*tensors) >= INT32_LIMIT


def unsupported_dtype_reason(*modules: nn.Module | None) -> str | None:
    """Why a block of these modules cannot run the Triton kernels because of a dtype (a float64 model under
    ``precision="64-true"``), or None: the model rewrite then leaves the block eager and says so."""
    for module in modules:
        if module is None:
            continue
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if tensor is not None and tensor.is_floating_point() and tensor.dtype not in SUPPORTED_DTYPES:
                names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
                dtype = str(tensor.dtype).removeprefix("torch.")
                return f"{type(module).__name__}.{name} is {dtype} (kernels take {names})"
    return None
