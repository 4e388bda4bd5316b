"""Mixup / CutMix as tensor functions: sample ``i`` mixes with sample ``N - 1 - i`` (the batch reversed, as
timm does), images by ``lam`` or by a pasted box, targets into soft ``(N, num_classes)`` targets."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def one_hot_smooth(targets: Tensor, num_classes: int, smoothing: float = 0.0) -> Tensor:
    """int64 (N,) -> float (N, num_classes) with ``smoothing`` spread evenly (timm convention)."""
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    return F.one_hot(targets.long(), num_classes).float() * (on - off) + off


def cutmix_boxes(
    lam: np.ndarray, height: int, width: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes ``[x0, y0, x1, y1]`` of area ~ ``(1 - lam) H W`` with a uniform centre (timm ``rand_bbox``),
    and the area-corrected ``lam``."""
    cut = np.sqrt(1.0 - lam)
    cut_h = (height * cut).astype(np.int64)
    cut_w = (width * cut).astype(np.int64)
    cy = rng.integers(0, height, size=lam.shape)
    cx = rng.integers(0, width, size=lam.shape)
    y0 = np.clip(cy - cut_h // 2, 0, height)
    y1 = np.clip(cy + cut_h // 2, 0, height)
    x0 = np.clip(cx - cut_w // 2, 0, width)
    x1 = np.clip(cx + cut_w // 2, 0, width)
    corrected = 1.0 - (y1 - y0) * (x1 - x0) / float(height * width)
    return np.stack((x0, y0, x1, y1), axis=-1), corrected


def mix_images(images: Tensor, lam: Tensor, cutmix: Tensor, boxes: Tensor) -> Tensor:
    """Per sample: ``lam x + (1 - lam) partner`` (mixup) or the partner pasted into ``boxes`` (cutmix)."""
    x = images.float() if images.dtype == torch.uint8 else images
    n, _, h, w = x.shape
    partner = x.flip(0)
    mixed = torch.lerp(partner, x, lam.to(x.dtype).view(n, 1, 1, 1))  # lam * x + (1 - lam) * partner
    ys = torch.arange(h, device=x.device).view(1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, w)
    inside = (
        (ys >= boxes[:, 1].view(n, 1, 1))
        & (ys < boxes[:, 3].view(n, 1, 1))
        & (xs >= boxes[:, 0].view(n, 1, 1))
        & (xs < boxes[:, 2].view(n, 1, 1))
    ).unsqueeze(1)
    cut = torch.where(inside, partner, x)
    return torch.where(cutmix.view(n, 1, 1, 1), cut, mixed)


def mix_targets(soft: Tensor, lam: Tensor) -> Tensor:
    """``lam * soft + (1 - lam) * soft reversed`` for (N, num_classes) soft targets."""
    lam = lam.to(device=soft.device).view(-1, 1)
    return soft * lam + soft.flip(0) * (1.0 - lam)
