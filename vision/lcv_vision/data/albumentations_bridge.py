"""Translate an ``albumentations.Compose`` into a batched :class:`~lcv_vision.data.pipeline.Pipeline`.

Supported (with their parameters and probabilities): HorizontalFlip, VerticalFlip, RandomResizedCrop,
RandomCrop, CenterCrop, Resize (bilinear), Pad, PadIfNeeded (centred), ColorJitter, ToGray (weighted
average), Normalize ("standard"), CoarseDropout and Erasing (constant fill), ToTensorV2 (a no-op here).
Anything else raises one ``ValueError`` that lists every transform that could not be translated.
A ``Pad`` directly followed by a ``RandomCrop`` becomes one fused padded crop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lcv_vision.data.color import ColorJitter, Normalize, ToGray
from lcv_vision.data.erasing import CoarseDropout, Erasing
from lcv_vision.data.geometry import (
    CenterCrop,
    HorizontalFlip,
    Pad,
    PaddingMode,
    PadIfNeeded,
    RandomCrop,
    RandomResizedCrop,
    Resize,
    VerticalFlip,
)
from lcv_vision.data.ops import BatchOp
from lcv_vision.data.pipeline import Pipeline


class UnsupportedTransformError(ValueError):
    """Some albumentations transforms have no batched equivalent."""


def _border(t: Any) -> PaddingMode:
    import cv2

    modes: dict[int, PaddingMode] = {
        cv2.BORDER_CONSTANT: "constant",
        cv2.BORDER_REFLECT_101: "reflect",
        cv2.BORDER_REFLECT: "symmetric",
        cv2.BORDER_REPLICATE: "edge",
    }
    if t.border_mode not in modes:
        raise _Unsupported(f"border_mode={t.border_mode} (only CONSTANT, REFLECT_101, REFLECT, REPLICATE)")
    return modes[t.border_mode]


class _Unsupported(Exception):
    pass


def _need_p1(t: Any) -> None:
    if t.p != 1.0:
        raise _Unsupported(f"p={t.p} (only p=1 is supported: it changes the output size)")


def _need_linear(t: Any) -> None:
    import cv2

    if t.interpolation != cv2.INTER_LINEAR or getattr(t, "area_for_downscale", None) is not None:
        raise _Unsupported("only interpolation=cv2.INTER_LINEAR without area_for_downscale")


def _fill(t: Any) -> Any:
    if isinstance(t.fill, str):
        raise _Unsupported(f"fill={t.fill!r} (only constant fills)")
    return t.fill


def _rrc(t: Any) -> BatchOp:
    _need_p1(t)
    _need_linear(t)
    return RandomResizedCrop(t.size, t.scale, t.ratio)


def _random_crop(t: Any) -> BatchOp:
    _need_p1(t)
    if t.pad_if_needed:
        raise _Unsupported("pad_if_needed=True (use PadIfNeeded before RandomCrop)")
    return RandomCrop((t.height, t.width))


def _center_crop(t: Any) -> BatchOp:
    _need_p1(t)
    if t.pad_if_needed:
        raise _Unsupported("pad_if_needed=True")
    return CenterCrop((t.height, t.width))


def _resize(t: Any) -> BatchOp:
    _need_p1(t)
    _need_linear(t)
    return Resize((t.height, t.width))


def _pad(t: Any) -> BatchOp:
    _need_p1(t)
    return Pad(t.padding, _border(t), _fill(t))


def _pad_if_needed(t: Any) -> BatchOp:
    _need_p1(t)
    if t.pad_height_divisor is not None or t.pad_width_divisor is not None or t.position != "center":
        raise _Unsupported("only position='center' without pad_*_divisor")
    return PadIfNeeded(t.min_height, t.min_width, _border(t), _fill(t))


def _to_gray(t: Any) -> BatchOp:
    if t.method != "weighted_average" or t.num_output_channels != 3:
        raise _Unsupported("only method='weighted_average' with num_output_channels=3")
    return ToGray(t.p)


def _normalize(t: Any) -> BatchOp:
    _need_p1(t)
    if t.normalization != "standard" or t.mean is None or t.std is None:
        raise _Unsupported("only normalization='standard' with mean and std")
    return Normalize(t.mean, t.std, t.max_pixel_value)


_TRANSLATORS: dict[str, Callable[[Any], BatchOp | None]] = {
    "HorizontalFlip": lambda t: HorizontalFlip(t.p),
    "VerticalFlip": lambda t: VerticalFlip(t.p),
    "RandomResizedCrop": _rrc,
    "RandomCrop": _random_crop,
    "CenterCrop": _center_crop,
    "Resize": _resize,
    "Pad": _pad,
    "PadIfNeeded": _pad_if_needed,
    "ColorJitter": lambda t: ColorJitter(t.brightness, t.contrast, t.saturation, t.hue, t.p),
    "ToGray": _to_gray,
    "Normalize": _normalize,
    "CoarseDropout": lambda t: CoarseDropout(
        t.num_holes_range, t.hole_height_range, t.hole_width_range, _fill(t), t.p
    ),
    "Erasing": lambda t: Erasing(t.scale, t.ratio, _fill(t), t.p),
    "ToTensorV2": lambda t: None,
}


def _fuse_pad_crop(ops: list[BatchOp]) -> list[BatchOp]:
    out: list[BatchOp] = []
    for op in ops:
        prev = out[-1] if out else None
        if isinstance(op, RandomCrop) and type(prev) is Pad and not any(op.padding) and op.p == 1.0:
            out[-1] = RandomCrop(op.size, prev.padding, prev.padding_mode, prev.fill)
        else:
            out.append(op)
    return out


def from_albumentations(
    compose: Any, dtype: torch.dtype = torch.float32, channels_last: bool = True, compile: bool = True
) -> Pipeline:
    """Batched equivalent of an ``A.Compose`` (or a list of transforms); raises listing what is
    unsupported."""
    transforms = getattr(compose, "transforms", compose)
    if not isinstance(transforms, (list, tuple)) and not hasattr(transforms, "__iter__"):
        raise TypeError(
            f"from_albumentations: expected an A.Compose or a list of transforms, got {compose!r}"
        )
    if getattr(compose, "p", 1.0) != 1.0:
        raise UnsupportedTransformError(
            f"from_albumentations: Compose(p={compose.p}) is not supported (use p=1)"
        )
    ops: list[BatchOp] = []
    problems: list[str] = []
    for t in transforms:
        name = type(t).__name__
        translate = _TRANSLATORS.get(name)
        if translate is None:
            problems.append(f"{name} (no batched equivalent)")
            continue
        try:
            op = translate(t)
        except _Unsupported as err:
            problems.append(f"{name}: {err}")
            continue
        if op is not None:
            ops.append(op)
    if problems:
        raise UnsupportedTransformError(
            "from_albumentations cannot translate: "
            + "; ".join(problems)
            + f". Supported: {', '.join(sorted(_TRANSLATORS))}"
        )
    return Pipeline(_fuse_pad_crop(ops), dtype=dtype, channels_last=channels_last, compile=compile)
