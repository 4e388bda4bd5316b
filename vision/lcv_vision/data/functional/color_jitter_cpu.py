"""The CPU colour jitter as a C++ kernel (``color_jitter_cpu.cpp``), built on first use.

:class:`~lcv_vision.data.color.ColorJitter` runs it on CPU tensors in place of the torch ops: each sample runs
only its own steps that change something, in its own order, on tiles of a few thousand pixels that stay in
the L1 cache through all the steps (the torch paths make a pass over the batch per step, or run every sample
through the fixed seven-step sequence of :func:`~lcv_vision.data.functional.color.jitter_tables`), and a
folded Normalize is applied as the tile is stored, straight into the pipeline's output tensor.  The call
releases the GIL, so the pipeline's worker threads run it in parallel; it has no threads of its own.

The kernel is built with ``torch.utils.cpp_extension.load`` (``-O3 -march=native``, see ``FLAGS``) into
torch's extension cache folder (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) the
first time a process needs it, and loaded from there afterwards (rebuilt when the source or the flags
change).  Without a C++
compiler (or ninja), or if the build fails, :func:`kernel` returns None after one warning that says why, and
the pipeline keeps its torch path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from types import ModuleType

import torch
from torch import Tensor

from lcv_kernels.cpp_extension_notice import quiet_cpp_extension_notice

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "color_jitter_cpu.cpp")


def _cpu_tag() -> str:
    """A short hash of this CPU's instruction-set flags: ``-march=native`` builds for the CPU at hand, and a cache
    folder shared by machines of different CPUs must not hand one's build to another."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


#: The extension's name (its folder in the cache): the signature's version and the CPU it is built for.
NAME = f"lcv_color_jitter_cpu_v1_{_cpu_tag()}"
#: ``-mprefer-vector-width=512`` (x86 only): where the CPU has AVX-512, GCC would otherwise use 256-bit
#: vectors (the hue step took 0.14 instead of 0.09 ms per 224 px image on this project's 2-core AVX-512 CPU).
FLAGS = ["-O3", "-march=native"] + (
    ["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else []
)

_lock = threading.Lock()
#: ``{"module": the loaded extension or None}`` once :func:`kernel` has tried (tests reset it).
_state: dict[str, ModuleType | None] = {}


# cpp_extension logs "No CUDA runtime is found" on import with a CUDA build of torch and no GPU: not for a CPU build.
quiet_cpp_extension_notice()


def build() -> ModuleType:
    """Compile (or load from the cache) and import the extension; raises if it cannot."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name=NAME, sources=[SOURCE], extra_cflags=FLAGS, verbose=False)


def kernel() -> ModuleType | None:
    """The extension, built on the first call; None (after one warning naming why) where it cannot be."""
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = build()
            except Exception as err:  # no compiler, no ninja, a failed build: the torch path still works
                _state["module"] = None
                lines = str(err).strip().splitlines()
                warnings.warn(
                    f"ColorJitter: the C++ CPU kernel could not be built ({type(err).__name__}: "
                    f"{lines[0] if lines else 'no message'}); colour jitter on the CPU runs the torch ops",
                    stacklevel=3,
                )
        return _state["module"]


def color_jitter_into(
    images: Tensor,
    out: Tensor,
    brightness: Tensor,
    contrast: Tensor,
    saturation: Tensor,
    hue: Tensor,
    order: Tensor,
    scale: Tensor | None = None,
    bias: Tensor | None = None,
    apply_hue: bool = True,
) -> bool:
    """:func:`~lcv_vision.data.functional.color.color_jitter` of ``images`` (then ``x * scale + bias`` per sample
    and channel, when given) written into ``out``; False (nothing written) where the kernel cannot run it.

    ``images``: (N, C, H, W) uint8 or float32 on the CPU, C 1 or 3, any strides; ``out``: float32 of the
    same shape, any strides (contiguous or channels_last), not overlapping ``images``; the factors (N,),
    ``order`` (N, 4) as in ``color_jitter``; ``scale``/``bias`` (N, C).
    """
    ext = kernel() if _usable(images, out) else None
    if ext is None:
        return False
    n, c, h, w = images.shape
    factors = torch.stack((brightness, contrast, saturation, hue), dim=1).to(torch.float32).contiguous()
    order = order.to(torch.int64).contiguous()
    if factors.shape != (n, 4) or order.shape != (n, 4):
        raise ValueError(f"color_jitter_into: per-sample factors and order (N, 4) for N={n}")
    if scale is not None and bias is not None:
        scale = scale.to(torch.float32).expand(n, c).contiguous()
        bias = bias.to(torch.float32).expand(n, c).contiguous()
    if n == 0 or h * w == 0:
        return True
    ext.color_jitter(
        images.data_ptr(),
        images.dtype == torch.uint8,
        list(images.stride()),
        out.data_ptr(),
        list(out.stride()),
        n,
        c,
        h,
        w,
        factors.data_ptr(),
        order.data_ptr(),
        scale.data_ptr() if scale is not None and bias is not None else 0,
        bias.data_ptr() if scale is not None and bias is not None else 0,
        bool(apply_hue),
    )
    return True


def _usable(images: Tensor, out: Tensor) -> bool:
    """Whether the kernel handles these tensors (else the caller runs the torch ops)."""
    return (
        images.device.type == "cpu"
        and out.device.type == "cpu"
        and images.dim() == 4
        and images.shape[1] in (1, 3)
        and images.dtype in (torch.uint8, torch.float32)
        and out.dtype == torch.float32
        and out.shape == images.shape
        and not images.requires_grad
        and not out.requires_grad
        and not _overlap(images, out)
        and not torch.compiler.is_compiling()
    )


def _overlap(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    ua, ub = a.untyped_storage(), b.untyped_storage()
    return ua.data_ptr() < ub.data_ptr() + ub.nbytes() and ub.data_ptr() < ua.data_ptr() + ua.nbytes()
