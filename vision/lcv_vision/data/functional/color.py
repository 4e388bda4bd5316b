"""Batched colour as tensor functions: grayscale, brightness/contrast/saturation/hue, colour jitter,
normalize.

Pixel arithmetic runs in float32 on the 0..255 scale and saturates to [0, 255] after every step, which is
what albumentations does on uint8 images (it never wraps around); the only difference is that we do not
round to integers between steps.  Hue is shifted in HSV exactly like albumentations' float path.

Colour jitter works on channel planes (``r, g, b`` as ``(N, H, W)`` tensors) so that every step is a
pointwise map of a pixel's three values, which ``torch.compile`` fuses into loops over pixels, with a
reduction for the contrast's mean before each half of the sequence.  The per-sample order of the four ops
is turned into a fixed sequence of seven steps (three blends, hue, three blends; see :func:`jitter_tables`),
so no sample branches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

#: ITU-R BT.601 luma weights, the ones ``cv2.COLOR_RGB2GRAY`` uses.
GRAY_WEIGHTS = (0.299, 0.587, 0.114)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Blend steps before and after the hue step in :func:`jitter_tables` (brightness, contrast, saturation).
BLEND_STEPS = 3


def as_float(images: Tensor) -> Tensor:
    """uint8 -> float32 in 0..255 units (no scaling); floats pass through."""
    return images.float() if images.dtype == torch.uint8 else images


def rgb_to_gray(images: Tensor) -> Tensor:
    """(N, 3, H, W) -> (N, 1, H, W) luma; uint8 input uses OpenCV's 14-bit fixed-point formula exactly."""
    if images.shape[1] == 1:
        return images
    if images.dtype == torch.uint8:
        r, g, b = images.to(torch.int32).unbind(1)
        return ((r * 4899 + g * 9617 + b * 1868 + (1 << 13)) >> 14).to(torch.uint8).unsqueeze(1)
    r, g, b = images[:, 0:1], images[:, 1:2], images[:, 2:3]
    return gray_plane(r, g, b)


def gray_plane(r: Tensor, g: Tensor, b: Tensor) -> Tensor:
    return r * GRAY_WEIGHTS[0] + g * GRAY_WEIGHTS[1] + b * GRAY_WEIGHTS[2]


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
    """Inverse of :func:`rgb_to_hsv`, via ``c_n = v - v s clamp(min(k, 4 - k), 0, 1)``, ``k = (n + 6h) mod
    6``."""
    n = torch.tensor((5.0, 3.0, 1.0), dtype=hue.dtype, device=hue.device).view(1, 3, 1, 1)
    k = (n + 6.0 * hue.unsqueeze(1)).remainder(6.0)
    ramp = torch.minimum(k, 4.0 - k).clamp(0.0, 1.0)
    return val.unsqueeze(1) * (1.0 - sat.unsqueeze(1) * ramp)


def hue_planes(r: Tensor, g: Tensor, b: Tensor, shift: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rotate hue by ``shift`` (broadcast against the planes, in turns); any units in and out.

    Equal to shifting the hue of :func:`rgb_to_hsv` and converting back with :func:`hsv_to_rgb`, without
    leaving RGB: a hue rotation keeps each pixel's max and min, so every output channel is
    ``max - (max - min) * ramp(k)``.  The hue, in sixths of a turn, uses OpenCV's branch order (max == r,
    then max == g, then b).  Hue is scale invariant: no conversion to 0..1.
    """
    maxc = torch.maximum(torch.maximum(r, g), b)
    delta = maxc - torch.minimum(torch.minimum(r, g), b)
    is_r = maxc == r
    is_g = (maxc == g) & ~is_r
    num = torch.where(is_r, g - b, torch.where(is_g, b - r + 2.0 * delta, r - g + 4.0 * delta))
    hue6 = num / torch.where(delta == 0, 1.0, delta) + 6.0 * shift  # gray pixels: num == 0, any hue works
    hue6 = hue6 - 6.0 * torch.floor(hue6 * (1.0 / 6.0))  # mod 6
    out = []
    for offset in (5.0, 3.0, 1.0):
        k = hue6 + offset  # in [1, 11)
        k = k - 6.0 * torch.floor(k * (1.0 / 6.0))
        out.append(maxc - delta * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0))
    return out[0], out[1], out[2]


def adjust_hue(images: Tensor, shift: Tensor) -> Tensor:
    """Rotate hue by ``shift`` (N,) turns (albumentations/torchvision ``hue`` factor); 0..255 units in/out."""
    if images.shape[1] == 1:
        return images
    x = as_float(images)
    r, g, b = x.unbind(1)
    planes = hue_planes(r, g, b, shift.to(x.dtype).view(-1, 1, 1))
    return torch.stack(planes, dim=1)


def _blend(images: Tensor, factor: Tensor, other: Tensor) -> Tensor:
    return (images * factor + other * (1.0 - factor)).clamp_(0.0, 255.0)


def adjust_brightness(images: Tensor, factor: Tensor) -> Tensor:
    """``clip(x * f)``, per-sample ``factor`` (N,)."""
    return _blend(
        as_float(images), factor.to(torch.float32).view(-1, 1, 1, 1), torch.zeros((), device=images.device)
    )


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


def jitter_tables(
    brightness: Tensor,
    contrast: Tensor,
    saturation: Tensor,
    hue: Tensor,
    order: Tensor,
    apply_hue: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-sample coefficients of the fixed step sequence blend x3, hue, blend x3 (CPU, before the kernel).

    ``order`` (N, 4) is a permutation of (0 brightness, 1 contrast, 2 saturation, 3 hue) per row.  A sample's
    steps before its hue go into the last blend slots before the hue step, those after it into the first
    slots after it; unused slots are the identity.  Every blend is ``clip(f x + s gray(x) + m mean)`` per
    sample and slot (brightness ``s = m = 0``; contrast ``m = 1 - f``, ``mean`` = mean gray level when the
    step runs; saturation ``s = 1 - f``), so all samples run the same arithmetic whatever their order.

    Returns ``f, s, m`` (N, 6) float32, ``contrast_slot`` (N, 6) float32 one-hot of the contrast step,
    ``hue`` (N,) shift and ``hue_on`` (N,) bool.
    """
    n = order.shape[0]
    order = order.long()
    hue_at = (order == 3).long().argmax(dim=1)  # (N,)
    slots = torch.arange(2 * BLEND_STEPS).view(1, -1)  # (1, 6)
    # Slot j < 3 holds order step j - 3 + hue_at (steps before the hue); slot j >= 3 holds step j - 2 +
    # hue_at.
    step = torch.where(
        slots < BLEND_STEPS, slots - BLEND_STEPS + hue_at.view(n, 1), slots - 2 + hue_at.view(n, 1)
    )
    used = (step >= 0) & (step <= 3) & ((slots >= BLEND_STEPS) | (step < hue_at.view(n, 1)))
    kind = torch.where(used, order.gather(1, step.clamp(0, 3)), 3)  # 3: identity here
    factors = torch.stack((brightness, contrast, saturation, torch.ones_like(brightness)), dim=1).float()
    f = factors.gather(1, kind)
    keep = 1.0 - f
    is_contrast = (kind == 1).float()
    hue_on = torch.ones(n, dtype=torch.bool) if apply_hue is None else apply_hue.bool()
    return {
        "f": f,
        "s": keep * (kind == 2).float(),
        "m": keep * is_contrast,
        "contrast_slot": is_contrast,
        "hue": hue.float(),
        "hue_on": hue_on & (hue != 0),
    }


def _blend_slots(
    planes: list[Tensor], t: dict[str, Tensor], slots: range, mean: Tensor | None
) -> tuple[list[Tensor], Tensor]:
    """The blend ``slots`` of :func:`jitter_tables` on channel planes; returns (planes, seen).

    ``seen`` (N,) is the sum over the pixels of the gray level that the contrast slot among ``slots`` gets
    as input (0 for a sample whose contrast is elsewhere): only the slots before it matter for that, and no
    contrast runs before it, so the contrast bias (``m * mean``) is left out when ``mean`` is None.
    """
    n = planes[0].shape[0]
    col = lambda key, j: t[key][:, j].view(n, 1, 1)  # noqa: E731  (one sample's coefficient, broadcast)
    seen = torch.zeros((), device=planes[0].device)  # per pixel: the gray level at the contrast slot
    for j in slots:
        gray = gray_plane(*planes) if len(planes) == 3 else planes[0]
        seen = seen + gray * col("contrast_slot", j)
        bias = col("s", j) * gray
        if mean is not None:
            bias = bias + col("m", j) * mean.view(n, 1, 1)
        planes = [(col("f", j) * p + bias).clamp(0.0, 255.0) for p in planes]
    # One sum over the pixels, not one per slot: a single reduction loop once compiled.
    return planes, seen.sum(dim=(1, 2))


def _contrast_blends(planes: list[Tensor], t: dict[str, Tensor], slots: range) -> list[Tensor]:
    """``slots`` with the contrast mean of the image as it enters them: a reduction, then the blends."""
    _, seen = _blend_slots(planes, t, slots, None)
    return _blend_slots(planes, t, slots, seen / (planes[0].shape[1] * planes[0].shape[2]))[0]


def jitter_planes(planes: Sequence[Tensor], tables: dict[str, Tensor], with_hue: bool = True) -> list[Tensor]:
    """Colour jitter of float channel planes (0..255 units) with the coefficients of :func:`jitter_tables`.

    Contrast needs the mean gray level of the image as its step sees it, a reduction over the pixels first.
    The blend slots before the hue step and those after it are two halves, each run as that reduction and
    then its blends: the hue step's output is the second half's input, which the compiler stores once, so
    no pass recomputes the hue step or the first half (computing the mean over the whole sequence and then
    running the sequence again would do every step twice).  ``with_hue=False`` leaves the hue step out (an
    op whose hue range is zero).
    """
    planes = _contrast_blends(list(planes), tables, range(BLEND_STEPS))
    if len(planes) == 3 and with_hue:
        n = planes[0].shape[0]
        r, g, b = planes
        shifted = hue_planes(r, g, b, tables["hue"].view(n, 1, 1))
        on = tables["hue_on"].view(n, 1, 1)
        planes = [torch.where(on, new, old) for new, old in zip(shifted, planes)]
    return _contrast_blends(planes, tables, range(BLEND_STEPS, 2 * BLEND_STEPS))


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
    """One eager jitter step: brightness (``op`` 0), contrast (1), saturation (2) or nothing (3), per sample.

    Each of the three is ``clip(f x + (1 - f) z)`` with ``z`` = 0, the mean gray level or the gray image,
    i.e. one per-sample affine colour map ``clip(f x + s gray(x) + c)``; the whole batch does its step in one
    pass over the 3 channels, whichever op each sample does (a sample doing hue at this step gets ``f = 1``).
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
    images: Tensor,
    brightness: Tensor,
    contrast: Tensor,
    saturation: Tensor,
    hue: Tensor,
    order: Tensor,
    apply_hue: bool = True,
) -> Tensor:
    """Brightness/contrast/saturation/hue with per-sample factors, each sample in its own ``order`` (eager).

    ``order`` is (N, 4) with a permutation of (0=brightness, 1=contrast, 2=saturation, 3=hue) per row.
    At each of the 4 steps the three blend-type ops run as one batched affine map (:func:`_blend_step`);
    hue runs on just the samples whose step it is.  That skipping is what makes it fast eagerly and what a
    compiler cannot trace: compiled pipelines run :func:`jitter_planes` instead (the same maps as a fixed
    step sequence; tests check the two agree).  Returns float32 in 0..255 units, NCHW contiguous.
    """
    x = as_float(images).contiguous()
    factors = torch.stack((brightness, contrast, saturation), dim=1).to(device=x.device, dtype=x.dtype)
    order = order.to(x.device)
    hue = hue.to(x.device)
    for step in range(4):
        op = order[:, step]
        x = _blend_step(x, op, factors)
        if apply_hue and x.shape[1] == 3:
            x = _where_samples(x, op == 3, adjust_hue, hue, inplace=True)  # x is our own buffer
    return x


def normalize_factors(
    mean: Sequence[float], std: Sequence[float], max_pixel_value: float, channels: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``scale`` and ``bias`` (C,) with ``x * scale + bias == (x / max_pixel_value - mean) / std``."""
    scale = 1.0 / (torch.tensor(std, dtype=torch.float32) * max_pixel_value)
    bias = -torch.tensor(mean, dtype=torch.float32) * max_pixel_value * scale
    return scale.expand(channels).to(device), bias.expand(channels).to(device)


def normalize(images: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """``x * scale + bias`` per channel, float32."""
    return as_float(images) * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


def normalize_planes(planes: Sequence[Tensor], scale: Tensor, bias: Tensor) -> list[Tensor]:
    """:func:`normalize` of channel planes (N, H, W) with (N, C) ``scale`` and ``bias``: one map per plane,
    so a compiled colour jitter writes normalized planes straight away instead of re-reading its output."""
    n = planes[0].shape[0]
    return [p * scale[:, c].view(n, 1, 1) + bias[:, c].view(n, 1, 1) for c, p in enumerate(planes)]
