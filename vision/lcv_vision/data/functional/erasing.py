"""Cutout / random erasing as a tensor function: up to K rectangular holes per sample, one masked write.

Holes are (N, K, 4) boxes ``[x_min, y_min, x_max, y_max]`` (exclusive max, albumentations' order); unused
slots are empty boxes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def fill_is_uint8(fill: float | Sequence[float]) -> bool:
    """Whether ``fill`` (scalar or per channel) is whole numbers in 0..255: uint8 images can then stay
    uint8."""
    values = [fill] if isinstance(fill, (int, float)) else list(fill)
    return all(0 <= float(v) <= 255 and float(v) == round(float(v)) for v in values)


def fill_holes(images: Tensor, holes: Tensor, fill: float | Sequence[float] = 0.0) -> Tensor:
    """Set every pixel inside any of each sample's ``holes`` (N, K, 4) to ``fill`` (scalar or per channel).

    The fill is in the units the images have (0..255 before normalizing, normalized after); uint8 images stay
    uint8 when the fill is a whole number in 0..255, else they become float32.
    """
    n, c, h, w = images.shape
    device = images.device
    holes = holes.to(device)
    ys = torch.arange(h, device=device).view(1, 1, h)
    xs = torch.arange(w, device=device).view(1, 1, w)
    in_rows = (ys >= holes[..., 1:2]) & (ys < holes[..., 3:4])  # (N, K, H)
    in_cols = (xs >= holes[..., 0:1]) & (xs < holes[..., 2:3])  # (N, K, W)
    mask = (in_rows.unsqueeze(-1) & in_cols.unsqueeze(-2)).any(dim=1, keepdim=True)  # (N, 1, H, W)
    values = [float(fill)] if isinstance(fill, (int, float)) else [float(v) for v in fill]
    if len(values) not in (1, c):
        raise ValueError(f"fill has {len(values)} values for images with {c} channels")
    x = images if images.dtype != torch.uint8 or fill_is_uint8(fill) else images.float()
    fill_t = torch.tensor(values, dtype=x.dtype, device=device).view(1, len(values), 1, 1)
    return torch.where(mask, fill_t, x)
