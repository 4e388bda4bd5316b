"""Helpers shared by the kernel families: where to run, which activations, which dtypes.

Kept small and stable on purpose: other kernel modules (conv, norm) import from here.
"""

from __future__ import annotations

import os

import torch

#: Activation names every fused epilogue understands, in the order of their integer codes.
ACTIVATIONS: tuple[str, ...] = ("none", "relu", "gelu", "silu")

#: Input dtypes the Triton kernels accept; accumulation is always fp32.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run (slowly) on CPU tensors in numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton ships with Linux torch wheels
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for ``t``? Yes on CUDA, or on CPU when the interpreter is on.

    Otherwise callers run their PyTorch reference, so every op works on a machine without a GPU.
    """
    if not triton_available():
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreter_enabled()


def activation_code(name: str) -> int:
    """Integer code of an activation name for a ``tl.constexpr`` switch; raises naming the choices."""
    try:
        return ACTIVATIONS.index(name)
    except ValueError:
        raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}") from None


def check_dtype(t: torch.Tensor, what: str) -> None:
    """Raise a TypeError naming ``what`` if ``t`` is not fp32, fp16 or bf16."""
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what} has dtype {t.dtype}; supported dtypes are {names}")


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
    """d act(u) / du, elementwise, in plain PyTorch (used by the backward of fused epilogues)."""
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
