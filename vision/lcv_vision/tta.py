"""Test-time augmentation: average a classifier's logits over flipped and shifted views.

airbench's ``tta_level=2``: the image and its mirror (0.5 of the weight), plus both mirrored
copies shifted one pixel up-left and down-right through a reflect pad (0.25 each).
Averaging *logits* (not probabilities) follows airbench.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["TTA_MODES", "predict_with_tta"]

TTAMode = Literal["none", "flip", "flip_translate"]
TTA_MODES: tuple[str, ...] = ("none", "flip", "flip_translate")


def _mirror_average(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    return 0.5 * model(images) + 0.5 * model(images.flip(-1))


def predict_with_tta(
    model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, mode: TTAMode = "flip"
) -> torch.Tensor:
    """Logits of ``model`` on ``images`` (N, C, H, W), averaged over the views of ``mode``.

    ``"none"``: one view. ``"flip"``: image and horizontal mirror. ``"flip_translate"``: six views
    (mirror x {no shift, 1 px up-left, 1 px down-right}) weighted 0.5 / 0.25 / 0.25.
    """
    if mode not in TTA_MODES:
        raise ValueError(f"unknown TTA mode {mode!r}; choose one of {list(TTA_MODES)}")
    if images.dim() != 4:
        raise ValueError(f"TTA needs a batch of images (N, C, H, W), got shape {tuple(images.shape)}")
    if mode == "none":
        return model(images)
    if mode == "flip":
        return _mirror_average(model, images)
    h, w = images.shape[-2:]
    padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
    up_left = padded[..., 0:h, 0:w]
    down_right = padded[..., 2 : h + 2, 2 : w + 2]
    return (
        0.5 * _mirror_average(model, images)
        + 0.25 * _mirror_average(model, up_left.contiguous(memory_format=_format_of(images)))
        + 0.25 * _mirror_average(model, down_right.contiguous(memory_format=_format_of(images)))
    )


def _format_of(images: torch.Tensor) -> torch.memory_format:
    """Keep channels_last inputs channels_last after slicing (a compiled model guards on strides)."""
    return (
        torch.channels_last
        if images.is_contiguous(memory_format=torch.channels_last)
        else torch.contiguous_format
    )
