"""What this process's CPU offers the kernels: its name, ATen's instruction set and AMX.

One place for the facts that decide CPU kernel speed (oneDNN's int8 and bf16 paths hang on VNNI and AMX): the
deploy packages record them and check them on load, and benchmark results name them.
"""

from __future__ import annotations

import platform

import torch

__all__ = ["amx_supported", "cpu_capability", "cpu_name"]


def cpu_capability() -> str:
    """The instruction set ATen (and Inductor's generated code) uses on this CPU: ``AVX512``, ``AVX2`` ..."""
    return str(torch.backends.cpu.get_cpu_capability())


def amx_supported() -> bool:
    """Whether this CPU has AMX tiles (bf16 and int8 matrix units): where bf16 inference is fast on the CPU."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def cpu_name() -> str | None:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what :mod:`platform` knows), or None."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or None
