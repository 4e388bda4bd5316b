"""Batched colour ops: colour jitter (per-sample factors *and* per-sample order), grayscale, normalize.

Pixel arithmetic runs in float32 on the 0..255 scale and saturates to [0, 255] after every step, which is
what albumentations does on uint8 images (it never wraps around); the only difference is that we do not
round to integers between steps.  Hue is shifted in HSV exactly like albumentations' float path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from vision.data.pipeline import BatchOp, Params, as_float, bernoulli, uniform

#: ITU-R BT.601 luma weights, the ones ``cv2.COLOR_RGB2GRAY`` uses.
GRAY_WEIGHTS = (0.299, 0.587, 0.114)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rgb_to_gray(images: Tensor) -> Tensor:
    """(N, 3, H, W) -> (N, 1, H, W) luma; uint8 input uses OpenCV's 14-bit fixed-point formula exactly."""
    if images.shape[1] == 1:
        return images
    if images.dtype == torch.uint8:
        r, g, b = images.to(torch.int32).unbind(1)
        return ((r * 4899 + g * 9617 + b * 1868 + (1 << 13)) >> 14).to(torch.uint8).unsqueeze(1)
    r, g, b = images[:, 0:1], images[:, 1:2], images[:, 2:3]
    return (r * GRAY_WEIGHTS[0]).add_(g, alpha=GRAY_WEIGHTS[1]).add_(b, alpha=GRAY_WEIGHTS[2])


def rgb_to_hsv(rgb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """RGB in [0, 1] -> (hue in [0, 1), saturation, value); same branch order as OpenCV."""
    r, g, b = rgb.unbind(1)
    maxc = rgb.amax(dim=1)
    minc = rgb.amin(dim=1)
    delta = maxc - minc
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    hue = torch.where(
        maxc == r, (g - b) / safe, torch.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe)
    )
    hue = torch.where(delta > 0, (hue / 6.0).remainder(1.0), torch.zeros_like(hue))
    sat = delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc))
    return hue, sat, maxc


def hsv_to_rgb(hue: Tensor, sat: Tensor, val: Tensor) -> Tensor:
    """Inverse of :func:`rgb_to_hsv`, via ``c_n = v - v s clamp(min(k, 4 - k), 0, 1)``, ``k = (n + 6h) mod 6``."""
    n = torch.tensor((5.0, 3.0, 1.0), dtype=hue.dtype, device=hue.device).view(1, 3, 1, 1)
    k = (n + 6.0 * hue.unsqueeze(1)).remainder(6.0)
    ramp = torch.minimum(k, 4.0 - k).clamp(0.0, 1.0)
    return val.unsqueeze(1) * (1.0 - sat.unsqueeze(1) * ramp)


def adjust_hue(images: Tensor, shift: Tensor) -> Tensor:
    """Rotate hue by ``shift`` (N,) turns (albumentations/torchvision ``hue`` factor); 0..255 units in/out.

    Equal to shifting the hue of :func:`rgb_to_hsv` and converting back with :func:`hsv_to_rgb`, in far
    fewer passes over the image (hue is the most expensive colour op on CPU): a hue rotation keeps each
    pixel's max and min, so every output channel is ``max - (max - min) * ramp(k)``.  The hue, in sixths
    of a turn, uses OpenCV's branch order (max == r, then max == g, then b) written as mask arithmetic,
    which is faster than ``torch.where`` on CPU.  Hue is scale invariant: no conversion to 0..1.
    """
    if images.shape[1] == 1:
        return images
    x = as_float(images)
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    maxc = x.amax(dim=1, keepdim=True)
    delta = maxc - x.amin(dim=1, keepdim=True)
    is_r = (maxc == r).to(x.dtype)
    is_g = (maxc == g).to(x.dtype).mul_(1.0 - is_r)
    is_b = 1.0 - is_r - is_g
    num = is_r * (g - b) + is_g * (b - r + 2.0 * delta) + is_b * (r - g + 4.0 * delta)
    hue6 = num.div_(delta + (delta == 0).to(x.dtype))  # gray pixels: delta == 0, num == 0, any hue works
    hue6.add_(shift.to(x.dtype).view(-1, 1, 1, 1), alpha=6.0)
    hue6.sub_(torch.floor(hue6 * (1.0 / 6.0)), alpha=6.0)  # mod 6 (floor is faster than remainder on CPU)
    k = hue6 + torch.tensor((5.0, 3.0, 1.0), dtype=x.dtype, device=x.device).view(1, 3, 1, 1)  # in [1, 11)
    k.sub_(torch.floor(k * (1.0 / 6.0)), alpha=6.0)
    ramp = torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)
    return ramp.mul_(delta).neg_().add_(maxc)


def _blend(images: Tensor, factor: Tensor, other: Tensor) -> Tensor:
    return (images * factor + other * (1.0 - factor)).clamp_(0.0, 255.0)


def adjust_brightness(images: Tensor, factor: Tensor) -> Tensor:
    """``clip(x * f)``, per-sample ``factor`` (N,)."""
    return _blend(as_float(images), factor.to(torch.float32).view(-1, 1, 1, 1), torch.zeros((), device=images.device))


def adjust_contrast(images: Tensor, factor: Tensor) -> Tensor:
    """``clip(x * f + mean(gray(x)) * (1 - f))``, per-sample ``factor`` (N,)."""
    x = as_float(images)
    mean = rgb_to_gray(x).mean(dim=(1, 2, 3), keepdim=True)
    return _blend(x, factor.to(torch.float32).view(-1, 1, 1, 1), mean)


def adjust_saturation(images: Tensor, factor: Tensor) -> Tensor:
    """``clip(x * f + gray(x) * (1 - f))``, per-sample ``factor`` (N,)."""
    x = as_float(images)
    if x.shape[1] == 1:
        return x
    return _blend(x, factor.to(torch.float32).view(-1, 1, 1, 1), rgb_to_gray(x))


def _where_samples(
    images: Tensor, mask: Tensor, fn: Callable[..., Tensor], *args: Tensor, inplace: bool = False
) -> Tensor:
    """``fn`` applied only to the samples in ``mask``.

    On CPU we compute just those samples (indexing is free there); on accelerators we compute the whole
    batch and select, because finding the indices would force a device-to-host sync inside the loader.
    """
    if images.device.type == "cpu":
        idx = mask.nonzero().squeeze(1)
        if idx.numel() == 0:
            return images
        out = images if inplace else images.clone()
        out[idx] = fn(images[idx], *(a[idx] for a in args))
        return out
    return torch.where(mask.view(-1, 1, 1, 1), fn(images, *args), images)


def _blend_step(x: Tensor, op: Tensor, factors: Tensor) -> Tensor:
    """One jitter step: brightness (``op`` 0), contrast (1), saturation (2) or nothing (3), per sample.

    Each of the three is ``clip(f x + (1 - f) z)`` with ``z`` = 0, the mean gray level or the gray image,
    i.e. one per-sample affine colour map ``clip(f x + s gray(x) + c)`` (``s = 1 - f`` for saturation,
    ``c = (1 - f) mean(gray(x))`` for contrast, else 0).  So the whole batch does its step in one pass
    over the 3 channels, whichever op each sample does (a sample doing hue at this step gets ``f = 1``).
    ``x`` is a contiguous NCHW float tensor; returns a new one.
    """
    n, c = x.shape[:2]
    idx = op.clamp(max=2).view(n, 1)
    f = torch.where(op == 3, 1.0, factors.gather(1, idx).squeeze(1))
    keep = 1.0 - f
    is_contrast = (op == 1).to(x.dtype)
    is_saturation = (op == 2).to(x.dtype)
    if c == 1:  # saturation of a gray image is the identity
        f = torch.where(op == 2, 1.0, f)
        bias = keep * is_contrast * x.mean(dim=(1, 2, 3))
        return torch.addcmul(bias.view(n, 1, 1, 1), x, f.view(n, 1, 1, 1)).clamp_(0.0, 255.0)
    # y = s * gray(x) + c per pixel (one channel), then clip(f x + y): two passes over the 3 channels.
    # On CPU, skip the parts no sample needs at this step (checking on a GPU would sync it).
    on_cpu = x.device.type == "cpu"
    if on_cpu and not bool(is_saturation.any()):
        y = torch.zeros((n, 1, 1, 1), dtype=x.dtype)
    else:
        y = rgb_to_gray(x).mul_((keep * is_saturation).view(n, 1, 1, 1))
    if not on_cpu or bool(is_contrast.any()):
        w = torch.tensor(GRAY_WEIGHTS, dtype=x.dtype, device=x.device)
        mean_gray = x.mean(dim=(2, 3)) @ w
        y.add_((keep * is_contrast * mean_gray).view(n, 1, 1, 1))
    return torch.addcmul(y, x, f.view(n, 1, 1, 1)).clamp_(0.0, 255.0)


def color_jitter(
    images: Tensor, brightness: Tensor, contrast: Tensor, saturation: Tensor, hue: Tensor, order: Tensor,
    apply_hue: bool = True,
) -> Tensor:
    """Brightness/contrast/saturation/hue with per-sample factors, each sample in its own ``order``.

    ``order`` is (N, 4) with a permutation of (0=brightness, 1=contrast, 2=saturation, 3=hue) per row.
    At each of the 4 steps the three blend-type ops run as one batched affine map (:func:`_blend_step`);
    hue runs on the samples whose step it is.  Returns float32 in 0..255 units, NCHW contiguous.
    """
    x = as_float(images).contiguous()
    n = x.shape[0]
    factors = torch.stack((brightness, contrast, saturation), dim=1).to(device=x.device, dtype=x.dtype)
    order = order.to(x.device)
    hue = hue.to(x.device)
    for step in range(4):
        op = order[:, step]
        x = _blend_step(x, op, factors)
        if apply_hue and x.shape[1] == 3:
            x = _where_samples(x, op == 3, adjust_hue, hue, inplace=True)  # x is our own buffer
    return x


def _range(value: float | Sequence[float], name: str, center: float, lower_bound: float | None) -> tuple[float, float]:
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
    """

    def __init__(
        self,
        brightness: float | Sequence[float] = (0.8, 1.2),
        contrast: float | Sequence[float] = (0.8, 1.2),
        saturation: float | Sequence[float] = (0.8, 1.2),
        hue: float | Sequence[float] = (-0.5, 0.5),
        p: float = 0.5,
    ):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ColorJitter: probability p must be in [0, 1], got {p}")
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

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return color_jitter(
            images, params["brightness"], params["contrast"], params["saturation"], params["hue"], params["order"],
            apply_hue=self.hue != (0.0, 0.0),
        )


class ToGray(BatchOp):
    """Replace the image by its luma (replicated to 3 channels) with probability ``p`` per sample."""

    def __init__(self, p: float = 0.5):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ToGray: probability p must be in [0, 1], got {p}")
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        return {"gray": bernoulli(n, self.p, generator)}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        if images.shape[1] == 1:
            return images
        gray = rgb_to_gray(images).expand_as(images)
        return torch.where(params["gray"].view(-1, 1, 1, 1), gray, images)


class Normalize(BatchOp):
    """``(x - mean * max_pixel_value) / (std * max_pixel_value)`` (albumentations ``Normalize`` "standard").

    ``mean``/``std`` are per-channel in 0..1 units; the output is float32.
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

    writes_out = True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_factor_cache": {}}  # cached device tensors stay in this process

    def _factors(self, device: torch.device, channels: int = 0, width: int = 0) -> tuple[Tensor, Tensor]:
        """``scale`` and ``bias`` with ``x * scale + bias == (x / max_pixel_value - mean) / std``, made once per
        device (they are rebuilt on every batch otherwise): per channel, or repeated along an image row of
        ``width`` pixels of ``channels`` values when ``width`` is given."""
        cache = self._factor_cache
        key = (str(device), channels, width, self.mean, self.std, self.max_pixel_value)
        if key not in cache:
            scale = 1.0 / (torch.tensor(self.std, dtype=torch.float32) * self.max_pixel_value)
            bias = -torch.tensor(self.mean, dtype=torch.float32) * self.max_pixel_value * scale
            if width:
                scale, bias = scale.expand(channels).repeat(width), bias.expand(channels).repeat(width)
            cache[key] = (scale.to(device), bias.to(device))
        return cache[key]

    def apply(self, images: Tensor, params: Params, out: Tensor | None = None) -> Tensor:
        c = images.shape[1]
        if len(self.mean) not in (1, c):
            raise ValueError(f"Normalize: {len(self.mean)} mean values for images with {c} channels")
        shape = (1, -1, 1, 1)
        if (out is not None and out.dtype == torch.float32 and _nhwc_rows(images) is not None
                and _nhwc_rows(out) is not None):
            # Both channels_last: treat each image row as one vector of W*C values with the per-channel
            # scale/shift repeated W times. A (1, C, 1, 1) broadcast over channels_last memory has an inner
            # stride-1 run of only C values and does not vectorise (about 10x slower on CPU).
            scale, bias = self._factors(images.device, c, images.shape[-1])
            torch.mul(_nhwc_rows(images), scale, out=_nhwc_rows(out)).add_(bias)
            return out
        scale, bias = self._factors(images.device)
        if out is not None and out.dtype != torch.float32:  # bf16/fp16 output: one rounding, at the end
            return torch.addcmul(bias.view(shape), as_float(images), scale.view(shape), out=out)
        # float32: multiply, then add, as the channels_last path above does (addcmul may fuse the two
        # roundings), so every layout gives bit-identical results.
        if out is not None:  # the pipeline's output buffer: memory format conversion in this pass
            return torch.mul(as_float(images), scale.view(shape), out=out).add_(bias.view(shape))
        return torch.mul(as_float(images), scale.view(shape)).add_(bias.view(shape))


def _nhwc_rows(images: Tensor) -> Tensor | None:
    """A (N*H, W*C) view of a channels_last-contiguous (N, C, H, W) tensor, or None when it is not one."""
    if images.dim() != 4:
        return None
    nhwc = images.permute(0, 2, 3, 1)
    if not nhwc.is_contiguous():
        return None
    n, h, w, c = nhwc.shape
    return nhwc.view(n * h, w * c)
