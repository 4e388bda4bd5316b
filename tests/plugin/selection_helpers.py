"""What the kernel selection tests share: tiny blocks, a fake clock, and ``select_kernels`` set up for CPU."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_plugin import CompileConfig
from lightning_plugin.kernel_choice.selection import select_kernels

EAGER = CompileConfig(backend="eager")  # both sides compiled by dynamo with the eager backend: fast on CPU


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


def chain(*channels: int) -> nn.Sequential:
    """Blocks ``channels[i] -> channels[i+1]``; the outer Sequential holds no chain itself, so only the
    blocks are rewritten (paths "0", "1", ...)."""
    return nn.Sequential(*(conv_block(a, b) for a, b in zip(channels[:-1], channels[1:])))


class FakeClock:
    """Seconds per step by the block's input shape (``signature.inputs``); records every call."""

    def __init__(self, times: dict[str, tuple[float, float]]) -> None:
        self.times = times  # inputs -> (fused seconds, Inductor seconds)
        self.default: tuple[float, float] | None = None  # for inputs not in ``times``
        self.calls: list[tuple[str, str]] = []

    def __call__(self, step, *, arm, signature, device) -> float:
        self.calls.append((arm, signature.inputs))
        timing = self.times.get(signature.inputs, self.default)
        if timing is None:
            raise KeyError(f"FakeClock has no timing for inputs {signature.inputs}")
        fused, inductor = timing
        return fused if arm == "fused" else inductor


def select(model: nn.Module, x: torch.Tensor, timer, cache_dir: Path, **kwargs):
    """``select_kernels`` with both sides compiled by the eager backend (fast on CPU) and a private cache."""
    return select_kernels(model, x, timer=timer, cache_dir=str(cache_dir), **{"config": EAGER, **kwargs})


def use_reference_ops(monkeypatch) -> None:
    """The fused ops on their PyTorch references, and ATen's own convolutions instead of oneDNN's.

    oneDNN capped at AVX2 (torch 2.14.1) returns a wrong fp32 weight gradient for a strided 1x1 conv on a
    channels_last input, from the second such call in a process on; a block holding one (a ResNet
    downsample left eager inside the measured block) then fails the selection's correctness check on AVX2
    machines only. Tests about the selection's structure must not depend on the CPU's vector width.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
