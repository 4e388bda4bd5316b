"""Batched cutout / random erasing ops: up to K rectangular holes per sample, drawn here, filled by
:func:`lcv_vision.data.functional.erasing.fill_holes` in one masked write.

The fill value is in the units the images have at that point of the pipeline (0..255 before
:class:`~lcv_vision.data.color.Normalize`, normalized after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lcv_vision.data.functional.erasing import fill_holes
from lcv_vision.data.functional.geometry import sqrt_params
from lcv_vision.data.ops import BatchOp, Params, bernoulli, check_p


def _int_range(lo: float, hi: float, n: int, k: int, generator: torch.Generator) -> Tensor:
    return torch.randint(int(lo), int(hi) + 1, (n, k), generator=generator)


class CoarseDropout(BatchOp):
    """Cutout with albumentations ``CoarseDropout`` semantics, per sample.

    Args:
        num_holes_range: inclusive (min, max) number of holes.
        hole_height_range, hole_width_range: hole size, as fractions of the image side when the upper
            bound is < 1, else as pixels (inclusive).
        fill: constant fill (scalar or per channel).
        p: probability per sample.
    """

    def __init__(
        self,
        num_holes_range: tuple[int, int] = (1, 2),
        hole_height_range: tuple[float, float] = (0.1, 0.2),
        hole_width_range: tuple[float, float] = (0.1, 0.2),
        fill: float | Sequence[float] = 0.0,
        p: float = 0.5,
    ):
        if not 0 <= num_holes_range[0] <= num_holes_range[1]:
            raise ValueError(f"CoarseDropout: num_holes_range must be 0 <= min <= max, got {num_holes_range}")
        for name, r in (("hole_height_range", hole_height_range), ("hole_width_range", hole_width_range)):
            if not 0 < r[0] <= r[1]:
                raise ValueError(f"CoarseDropout: {name} must be 0 < min <= max, got {r}")
        if isinstance(fill, str):
            raise ValueError(f"CoarseDropout: only constant fills are supported, got fill={fill!r}")
        check_p(p, "CoarseDropout")
        self.num_holes_range = (int(num_holes_range[0]), int(num_holes_range[1]))
        self.hole_height_range = tuple(hole_height_range)
        self.hole_width_range = tuple(hole_width_range)
        self.fill = fill
        self.p = p

    def _sizes(self, rng: tuple, side: int, n: int, k: int, generator: torch.Generator) -> Tensor:
        if rng[1] >= 1:
            return _int_range(rng[0], min(rng[1], side), n, k, generator)
        u = torch.rand(n, k, generator=generator, dtype=torch.float64) * (rng[1] - rng[0]) + rng[0]
        return (side * u).long()

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        h, w = int(height), int(width)
        k = self.num_holes_range[1]
        count = torch.randint(self.num_holes_range[0], k + 1, (n, 1), generator=generator)
        hh = self._sizes(self.hole_height_range, h, n, k, generator)
        ww = self._sizes(self.hole_width_range, w, n, k, generator)
        y0 = (torch.rand(n, k, generator=generator, dtype=torch.float64) * (h - hh + 1)).long()
        x0 = (torch.rand(n, k, generator=generator, dtype=torch.float64) * (w - ww + 1)).long()
        active = (torch.arange(k).view(1, k) < count) & bernoulli(n, self.p, generator).view(n, 1)
        holes = torch.stack((x0, y0, x0 + ww, y0 + hh), dim=-1) * active.unsqueeze(-1)
        return {"holes": holes}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return fill_holes(images, params["holes"], self.fill)


class Erasing(BatchOp):
    """Random erasing (Zhong et al.) with albumentations ``Erasing`` semantics: one hole per sample.

    Area fraction ``scale`` and aspect ``ratio`` (w/h) are drawn so the hole always fits the image.
    """

    def __init__(
        self,
        scale: tuple[float, float] = (0.02, 0.33),
        ratio: tuple[float, float] = (0.3, 3.3),
        fill: float | Sequence[float] = 0.0,
        p: float = 0.5,
    ):
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"Erasing: scale must be 0 < min <= max <= 1, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"Erasing: ratio must be 0 < min <= max, got {ratio}")
        if isinstance(fill, str):
            raise ValueError(f"Erasing: only constant fills are supported, got fill={fill!r}")
        check_p(p, "Erasing")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.fill = fill
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        h, w = float(height), float(width)
        total = h * w
        r_lo, r_hi = self.ratio
        max_area = min(total * self.scale[1], r_lo * h * h, r_hi * h * h, w * w / r_lo, w * w / r_hi)
        min_area = total * self.scale[0]
        u = torch.rand(n, 4, generator=generator, dtype=torch.float64)
        active = bernoulli(n, self.p, generator) & (max_area >= min_area)
        area = min_area + u[:, 0] * max(max_area - min_area, 0.0)
        lo = torch.clamp(area / (h * h), min=r_lo)
        hi = torch.clamp(w * w / area, max=r_hi)
        active &= lo <= hi
        aspect = lo + u[:, 1] * (hi - lo).clamp_min(0)
        hh = torch.round(sqrt_params(area / aspect)).clamp(0, h)
        ww = torch.round(sqrt_params(area * aspect)).clamp(0, w)
        top = torch.floor(u[:, 2] * (h - hh + 1))
        left = torch.floor(u[:, 3] * (w - ww + 1))
        holes = torch.stack((left, top, left + ww, top + hh), dim=-1).long() * active.view(n, 1)
        return {"holes": holes.view(n, 1, 4)}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return fill_holes(images, params["holes"], self.fill)
