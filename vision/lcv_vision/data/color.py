"""Batched colour ops: colour jitter (per-sample factors *and* per-sample order), grayscale, normalize.

The arithmetic lives in :mod:`lcv_vision.data.functional.color`; these classes draw the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lcv_vision.data.functional import color_jitter_cpu
from lcv_vision.data.functional.color import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    as_float,
    color_jitter,
    jitter_planes,
    jitter_tables,
    normalize,
    normalize_factors,
    normalize_planes,
    rgb_to_gray,
)
from lcv_vision.data.ops import NORMALIZE_AFTER, BatchOp, Params, bernoulli, check_p, uniform

_JITTER_TABLES = ("f", "s", "m", "contrast_slot", "hue", "hue_on")
_JITTER_PARAMS = ("brightness", "contrast", "saturation", "hue", "order")


def _range(
    value: float | Sequence[float], name: str, center: float, lower_bound: float | None
) -> tuple[float, float]:
    """Scalar ``v`` -> ``[max(lb, c - v), c + v]``; a pair is checked and kept (albumentations semantics)."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"ColorJitter: {name} as a single number must be non-negative, got {value}")
        low = center - value
        if lower_bound is not None:
            low = max(low, lower_bound)
        return (float(low), float(center + value))
    lo, hi = (float(v) for v in value)
    if lo > hi or (lower_bound is not None and lo < lower_bound):
        raise ValueError(f"ColorJitter: {name} range must be (low, high) with low <= high, got {value!r}")
    return (lo, hi)


class ColorJitter(BatchOp):
    """Random brightness, contrast, saturation and hue, applied in a random order *per sample*.

    Defaults follow albumentations (``brightness=contrast=saturation=(0.8, 1.2)``, ``hue=(-0.5, 0.5)``,
    ``p=0.5``); a scalar ``v`` means ``[max(0, 1 - v), 1 + v]`` (``[-v, v]`` for hue), so torchvision-style
    ``ColorJitter(0.4, 0.4, 0.4, 0.1)`` works too.  Samples not picked with ``p`` are left unchanged.
    Returns float32 in 0..255 units.  On CPU tensors it runs as a C++ kernel (built on first use, see
    :mod:`lcv_vision.data.functional.color_jitter_cpu`), elsewhere (or without a compiler) as torch ops.
    """

    def __init__(
        self,
        brightness: float | Sequence[float] = (0.8, 1.2),
        contrast: float | Sequence[float] = (0.8, 1.2),
        saturation: float | Sequence[float] = (0.8, 1.2),
        hue: float | Sequence[float] = (-0.5, 0.5),
        p: float = 0.5,
    ):
        check_p(p, "ColorJitter")
        self.brightness = _range(brightness, "brightness", 1.0, 0.0)
        self.contrast = _range(contrast, "contrast", 1.0, 0.0)
        self.saturation = _range(saturation, "saturation", 1.0, 0.0)
        self.hue = _range(hue, "hue", 0.0, None)
        if self.hue[0] < -0.5 or self.hue[1] > 0.5:
            raise ValueError(f"ColorJitter: hue must lie in [-0.5, 0.5], got {hue!r}")
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        apply = bernoulli(n, self.p, generator)
        b = uniform(n, *self.brightness, generator)
        c = uniform(n, *self.contrast, generator)
        s = uniform(n, *self.saturation, generator)
        h = uniform(n, *self.hue, generator)
        order = torch.argsort(torch.rand(n, 4, generator=generator), dim=1)
        one = torch.ones((), dtype=torch.float64)
        return {
            "brightness": torch.where(apply, b, one).float(),
            "contrast": torch.where(apply, c, one).float(),
            "saturation": torch.where(apply, s, one).float(),
            "hue": torch.where(apply, h, 0.0 * one).float(),
            "order": order,
        }

    folds = frozenset({NORMALIZE_AFTER})

    def prepare(self, params: Params, shape: Sequence[int], index: Tensor | None = None) -> Params:
        params = dict(params)
        folded = params.pop(NORMALIZE_AFTER, None)  # (3, k), not per sample: must not stay in the params
        tables = jitter_tables(*(params[k].cpu() for k in _JITTER_PARAMS))
        params.update({f"jitter_{k}": v for k, v in tables.items()})
        if folded is not None:
            mean, std, max_pixel = folded.tolist()
            scale, bias = Normalize(mean, std, max_pixel[0]).factors(int(shape[1]), torch.device("cpu"))
            n = params["brightness"].shape[0]
            params.update(normalize_scale=scale.repeat(n, 1), normalize_bias=bias.repeat(n, 1))
        return params

    def compiles_on(self, device: torch.device) -> bool:
        # On the CPU the C++ kernel (when it builds) beats Inductor's code for the fixed step sequence: it
        # runs each sample's own steps only, tile by tile in the cache (see functional.color_jitter_cpu).
        return device.type != "cpu" or color_jitter_cpu.kernel() is None

    def apply_into(self, images: Tensor, params: Params, out: Tensor) -> bool:
        """On the CPU: the jitter and the folded normalize by the C++ kernel, stored straight into ``out``."""
        if images.device.type != "cpu" or torch.compiler.is_compiling():
            return False
        brightness, contrast, saturation, hue, order = (params[k] for k in _JITTER_PARAMS)
        return color_jitter_cpu.color_jitter_into(
            images,
            out,
            brightness,
            contrast,
            saturation,
            hue,
            order,
            params.get("normalize_scale"),
            params.get("normalize_bias"),
            apply_hue=self.hue != (0.0, 0.0),
        )

    def apply(self, images: Tensor, params: Params) -> Tensor:
        """The jitter, then the normalize folded into it if any (``normalize_scale``/``normalize_bias``)."""
        with_hue = self.hue != (0.0, 0.0)
        scale, bias = params.get("normalize_scale"), params.get("normalize_bias")
        if images.device.type == "cpu" and not torch.compiler.is_compiling():
            out = torch.empty(images.shape, dtype=torch.float32)
            if self.apply_into(images, params, out):
                return out
        if not torch.compiler.is_compiling():  # eagerly: skips per sample what it does not need
            brightness, contrast, saturation, hue, order = (params[k] for k in _JITTER_PARAMS)
            out = color_jitter(images, brightness, contrast, saturation, hue, order, apply_hue=with_hue)
            if scale is None or bias is None:
                return out
            return out.mul_(scale.view(*scale.shape, 1, 1)).add_(bias.view(*bias.shape, 1, 1))  # our buffer
        tables = {k: params[f"jitter_{k}"].to(images.device) for k in _JITTER_TABLES}
        planes = jitter_planes(as_float(images).unbind(1), tables, with_hue=with_hue)
        if scale is not None and bias is not None:
            # Normalized plane by plane: stacking first would leave the normalize a pass of its own.
            planes = normalize_planes(planes, scale.to(images.device), bias.to(images.device))
        return torch.stack(planes, dim=1)


class ToGray(BatchOp):
    """Replace the image by its luma (replicated to 3 channels) with probability ``p`` per sample."""

    def __init__(self, p: float = 0.5):
        check_p(p, "ToGray")
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        return {"gray": bernoulli(n, self.p, generator)}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        if images.shape[1] == 1:
            return images
        gray = rgb_to_gray(images).expand_as(images)
        return torch.where(params["gray"].to(images.device).view(-1, 1, 1, 1), gray, images)


class Normalize(BatchOp):
    """``(x - mean * max_pixel_value) / (std * max_pixel_value)`` (albumentations ``Normalize`` "standard").

    ``mean``/``std`` are per-channel in 0..1 units (or one value for all channels); the output is float32.
    """

    def __init__(
        self,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        max_pixel_value: float = 255.0,
    ):
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std):
            raise ValueError(f"Normalize: mean has {len(self.mean)} values but std has {len(self.std)}")
        if min(self.std) <= 0:
            raise ValueError(f"Normalize: std must be positive, got {self.std}")
        self.max_pixel_value = float(max_pixel_value)
        self._factor_cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_factor_cache": {}}  # cached device tensors stay in this process

    fold_key = NORMALIZE_AFTER

    def fold_as(self, params: Params) -> Params:
        """``mean``, ``std`` and ``max_pixel_value`` (repeated) as the rows of a (3, k) tensor."""
        k = len(self.mean)
        rows = [self.mean, self.std, (self.max_pixel_value,) * k]
        return {NORMALIZE_AFTER: torch.tensor(rows, dtype=torch.float64)}

    def factors(self, channels: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``scale`` and ``bias`` (C,) of ``x * scale + bias`` for images with ``channels`` channels."""
        if len(self.mean) not in (1, channels):
            raise ValueError(f"Normalize: {len(self.mean)} mean values for images with {channels} channels")
        if torch.compiler.is_compiling():  # constants of the graph
            return normalize_factors(self.mean, self.std, self.max_pixel_value, channels, device)
        key = (str(device), channels)  # eagerly: made once per device, not on every batch
        if key not in self._factor_cache:
            self._factor_cache[key] = normalize_factors(
                self.mean, self.std, self.max_pixel_value, channels, device
            )
        return self._factor_cache[key]

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return normalize(images, *self.factors(images.shape[1], images.device))
