"""TrivialAugmentWide (torchvision's ``ta_wide``) as a batch op with per-sample draws.

Not batched: each sample's op runs through ``torchvision.transforms.v2.functional`` on its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lcv_vision.data.ops import BatchOp, Params

__all__ = ["TRIVIAL_AUGMENT_OPS", "TrivialAugmentWide", "trivial_augment_op"]


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
    roughly one small kernel launch per sample on a GPU, and a compiled pipeline runs it eagerly between
    its compiled parts. Float input (0..255 units, e.g. after a resized crop) is rounded to uint8 first;
    the output is uint8.
    """

    compilable = False  # a Python loop over samples with per-sample torchvision calls

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
        return F.affine(
            image,
            angle=0.0,
            translate=[0, 0],
            scale=1.0,
            shear=shear,
            interpolation=nearest,
            fill=None,
            center=[0, 0],
        )
    if name in ("TranslateX", "TranslateY"):
        translate = [int(magnitude), 0] if name == "TranslateX" else [0, int(magnitude)]
        return F.affine(
            image,
            angle=0.0,
            translate=translate,
            scale=1.0,
            shear=[0.0, 0.0],
            interpolation=nearest,
            fill=None,
        )
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
