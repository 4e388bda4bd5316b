"""``AugmentConfig`` -> a ``lcv_vision.data`` training ``Pipeline``.

The order is fixed and follows the references: geometry on uint8 (crop/translate, flip), then
TrivialAugment (wants uint8), colour jitter, normalisation, erasing/cutout in normalised units (fill 0 =
the mean colour) and mixing last, because it changes the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lcv_vision.data.color import ColorJitter, Normalize
from lcv_vision.data.erasing import CoarseDropout, Erasing
from lcv_vision.data.geometry import AlternatingFlipCrop, HorizontalFlip, RandomCrop, RandomResizedCrop
from lcv_vision.data.mixing import MixupCutmix
from lcv_vision.data.ops import BatchOp
from lcv_vision.data.pipeline import Pipeline
from lcv_vision.data.trivial_augment import TrivialAugmentWide
from lcv_vision.recipes._recipe import AugmentConfig

__all__ = ["build_train_pipeline"]


def build_train_pipeline(
    augment: AugmentConfig,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    image_size: int,
    num_classes: int,
    epoch: Callable[[], int] = lambda: 0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Pipeline:
    """The training pipeline described by ``augment``.

    Args:
        augment: the recipe's augmentation.
        mean, std: normalisation (0..1 units, as the DataModules give them).
        image_size: output side of a random resized crop.
        num_classes: for mixup/cutmix soft targets.
        epoch: current epoch, read by the alternating flip.
        seed: seed of the alternating flip's per-image bits.
        dtype: output dtype.
    """
    augment.validate()
    ops: list[BatchOp] = []
    if augment.rrc_scale is not None:
        ops.append(RandomResizedCrop(image_size, scale=augment.rrc_scale))
        if augment.flip == "alternating":
            raise ValueError("augment.flip='alternating' needs a fixed-size crop, not a random resized crop")
        if augment.flip == "random":
            ops.append(HorizontalFlip(0.5))
    elif augment.flip == "alternating":
        ops.append(
            AlternatingFlipCrop(
                None, padding=augment.crop_padding, padding_mode=augment.padding_mode, epoch=epoch, seed=seed
            )
        )
    else:
        if augment.crop_padding:
            ops.append(RandomCrop(None, padding=augment.crop_padding, padding_mode=augment.padding_mode))
        if augment.flip == "random":
            ops.append(HorizontalFlip(0.5))
    if augment.trivial_augment:
        ops.append(TrivialAugmentWide())
    if augment.color_jitter:
        s = augment.color_jitter
        ops.append(ColorJitter(brightness=s, contrast=s, saturation=s, hue=0.0, p=1.0))
    ops.append(Normalize(tuple(mean), tuple(std)))
    if augment.cutout:
        side = float(augment.cutout)
        ops.append(CoarseDropout((1, 1), (side, side), (side, side), fill=0.0, p=1.0))
    if augment.random_erase:
        ops.append(Erasing(p=augment.random_erase, fill=0.0))
    if augment.mixup_alpha or augment.cutmix_alpha:
        # Label smoothing stays in the loss (ClassificationModule), so the targets here are plain one-hot
        # mixes.
        ops.append(
            MixupCutmix(
                num_classes, mixup_alpha=augment.mixup_alpha, cutmix_alpha=augment.cutmix_alpha, mode="batch"
            )
        )
    return Pipeline(ops, dtype=dtype)
