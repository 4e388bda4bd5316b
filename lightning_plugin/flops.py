"""Peak FLOP/s of the device, and FLOPs of a model, for model-FLOPs utilisation (MFU).

Lightning's table (``get_available_flops``) keys the H200 as ``"h200 sxm1"``/``"h200 nvl1"``
(the "1" is a datasheet footnote), so ``"NVIDIA H200"`` gets no MFU at all, and its H200
entries are the *with sparsity* figures while its H100 entries are dense. Our table
covers the Hopper parts with dense tensor-core figures and falls back to Lightning's
table for every other chip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch import nn

__all__ = ["HOPPER_PEAK_FLOPS", "measure_forward_flops", "peak_flops", "training_flops_per_sample"]

DtypeKey = torch.dtype | str

# The H200 is an H100 with more and faster memory: the same tensor cores, so the same peaks per form factor.
_HOPPER_SXM: dict[DtypeKey, float] = {
    torch.float64: 67e12,  # FP64 tensor core
    torch.float32: 67e12,
    "tfloat32": 494.5e12,
    torch.bfloat16: 989.5e12,
    torch.float16: 989.5e12,
    torch.float8_e4m3fn: 1979e12,
    torch.int8: 1979e12,
}

_HOPPER_NVL: dict[DtypeKey, float] = {
    torch.float64: 60e12,
    torch.float32: 60e12,
    "tfloat32": 417.5e12,
    torch.bfloat16: 835.5e12,
    torch.float16: 835.5e12,
    torch.float8_e4m3fn: 1670.5e12,
    torch.int8: 1670.5e12,
}

#: Dense peak FLOP/s per GPU from NVIDIA's H100 and H200 datasheets (tensor-core figures
#: halved where the sheet quotes them with 2:4 sparsity). "tfloat32" is fp32 matmuls
#: with TF32 allowed (``torch.get_float32_matmul_precision() != "highest"``).
HOPPER_PEAK_FLOPS: dict[str, dict[DtypeKey, float]] = {
    "h200 sxm": dict(_HOPPER_SXM),
    "h200 nvl": dict(_HOPPER_NVL),
    "h100 sxm": dict(_HOPPER_SXM),
    "h100 nvl": dict(_HOPPER_NVL),
    "h100 pcie": {
        torch.float64: 51e12,
        torch.float32: 51e12,
        "tfloat32": 378e12,
        torch.bfloat16: 756.5e12,  # the sheet's 1,513 with sparsity (Lightning rounds to 756e12)
        torch.float16: 756.5e12,
        torch.float8_e4m3fn: 1513e12,
        torch.int8: 1513e12,
    },
}


def hopper_chip(device_name: str) -> str | None:
    """The key of :data:`HOPPER_PEAK_FLOPS` for a ``torch.cuda.get_device_name`` string, or None."""
    name = device_name.lower()
    for family in ("h200", "h100"):
        if family not in name:
            continue
        if "nvl" in name:
            return f"{family} nvl"
        if family == "h100" and ("pcie" in name or "hbm2e" in name):
            return "h100 pcie"
        return f"{family} sxm"  # "NVIDIA H200", "NVIDIA H100 80GB HBM3"; GH200's GPU has the same peaks
    return None


def peak_flops(device: torch.device, dtype: torch.dtype, device_name: str | None = None) -> float | None:
    """Theoretical dense peak FLOP/s of one ``device`` computing in ``dtype``; None when unknown (e.g. CPU).

    ``device_name`` overrides ``torch.cuda.get_device_name(device)`` (for tests and offline use).
    """
    if device.type != "cuda":
        return None
    name = device_name if device_name is not None else torch.cuda.get_device_name(device)
    chip = hopper_chip(name)
    if chip is None:
        if device_name is not None:
            return None  # Lightning's lookup reads the real device name; don't mix the two
        found = get_available_flops(device, dtype)
        return float(found) if found else None
    key: DtypeKey = dtype
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        key = "tfloat32"
    value = HOPPER_PEAK_FLOPS[chip].get(key)
    return float(value) if value is not None else None


def measure_forward_flops(module: nn.Module, example_input: Any) -> int:
    """FLOPs of one forward pass of the *uncompiled* ``module`` on ``example_input``.

    Runs in eval mode under ``no_grad`` so no running statistics or gradients change, and
    calls the class's ``forward`` so an in-place compiled ``forward`` is bypassed.
    """
    from torch.utils.flop_counter import FlopCounterMode

    was_training = module.training
    forward: Callable[..., Any] = type(module).forward
    module.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            if isinstance(example_input, (tuple, list)):
                forward(module, *example_input)
            elif isinstance(example_input, dict):
                forward(module, **example_input)
            else:
                forward(module, example_input)
    finally:
        module.train(was_training)
    return int(counter.get_total_flops())


def training_flops_per_sample(forward_flops: int, batch_size: int) -> float:
    """Training FLOPs per sample, estimated as 3x the forward FLOPs (backward costs about 2x forward)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return 3.0 * forward_flops / batch_size
