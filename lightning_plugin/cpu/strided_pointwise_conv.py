"""Strided 1x1 convolutions with few input channels, computed as stride-1 convolutions of a subsampled input.

Why: oneDNN's AVX2 1x1 convolution computes the weight gradient of a strided, channels-last 1x1 convolution
with fewer input channels (per group) than its block of 8 through a workspace it overruns
(uxlfoundation/oneDNN#6035): on an AVX2-only CPU the backward segfaults, spins forever in native code (no
Python timeout can stop it) or returns a wrong weight gradient; capped at AVX2 on an AVX-512 CPU
(``ONEDNN_MAX_CPU_ISA=AVX2``) the gradient is wrong. A 1x1 convolution with stride ``s`` and no padding reads
exactly the pixels ``x[..., ::s, ::s]``, so a stride-1 convolution of that view gives the same output and
gradients along oneDNN's stride-1 path, which is correct (the view is copied once a call: such layers have
fewer than 8 input channels). It is applied on every CPU, which also covers a process whose oneDNN is capped
at AVX2 without having to read the cap; its speed was not measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ONEDNN_AVX2_INPUT_CHANNEL_BLOCK",
    "SubsampledPointwiseConv2d",
    "restore_convs",
    "subsample_strided_pointwise_convs",
]

#: Input channels per group below which oneDNN's AVX2 1x1 weight gradient overruns its workspace.
ONEDNN_AVX2_INPUT_CHANNEL_BLOCK = 8


class SubsampledPointwiseConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (1x1, strided, unpadded) that convolves ``input[..., ::sh, ::sw]`` with stride 1.

    Same parameters, ``stride`` attribute, ``state_dict`` and output as the convolution it replaces."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        row_step, column_step = self.stride
        return F.conv2d(input[..., ::row_step, ::column_step], self.weight, self.bias, 1, 0, 1, self.groups)


def _affected(module: nn.Module) -> bool:
    return (
        type(module) is nn.Conv2d
        and module.kernel_size == (1, 1)
        and module.stride != (1, 1)
        and module.padding in ((0, 0), "valid")
        and module.in_channels // module.groups < ONEDNN_AVX2_INPUT_CHANNEL_BLOCK
    )


def subsample_strided_pointwise_convs(root: nn.Module) -> list[nn.Conv2d]:
    """Turn each affected ``nn.Conv2d`` under ``root`` into a :class:`SubsampledPointwiseConv2d` in place
    (its class only: parameters, hooks and names stay); return them, for :func:`restore_convs`."""
    changed: list[nn.Conv2d] = []
    for module in root.modules():
        if _affected(module):
            module.__class__ = SubsampledPointwiseConv2d
            changed.append(module)  # type: ignore[arg-type]  # an nn.Conv2d, checked by _affected
    return changed


def restore_convs(convs: list[nn.Conv2d]) -> None:
    """Undo :func:`subsample_strided_pointwise_convs`."""
    for conv in convs:
        if type(conv) is SubsampledPointwiseConv2d:
            conv.__class__ = nn.Conv2d  # type: ignore[assignment]  # back to the class it had
