"""Batched geometric ops: crops (with padding), flips, random resized crop, resize, centre crop.

The ops draw parameters and build per-sample index tables; the pixels are moved by
:mod:`lcv_vision.data.functional.geometry` (one gather per batch).  Integer crops keep the input dtype (uint8);
resizing ops return float32 in 0..255 units, except on the CPU for uint8 images and whole-pixel boxes
(random resized crops, resizes), where they return uint8 rounded like OpenCV's (see ``resize_boxes``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lcv_vision.data.functional.geometry import (
    BORDER_MODES,
    crop_tables,
    gather_crop,
    random_crop_params,
    random_resized_crop_params,
    resample,
    resample_tables,
    resize_boxes,
    whole_pixel_boxes,
)
from lcv_vision.data.ops import FLIP_AFTER, BatchOp, Params, RaggedBatch, bernoulli, check_p

PaddingMode = Literal["constant", "reflect", "symmetric", "edge"]


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(size, int):
        out = (size, size)
    else:
        values = tuple(int(s) for s in size)
        if len(values) != 2:
            raise ValueError(f"{name} must be an int or (height, width), got {size!r}")
        out = (values[0], values[1])
    if min(out) <= 0:
        raise ValueError(f"{name} must be positive, got {size!r}")
    return out


def _padding4(padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    """(left, top, right, bottom), accepting an int, (pad_x, pad_y) or 4 values (albumentations order)."""
    pads: tuple[int, int, int, int]
    if isinstance(padding, int):
        pads = (padding, padding, padding, padding)
    else:
        p = tuple(int(v) for v in padding)
        if len(p) == 2:
            pads = (p[0], p[1], p[0], p[1])
        elif len(p) == 4:
            pads = (p[0], p[1], p[2], p[3])
        else:
            raise ValueError(
                f"padding must be an int, (pad_x, pad_y) or (left, top, right, bottom), got {padding!r}"
            )
    if min(pads) < 0:
        raise ValueError(f"padding must be non-negative, got {padding!r}")
    return pads


def _check_mode(mode: str, name: str) -> None:
    if mode not in BORDER_MODES:
        raise ValueError(f"{name}: padding_mode must be one of {BORDER_MODES}, got {mode!r}")


def _flip(params: Params) -> Tensor | None:
    """The op's own ``flip`` (if any) combined with a horizontal flip folded in after it."""
    own, after = params.get("flip"), params.get(FLIP_AFTER)
    if own is None or after is None:
        return own if after is None else after
    return own ^ after


def _shape_of(images: Any) -> tuple[int, ...]:
    canvas = images.canvas if isinstance(images, RaggedBatch) else images
    return tuple(int(s) for s in canvas.shape)


class _Crop(BatchOp):
    """An integer crop (with padding) per sample: one gather, uint8 stays uint8, mirrors for free."""

    fuses_gather = True
    folds = frozenset({FLIP_AFTER})
    prepares_on_device = True
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    padding_mode: PaddingMode = "constant"
    fill: float = 0.0

    def _crop_size(self, height: int, width: int) -> tuple[int, int]:
        raise NotImplementedError

    def _offsets(self, params: Params, n: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        return params["top"], params["left"]

    def _padding_for(self, height: int, width: int) -> tuple[int, int, int, int]:
        return self.padding

    def prepare(self, params: Params, shape: Sequence[int], index: Tensor | None = None) -> Params:
        height, width = int(shape[-2]), int(shape[-1])
        n = index.shape[0] if index is not None else int(shape[0])
        top, left = self._offsets(params, n, height, width)
        flip = _flip(params)
        tables = crop_tables(
            top,
            left,
            self._crop_size(height, width),
            (height, width),
            self._padding_for(height, width),
            self.padding_mode,
            flip,
        )
        return {**params, **tables}

    def apply(self, images: Tensor, params: Params, index: Tensor | None = None) -> Tensor:
        if "rows" not in params:  # called directly, not by a Pipeline
            params = self.prepare(params, _shape_of(images), None if index is None else index.cpu())
        tables: dict[str, Tensor] = {
            k: params[k].to(images.device) for k in ("rows", "cols", "row_ok", "col_ok") if k in params
        }
        return gather_crop(images, tables, self.fill, None if index is None else index.to(images.device))


class RandomCrop(_Crop):
    """Random ``size`` crop per sample after padding each side (the CIFAR "pad 4 + crop 32" augmentation).

    Args:
        size: output (height, width) or an int; ``None`` keeps the input size (a random translation).
        padding: int, (pad_x, pad_y) or (left, top, right, bottom) pixels added before cropping.
        padding_mode: ``constant`` (``fill``), ``reflect`` (cv2 BORDER_REFLECT_101), ``symmetric``
            (cv2 BORDER_REFLECT) or ``edge`` (cv2 BORDER_REPLICATE).
        fill: constant fill value in pixel units (0..255).
        p: probability per sample; samples not cropped get the centre crop of the padded image.
    """

    def __init__(
        self,
        size: int | Sequence[int] | None,
        padding: int | Sequence[int] = 0,
        padding_mode: PaddingMode = "constant",
        fill: float = 0.0,
        p: float = 1.0,
    ):
        _check_mode(padding_mode, "RandomCrop")
        check_p(p, "RandomCrop")
        self.size = None if size is None else _pair(size, "RandomCrop size")
        self.padding = _padding4(padding)
        self.padding_mode = padding_mode
        self.fill = float(fill)
        self.p = p

    def _padded(self, height: int, width: int) -> tuple[int, int]:
        left, top, right, bottom = self.padding
        return height + top + bottom, width + left + right

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size if self.size is not None else (int(height), int(width))

    def _crop_size(self, height: int, width: int) -> tuple[int, int]:
        return self.output_size(height, width)

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        size = self.output_size(height, width)
        ph, pw = self._padded(int(height), int(width))
        params = random_crop_params(n, ph, pw, size, generator)
        if self.p < 1.0:
            keep = bernoulli(n, self.p, generator)
            params["top"] = torch.where(keep, params["top"], torch.tensor((ph - size[0]) // 2))
            params["left"] = torch.where(keep, params["left"], torch.tensor((pw - size[1]) // 2))
        return params


def RandomTranslate(max_shift: int, fill: float = 0.0, padding_mode: PaddingMode = "constant") -> RandomCrop:
    """Shift each image by a random integer in ``[-max_shift, max_shift]`` per axis, keeping its size."""
    if max_shift < 0:
        raise ValueError(f"RandomTranslate: max_shift must be >= 0, got {max_shift}")
    return RandomCrop(None, padding=max_shift, padding_mode=padding_mode, fill=fill)


class AlternatingFlipCrop(RandomCrop):
    """Random pad-and-crop (translate) plus airbench's *alternating* horizontal flip, in one gather.

    Alternating flip (Jordan 2024, arXiv 2404.00498): each image gets a fixed random bit; in even epochs the
    images whose bit is set are mirrored, in odd epochs exactly the others. Every image is then seen both ways
    every two epochs, which cuts the steps to 94% on CIFAR-10 by about 10% against independent random flips.

    The flip of a sample depends on *which* image it is, so this op must be the first op of the pipeline and
    the loader must keep the data set resident (``DeviceLoader`` then hands the op the sample indices). When
    it gets an already-gathered batch instead, it falls back to independent random flips (p = 0.5) and warns
    once.

    Args:
        size, padding, padding_mode, fill: as :class:`RandomCrop` (``size=None`` = translate).
        epoch: a zero-argument callable returning the current epoch (the train loader's ``epoch``), read when
            a batch's parameters are drawn.
        seed: seed of the per-image bits.
    """

    def __init__(
        self,
        size: int | tuple[int, int] | None,
        padding: int = 0,
        padding_mode: PaddingMode = "reflect",
        fill: float = 0.0,
        *,
        epoch: Callable[[], int],
        seed: int = 0,
    ) -> None:
        super().__init__(size, padding=padding, padding_mode=padding_mode, fill=fill)
        if not callable(epoch):
            raise TypeError(
                f"AlternatingFlipCrop: epoch must be a callable returning the epoch, got {epoch!r}"
            )
        self._epoch = epoch
        self.seed = int(seed)
        self._bits: Tensor | None = None
        self._warned = False

    def image_bits(self, num_images: int) -> Tensor:
        """The fixed per-image bit (bool, ``num_images``, CPU), drawn once from ``seed``."""
        if self._bits is None or self._bits.numel() != num_images:
            g = torch.Generator().manual_seed(self.seed)
            self._bits = torch.rand(num_images, generator=g) < 0.5
        return self._bits

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        params = super().sample(n, height, width, generator)
        params["random_flip"] = torch.rand(n, generator=generator) < 0.5  # fallback only
        params["odd_epoch"] = torch.full((n,), bool(self._epoch() % 2))
        return params

    def prepare(self, params: Params, shape: Sequence[int], index: Tensor | None = None) -> Params:
        if index is not None:
            odd_epoch = params["odd_epoch"]
            flip = self.image_bits(int(shape[0]))[index.cpu()].to(odd_epoch.device) ^ odd_epoch
        else:
            if not self._warned:
                warnings.warn(
                    "AlternatingFlipCrop got a batch without sample indices (the loader does not keep the "
                    "data set resident, or the op is not first in the pipeline): using independent random "
                    "flips",
                    stacklevel=3,
                )
                self._warned = True
            flip = params["random_flip"]
        return super().prepare({**params, "flip": flip}, shape, index)


class Pad(_Crop):
    """Deterministic padding by (left, top, right, bottom) pixels (albumentations ``Pad``)."""

    def __init__(
        self, padding: int | Sequence[int], padding_mode: PaddingMode = "constant", fill: float = 0.0
    ):
        _check_mode(padding_mode, "Pad")
        self.padding = _padding4(padding)
        self.padding_mode = padding_mode
        self.fill = float(fill)

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        left, top, right, bottom = self._padding_for(int(height), int(width))
        return int(height) + top + bottom, int(width) + left + right

    def _crop_size(self, height: int, width: int) -> tuple[int, int]:
        return self.output_size(height, width)

    def _offsets(self, params: Params, n: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        zeros = torch.zeros(n, dtype=torch.int64)
        return zeros, zeros


class PadIfNeeded(Pad):
    """Pad to at least ``min_height`` x ``min_width``, centred (albumentations ``PadIfNeeded`` position
    ``center``: the extra pixel of an odd amount goes to the bottom / right)."""

    def __init__(
        self, min_height: int, min_width: int, padding_mode: PaddingMode = "constant", fill: float = 0.0
    ):
        super().__init__(0, padding_mode, fill)
        self.min_height, self.min_width = int(min_height), int(min_width)

    def _padding_for(self, height: int, width: int) -> tuple[int, int, int, int]:
        dh, dw = max(0, self.min_height - height), max(0, self.min_width - width)
        return (dw // 2, dh // 2, dw - dw // 2, dh - dh // 2)


class CenterCrop(_Crop):
    """Integer centre crop to ``size`` (top-left at ``((H - h) // 2, (W - w) // 2)`` as albumentations)."""

    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size, "CenterCrop size")

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        h, w = int(height), int(width)
        if self.size[0] > h or self.size[1] > w:
            raise ValueError(f"CenterCrop: crop {self.size} is larger than the image {(h, w)}")
        return {
            "top": torch.full((n,), (h - self.size[0]) // 2, dtype=torch.int64),
            "left": torch.full((n,), (w - self.size[1]) // 2, dtype=torch.int64),
        }

    def _crop_size(self, height: int, width: int) -> tuple[int, int]:
        return self.size

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size


class HorizontalFlip(BatchOp):
    """Mirror left-right with probability ``p`` per sample; folds into a crop or resize right before it."""

    def __init__(self, p: float = 0.5):
        check_p(p, type(self).__name__)
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        return {"flip": bernoulli(n, self.p, generator)}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return torch.where(params["flip"].to(images.device).view(-1, 1, 1, 1), images.flip(-1), images)

    fold_key = FLIP_AFTER

    def fold_as(self, params: Params) -> Params:
        return {FLIP_AFTER: params["flip"]}


class VerticalFlip(BatchOp):
    """Mirror top-bottom with probability ``p`` per sample."""

    def __init__(self, p: float = 0.5):
        check_p(p, "VerticalFlip")
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        return {"flip": bernoulli(n, self.p, generator)}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return torch.where(params["flip"].to(images.device).view(-1, 1, 1, 1), images.flip(-2), images)


def _sizes(n: int, height: Any, width: Any) -> tuple[Tensor, Tensor]:
    if isinstance(height, Tensor):
        return height, width
    return torch.full((n,), int(height), dtype=torch.int64), torch.full((n,), int(width), dtype=torch.int64)


class _Resample(BatchOp):
    """Bilinear resampling of a per-sample box (``top, left, height, width`` params) to ``size``."""

    accepts_ragged = True
    folds = frozenset({FLIP_AFTER})
    prepares_on_device = True  # the taps are (N, h) and (N, w) tables: 4 us of CPU time per 224-px image
    size: tuple[int, int]

    def prepare(self, params: Params, shape: Sequence[int], index: Tensor | None = None) -> Params:
        tables = resample_tables(
            params["top"],
            params["left"],
            params["height"],
            params["width"],
            self.size,
            (int(shape[-2]), int(shape[-1])),
            _flip(params),
        )
        return {**params, **tables}

    def compiles_on(self, device: torch.device) -> bool:
        # On the CPU the eager uint8 resize of whole-pixel boxes (ATen's vectorized kernel, see
        # functional.geometry.resize_boxes) beats Inductor's gather; elsewhere the compiled path wins.
        return device.type != "cpu"

    def apply(self, images: Tensor | RaggedBatch, params: Params) -> Tensor:
        canvas = images.canvas if isinstance(images, RaggedBatch) else images
        if whole_pixel_boxes(canvas, params):
            return resize_boxes(
                canvas,
                params["top"],
                params["left"],
                params["height"],
                params["width"],
                self.size,
                _flip(params),
            )
        if "y0" not in params:  # called directly, not by a Pipeline
            params = self.prepare(params, _shape_of(canvas))
        taps = {k: params[k].to(canvas.device) for k in ("y0", "y1", "wy", "x0", "x1", "wx")}
        return resample(canvas, taps)

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size


class RandomResizedCrop(_Resample):
    """Crop a random box (area fraction ``scale``, aspect ``ratio`` = w/h) per sample and resize to ``size``.

    Parameter distribution identical to ``torchvision.transforms.v2.RandomResizedCrop`` and
    ``albumentations.RandomResizedCrop``; accepts batches of images of different sizes.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        p: float = 1.0,
    ):
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"RandomResizedCrop: scale must satisfy 0 < min <= max, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: ratio must satisfy 0 < min <= max, got {ratio}")
        check_p(p, "RandomResizedCrop")
        self.size = _pair(size, "RandomResizedCrop size")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        hs, ws = _sizes(n, height, width)
        params = random_resized_crop_params(hs, ws, self.scale, self.ratio, generator)
        if self.p < 1.0:  # samples not cropped are resized whole
            keep = bernoulli(n, self.p, generator)
            params = {
                "top": torch.where(keep, params["top"], 0),
                "left": torch.where(keep, params["left"], 0),
                "height": torch.where(keep, params["height"], hs),
                "width": torch.where(keep, params["width"], ws),
            }
        return params


class Resize(_Resample):
    """Bilinear resize of every image to ``size`` (height, width)."""

    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size, "Resize size")

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        hs, ws = _sizes(n, height, width)
        zeros = torch.zeros(n, dtype=torch.int64)
        return {"top": zeros, "left": zeros, "height": hs, "width": ws}


class ResizeCenterCrop(_Resample):
    """Evaluation resize: scale the shorter side to ``resize_size``, then take the centre ``size`` crop.

    Done as one resample of the matching (possibly fractional) source box, so it accepts images of
    different sizes; it equals resize-then-crop up to sub-pixel placement.
    """

    def __init__(self, size: int | Sequence[int], resize_size: int | None = None):
        self.size = _pair(size, "ResizeCenterCrop size")
        self.resize_size = int(resize_size) if resize_size is not None else int(round(max(self.size) / 0.875))
        if self.resize_size < max(self.size):
            raise ValueError(
                f"ResizeCenterCrop: resize_size {self.resize_size} is smaller than the crop {self.size}"
            )

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        hs, ws = _sizes(n, height, width)
        factor = self.resize_size / torch.minimum(hs, ws).double()  # output pixels per source pixel
        box_h = self.size[0] / factor
        box_w = self.size[1] / factor
        return {"top": (hs - box_h) / 2, "left": (ws - box_w) / 2, "height": box_h, "width": box_w}
