"""Two batch ops the recipes need that ``vision.data`` does not have: airbench's alternating flip and
TrivialAugmentWide.

Both follow the ``vision.data`` op contract (``sample`` draws parameters on the CPU with an explicit
generator, ``apply`` runs them on the device) so they slot into a ``Pipeline`` next to the built-in ops.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from vision.data.geometry import RandomCrop
from vision.data.pipeline import BatchOp, Params

__all__ = ["AlternatingFlipCrop", "TrivialAugmentWide", "TRIVIAL_AUGMENT_OPS"]


class AlternatingFlipCrop(RandomCrop):
    """Random pad-and-crop (translate) plus airbench's *alternating* horizontal flip, in one gather.

    Alternating flip (Jordan 2024, arXiv 2404.00498): each image gets a fixed random bit; in even epochs the
    images whose bit is set are mirrored, in odd epochs exactly the others. Every image is then seen both ways
    every two epochs, which cuts the steps to 94% on CIFAR-10 by about 10% against independent random flips.

    The flip of a sample depends on *which* image it is, so this op must be the first op of the pipeline and
    the loader must keep the data set resident (``DeviceLoader`` then hands the op the sample indices). When it
    gets an already-gathered batch instead, it falls back to independent random flips (p = 0.5) and warns once.

    Args:
        size, padding, padding_mode, fill: as :class:`vision.data.RandomCrop` (``size=None`` = translate).
        epoch: a zero-argument callable returning the current epoch (the train loader's ``epoch``).
        seed: seed of the per-image bits.
    """

    def __init__(
        self,
        size: int | tuple[int, int] | None,
        padding: int = 0,
        padding_mode: str = "reflect",
        fill: float = 0.0,
        *,
        epoch: Callable[[], int],
        seed: int = 0,
    ) -> None:
        super().__init__(size, padding=padding, padding_mode=padding_mode, fill=fill)  # type: ignore[arg-type]
        if not callable(epoch):
            raise TypeError(f"AlternatingFlipCrop: epoch must be a callable returning the epoch, got {epoch!r}")
        self._epoch = epoch
        self.seed = int(seed)
        self._bits: Tensor | None = None
        self._warned = False

    def image_bits(self, num_images: int, device: torch.device | str = "cpu") -> Tensor:
        """The fixed per-image bit (bool, ``num_images``), drawn once from ``seed`` (cached on ``device``)."""
        device = torch.device(device)
        if self._bits is None or self._bits.numel() != num_images or self._bits.device != device:
            g = torch.Generator().manual_seed(self.seed)
            self._bits = (torch.rand(num_images, generator=g) < 0.5).to(device)
        return self._bits

    @override
    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        params = super().sample(n, height, width, generator)
        params["random_flip"] = torch.rand(n, generator=generator) < 0.5  # fallback only
        return params

    @override
    def apply(self, images: Tensor, params: Params, index: Tensor | None = None) -> Tensor:
        if index is not None:
            bits = self.image_bits(images.shape[0], index.device)[index]
            flip = bits ^ bool(self._epoch() % 2)
        else:
            if not self._warned:
                warnings.warn(
                    "AlternatingFlipCrop got a batch without sample indices (the loader does not keep the data "
                    "set resident, or the op is not first in the pipeline): using independent random flips",
                    stacklevel=2,
                )
                self._warned = True
            flip = params["random_flip"]
        return super().apply(images, {**params, "flip": flip}, index=index)


def _signed(values: Tensor) -> tuple[Tensor, bool]:
    return values, True


#: TrivialAugmentWide's op space, in torchvision's order: name -> (magnitudes over the 31 bins, signed).
TRIVIAL_AUGMENT_OPS: dict[str, tuple[Tensor | None, bool]] = {
    "Identity": (None, False),
    "ShearX": _signed(torch.linspace(0.0, 0.99, 31)),
    "ShearY": _signed(torch.linspace(0.0, 0.99, 31)),
    "TranslateX": _signed(torch.linspace(0.0, 32.0, 31)),
    "TranslateY": _signed(torch.linspace(0.0, 32.0, 31)),
    "Rotate": _signed(torch.linspace(0.0, 135.0, 31)),
    "Brightness": _signed(torch.linspace(0.0, 0.99, 31)),
    "Color": _signed(torch.linspace(0.0, 0.99, 31)),
    "Contrast": _signed(torch.linspace(0.0, 0.99, 31)),
    "Sharpness": _signed(torch.linspace(0.0, 0.99, 31)),
    "Posterize": ((8 - torch.arange(31) / 5.0).round(), False),
    "Solarize": (torch.linspace(1.0, 0.0, 31), False),
    "AutoContrast": (None, False),
    "Equalize": (None, False),
}
_OP_NAMES = tuple(TRIVIAL_AUGMENT_OPS)


class TrivialAugmentWide(BatchOp):
    """TrivialAugmentWide (Müller & Hutter 2021; torchvision's ``ta_wide``): one random op at a random
    strength (31 bins, random sign where the op has one) per sample, nearest interpolation, fill 0.

    Each sample gets its own op and strength. Ops run one sample at a time through
    ``torchvision.transforms.v2.functional`` on uint8, so this op is correct but not batched: it costs
    roughly one small kernel launch per sample on a GPU. Float input (0..255 units, e.g. after a resized
    crop) is rounded to uint8 first; the output is uint8.
    """

    @override
    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        return {
            "op": torch.randint(len(_OP_NAMES), (n,), generator=generator),
            "bin": torch.randint(31, (n,), generator=generator),
            "negate": torch.rand(n, generator=generator) <= 0.5,
        }

    @override
    def apply(self, images: Tensor, params: Params) -> Tensor:
        if images.dtype != torch.uint8:
            images = images.round().clamp_(0, 255).to(torch.uint8)
        ops, bins, negate = (params[k].tolist() for k in ("op", "bin", "negate"))
        out = images.clone()
        for i, (op, b, neg) in enumerate(zip(ops, bins, negate)):
            name = _OP_NAMES[op]
            if name != "Identity":
                out[i] = trivial_augment_op(images[i], name, _magnitude(name, b, neg))
        return out


def _magnitude(name: str, bin_index: int, negate: bool) -> float:
    values, signed = TRIVIAL_AUGMENT_OPS[name]
    if values is None:
        return 0.0
    magnitude = float(values[bin_index])
    return -magnitude if signed and negate else magnitude


def trivial_augment_op(image: Tensor, name: str, magnitude: float) -> Tensor:
    """Apply one TrivialAugmentWide op to a uint8 ``(C, H, W)`` image (torchvision's definitions)."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    nearest = InterpolationMode.NEAREST
    if name == "Identity":
        return image
    if name in ("ShearX", "ShearY"):
        degrees = math.degrees(math.atan(magnitude))
        shear = [degrees, 0.0] if name == "ShearX" else [0.0, degrees]
        return F.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, interpolation=nearest,
                        fill=None, center=[0, 0])
    if name in ("TranslateX", "TranslateY"):
        translate = [int(magnitude), 0] if name == "TranslateX" else [0, int(magnitude)]
        return F.affine(image, angle=0.0, translate=translate, scale=1.0, shear=[0.0, 0.0],
                        interpolation=nearest, fill=None)
    if name == "Rotate":
        return F.rotate(image, angle=magnitude, interpolation=nearest, fill=None)
    if name == "Brightness":
        return F.adjust_brightness(image, 1.0 + magnitude)
    if name == "Color":
        return F.adjust_saturation(image, 1.0 + magnitude)
    if name == "Contrast":
        return F.adjust_contrast(image, 1.0 + magnitude)
    if name == "Sharpness":
        return F.adjust_sharpness(image, 1.0 + magnitude)
    if name == "Posterize":
        return F.posterize(image, bits=int(magnitude))
    if name == "Solarize":
        return F.solarize(image, threshold=255.0 * magnitude)
    if name == "AutoContrast":
        return F.autocontrast(image)
    if name == "Equalize":
        return F.equalize(image)
    raise ValueError(f"unknown TrivialAugmentWide op {name!r}; known: {list(_OP_NAMES)}")
