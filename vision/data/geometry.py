"""Batched geometric ops: crops (with padding), flips, random resized crop, resize, center crop.

Integer crops and flips are one gather on the uint8 batch; resizing ops are one ``grid_sample`` per
batch with per-sample boxes.  Bilinear resizing uses OpenCV's half-pixel convention with the border
replicated at the crop's edge, so it matches ``cv2.resize(crop, size, INTER_LINEAR)`` (what
albumentations does) up to OpenCV's fixed-point rounding; like OpenCV it does not antialias.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vision.data.pipeline import FLIP_AFTER, BatchOp, Params, RaggedBatch, as_float, bernoulli

PaddingMode = Literal["constant", "reflect", "symmetric", "edge"]
_PADDING_MODES = ("constant", "reflect", "symmetric", "edge")


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(size, int):
        out = (size, size)
    else:
        out = tuple(int(s) for s in size)
        if len(out) != 2:
            raise ValueError(f"{name} must be an int or (height, width), got {size!r}")
    if min(out) <= 0:
        raise ValueError(f"{name} must be positive, got {size!r}")
    return out  # type: ignore[return-value]


def _padding4(padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    """(left, top, right, bottom), accepting an int, (pad_x, pad_y) or 4 values (albumentations order)."""
    if isinstance(padding, int):
        pads = (padding,) * 4
    else:
        p = tuple(int(v) for v in padding)
        if len(p) == 2:
            pads = (p[0], p[1], p[0], p[1])
        elif len(p) == 4:
            pads = p
        else:
            raise ValueError(f"padding must be an int, (pad_x, pad_y) or (left, top, right, bottom), got {padding!r}")
    if min(pads) < 0:
        raise ValueError(f"padding must be non-negative, got {padding!r}")
    return pads  # type: ignore[return-value]


def _map_border(idx: Tensor, size: int, mode: str) -> tuple[Tensor, Tensor | None]:
    """Map out-of-range indices back into ``[0, size)``; for ``constant`` also return the in-range mask."""
    if mode == "constant":
        valid = (idx >= 0) & (idx < size)
        return idx.clamp(0, size - 1), valid
    if mode == "edge":
        return idx.clamp(0, size - 1), None
    if mode == "reflect":  # dcb|abcd|cba  (cv2.BORDER_REFLECT_101, torch "reflect")
        period = max(2 * size - 2, 1)
        idx = idx.remainder(period)
        return torch.where(idx >= size, period - idx, idx), None
    # symmetric: cba|abcd|dcb  (cv2.BORDER_REFLECT)
    period = 2 * size
    idx = idx.remainder(period)
    return torch.where(idx >= size, period - 1 - idx, idx), None


def crop_with_padding(
    images: Tensor,
    top: Tensor,
    left: Tensor,
    size: tuple[int, int],
    padding: tuple[int, int, int, int] = (0, 0, 0, 0),
    padding_mode: str = "constant",
    fill: float = 0.0,
    flip: Tensor | None = None,
    index: Tensor | None = None,
) -> Tensor:
    """Per-sample integer crop of ``size`` at (``top``, ``left``) in the padded frame, as one gather.

    ``top``/``left`` are (N,) offsets into the image padded by ``padding`` = (left, top, right, bottom);
    ``flip`` (N,) bool optionally mirrors each crop horizontally; ``index`` (N,) optionally picks the batch
    out of a larger ``images`` store in the same gather.  The output keeps the input dtype.
    """
    n, _, height, width = images.shape if index is None else (index.shape[0], *images.shape[1:])
    ch, cw = size
    pad_left, pad_top = padding[0], padding[1]
    device = images.device
    if padding_mode != "symmetric" and max(padding[0], padding[2]) < width and max(padding[1], padding[3]) < height:
        # Fast path: pad once (cheap on uint8), then pick each sample's window from a strided view.
        mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}[padding_mode]
        padded = None
        if index is not None and images.dtype == torch.uint8:
            # A resident uint8 store (CIFAR-sized): pad it and lay it out channels_last once, as airbench
            # does, so each batch is one gather that already gives the channels_last layout of the output.
            padded = _padded_store(images, padding, mode, fill)
        if padded is None and any(padding) and index is not None:  # pad only the batch, never a large store
            images, index = images.index_select(0, index.to(device)), None
        if padded is None and any(padding):
            l, t, r, b = padding  # F.pad wants (left, right, top, bottom)
            padded = F.pad(images, (l, r, t, b), mode=mode, value=fill if mode == "constant" else None)
        elif padded is None:
            padded = images
        windows = padded.unfold(2, ch, 1).unfold(3, cw, 1)  # (M, C, nH, nW, ch, cw) view
        batch = index.to(device) if index is not None else torch.arange(n, device=device)
        out = windows[batch, :, top.to(device), left.to(device)]
        if flip is not None and device.type == "cpu":  # `out` is our own: mirror just the flipped samples
            idx = flip.nonzero().squeeze(1)
            if idx.numel():
                out[idx] = out[idx].flip(-1)
        elif flip is not None:  # (finding the indices would sync an accelerator)
            out = torch.where(flip.to(device).view(n, 1, 1, 1), out.flip(-1), out)
        return out
    if index is not None:
        images = images.index_select(0, index.to(device))
    rows = top.to(device).view(n, 1) + torch.arange(ch, device=device).view(1, ch) - pad_top
    cols = left.to(device).view(n, 1) + torch.arange(cw, device=device).view(1, cw) - pad_left
    if flip is not None:
        cols = torch.where(flip.to(device).view(n, 1), cols.flip(1), cols)
    rows, row_ok = _map_border(rows, height, padding_mode)
    cols, col_ok = _map_border(cols, width, padding_mode)
    batch = torch.arange(n, device=device).view(n, 1, 1)
    # Advanced indexing on (N, H, W, C) gives (N, h, w, C) directly: permuting back makes it channels_last.
    nhwc = images.permute(0, 2, 3, 1)
    out = nhwc[batch, rows.view(n, ch, 1), cols.view(n, 1, cw)].permute(0, 3, 1, 2)
    if row_ok is not None and col_ok is not None:
        ok = (row_ok.view(n, 1, ch, 1) & col_ok.view(n, 1, 1, cw))
        out = torch.where(ok, out, torch.tensor(fill, dtype=out.dtype, device=device))
    return out


#: Largest uint8 store (bytes, after padding) that :func:`_padded_store` keeps a padded copy of.
_PADDED_STORE_MAX_BYTES = 1 << 30
_padded_stores: dict[tuple, tuple[Any, Tensor]] = {}
_padded_stores_lock = threading.Lock()  # the CPU pipeline's worker threads ask for it together


def _padded_store(
    store: Tensor, padding: tuple[int, int, int, int], mode: str, fill: float
) -> Tensor | None:
    """A padded, channels_last copy of a resident uint8 ``store``, made once and reused for every batch.

    ``None`` when the copy would exceed ``_PADDED_STORE_MAX_BYTES`` (the batch is then padded on its own).
    The cache holds a weak reference to the store, so it never serves a stale copy of freed memory, and it
    keeps one entry: the training store.
    """
    n, c, h, w = store.shape
    l, t, r, b = padding
    if n * c * (h + t + b) * (w + l + r) > _PADDED_STORE_MAX_BYTES:
        return None
    if store.is_inference():  # no version counter: an in-place change could not be noticed, so do not cache
        return None
    key = (store.data_ptr(), tuple(store.shape), store.device, padding, mode, float(fill), store._version)
    with _padded_stores_lock:
        cached = _padded_stores.get(key)
        if cached is not None and cached[0]() is store:
            return cached[1]
        padded = _pad_channels_last(store, padding, mode, fill)
        _padded_stores.clear()
        _padded_stores[key] = (weakref.ref(store), padded)
        return padded


def _pad_channels_last(store: Tensor, padding: tuple[int, int, int, int], mode: str, fill: float) -> Tensor:
    l, t, r, b = padding
    chunks = []
    for start in range(0, store.shape[0], 4096):  # bounded temporaries
        part = store[start: start + 4096]
        if any(padding):
            part = F.pad(part, (l, r, t, b), mode=mode, value=fill if mode == "constant" else None)
        chunks.append(part.contiguous(memory_format=torch.channels_last))
    return torch.cat(chunks).contiguous(memory_format=torch.channels_last)


def _flip(params: Params) -> Tensor | None:
    """The op's own ``flip`` (if any) combined with a horizontal flip folded in after it."""
    own, after = params.get("flip"), params.get(FLIP_AFTER)
    if own is None or after is None:
        return own if after is None else after
    return own ^ after


def random_crop_params(
    n: int, padded_height: int, padded_width: int, size: tuple[int, int], generator: torch.Generator
) -> Params:
    """Offsets uniform over every valid position (inclusive), like albumentations and torchvision."""
    ch, cw = size
    if ch > padded_height or cw > padded_width:
        raise ValueError(
            f"RandomCrop: crop {size} is larger than the (padded) image {(padded_height, padded_width)}"
        )
    top = torch.randint(0, padded_height - ch + 1, (n,), generator=generator)
    left = torch.randint(0, padded_width - cw + 1, (n,), generator=generator)
    return {"top": top, "left": left}


class RandomCrop(BatchOp):
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
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"RandomCrop: padding_mode must be one of {_PADDING_MODES}, got {padding_mode!r}")
        _check_p(p, "RandomCrop")
        self.size = None if size is None else _pair(size, "RandomCrop size")
        self.padding = _padding4(padding)
        self.padding_mode = padding_mode
        self.fill = float(fill)
        self.p = p

    def _padded(self, height: int, width: int) -> tuple[int, int]:
        l, t, r, b = self.padding
        return height + t + b, width + l + r

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size if self.size is not None else (int(height), int(width))

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        size = self.output_size(height, width)
        ph, pw = self._padded(int(height), int(width))
        params = random_crop_params(n, ph, pw, size, generator)
        if self.p < 1.0:
            keep = bernoulli(n, self.p, generator)
            params["top"] = torch.where(keep, params["top"], torch.tensor((ph - size[0]) // 2))
            params["left"] = torch.where(keep, params["left"], torch.tensor((pw - size[1]) // 2))
        return params

    fuses_gather = True
    fuses_flip = True

    def apply(self, images: Tensor, params: Params, index: Tensor | None = None) -> Tensor:
        size = self.output_size(images.shape[-2], images.shape[-1])
        return crop_with_padding(
            images, params["top"], params["left"], size, self.padding, self.padding_mode, self.fill,
            _flip(params), index=index,
        )


def RandomTranslate(max_shift: int, fill: float = 0.0, padding_mode: PaddingMode = "constant") -> RandomCrop:
    """Shift each image by a random integer in ``[-max_shift, max_shift]`` per axis, keeping its size."""
    if max_shift < 0:
        raise ValueError(f"RandomTranslate: max_shift must be >= 0, got {max_shift}")
    return RandomCrop(None, padding=max_shift, padding_mode=padding_mode, fill=fill)


class Pad(BatchOp):
    """Deterministic padding by (left, top, right, bottom) pixels (albumentations ``Pad``)."""

    def __init__(self, padding: int | Sequence[int], padding_mode: PaddingMode = "constant", fill: float = 0.0):
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"Pad: padding_mode must be one of {_PADDING_MODES}, got {padding_mode!r}")
        self.padding = _padding4(padding)
        self.padding_mode = padding_mode
        self.fill = float(fill)

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        l, t, r, b = self.padding
        return int(height) + t + b, int(width) + l + r

    def apply(self, images: Tensor, params: Params) -> Tensor:
        n = images.shape[0]
        ph, pw = self.output_size(images.shape[-2], images.shape[-1])
        zeros = torch.zeros(n, dtype=torch.int64)
        return crop_with_padding(images, zeros, zeros, (ph, pw), self.padding, self.padding_mode, self.fill)


class HorizontalFlip(BatchOp):
    """Mirror left-right with probability ``p`` per sample."""

    def __init__(self, p: float = 0.5):
        _check_p(p, "HorizontalFlip")
        self.p = p

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        return {"flip": bernoulli(n, self.p, generator)}

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return torch.where(params["flip"].view(-1, 1, 1, 1), images.flip(-1), images)


class VerticalFlip(HorizontalFlip):
    """Mirror top-bottom with probability ``p`` per sample."""

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return torch.where(params["flip"].view(-1, 1, 1, 1), images.flip(-2), images)


def random_resized_crop_params(
    heights: Tensor,
    widths: Tensor,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator,
    attempts: int = 10,
) -> Params:
    """Per-sample crop boxes with the torchvision / albumentations RandomResizedCrop algorithm, vectorized.

    Up to ``attempts`` (area, log-aspect) draws per sample, the first one that fits wins; offsets are uniform
    over all valid positions; samples with no fitting draw fall back to the ratio-clamped centre crop.
    Returns int64 ``top, left, height, width``.
    """
    n = heights.shape[0]
    H = heights.double().view(n, 1)
    W = widths.double().view(n, 1)
    area = H * W
    target = area * (torch.rand(n, attempts, generator=generator, dtype=torch.float64) * (scale[1] - scale[0])
                     + scale[0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(torch.rand(n, attempts, generator=generator, dtype=torch.float64) * (log_hi - log_lo) + log_lo)
    w = torch.round(torch.sqrt(target * aspect))  # round half to even, as Python's round()
    h = torch.round(torch.sqrt(target / aspect))
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = ok.to(torch.int8).argmax(dim=1, keepdim=True)
    found = ok.any(dim=1)
    w = w.gather(1, first).squeeze(1)
    h = h.gather(1, first).squeeze(1)
    u = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    Hs, Ws = H.squeeze(1), W.squeeze(1)
    top = torch.floor((Hs - h + 1) * u[:, 0])
    left = torch.floor((Ws - w + 1) * u[:, 1])
    # Fallback: whole image with its aspect ratio clamped into `ratio`, centred.
    in_ratio = Ws / Hs
    fw = torch.where(in_ratio > ratio[1], torch.round(Hs * ratio[1]), Ws)
    fh = torch.where(in_ratio < ratio[0], torch.round(Ws / ratio[0]), Hs)
    fw = torch.where(in_ratio < ratio[0], Ws, fw)
    fh = torch.where(in_ratio > ratio[1], Hs, fh)
    ftop = torch.floor((Hs - fh) / 2)
    fleft = torch.floor((Ws - fw) / 2)
    return {
        "top": torch.where(found, top, ftop).long(),
        "left": torch.where(found, left, fleft).long(),
        "height": torch.where(found, h, fh).long(),
        "width": torch.where(found, w, fw).long(),
    }


def resized_crop(
    images: Tensor, top: Tensor, left: Tensor, height: Tensor, width: Tensor, size: tuple[int, int],
    flip: Tensor | None = None,
) -> Tensor:
    """Bilinear resize of each per-sample box (``top, left, height, width``, may be fractional) to ``size``.

    Source coordinates follow OpenCV (``src = (dst + 0.5) * scale - 0.5``) and are clamped to the box, so
    pixels outside the box are never read (the padding of a :class:`RaggedBatch` included).  ``flip`` (N,)
    bool mirrors the chosen samples by reversing their sampling grid (free).
    Returns float32 in the input's units.
    """
    n, _, canvas_h, canvas_w = images.shape
    oh, ow = size
    device = images.device
    top, left, height, width = (t.to(device=device, dtype=torch.float32).view(n, 1) for t in (top, left, height, width))
    ys = (torch.arange(oh, device=device, dtype=torch.float32).view(1, oh) + 0.5) * (height / oh) - 0.5
    xs = (torch.arange(ow, device=device, dtype=torch.float32).view(1, ow) + 0.5) * (width / ow) - 0.5
    ys = top + torch.minimum(ys.clamp_min(0), height - 1)
    xs = left + torch.minimum(xs.clamp_min(0), width - 1)
    if flip is not None:
        xs = torch.where(flip.to(device).view(n, 1), xs.flip(1), xs)
    gy = ((2 * ys + 1) / canvas_h - 1).view(n, oh, 1).expand(n, oh, ow)
    gx = ((2 * xs + 1) / canvas_w - 1).view(n, 1, ow).expand(n, oh, ow)
    grid = torch.stack((gx, gy), dim=-1)
    src = as_float(images)
    if src.dtype not in (torch.float32, torch.float64):
        src = src.float()
    return F.grid_sample(src, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _sizes(images: Any, height: Any, width: Any) -> tuple[Tensor, Tensor]:
    if isinstance(height, Tensor):
        return height, width
    n = images if isinstance(images, int) else len(images)
    return torch.full((n,), int(height), dtype=torch.int64), torch.full((n,), int(width), dtype=torch.int64)


def _canvas(images: Tensor | RaggedBatch) -> Tensor:
    return images.canvas if isinstance(images, RaggedBatch) else images


class RandomResizedCrop(BatchOp):
    """Crop a random box (area fraction ``scale``, aspect ``ratio`` = w/h) per sample and resize to ``size``.

    Parameter distribution identical to ``torchvision.transforms.v2.RandomResizedCrop`` and
    ``albumentations.RandomResizedCrop``; accepts batches of images of different sizes.
    """

    accepts_ragged = True
    fuses_flip = True

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
        _check_p(p, "RandomResizedCrop")
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

    def apply(self, images: Tensor | RaggedBatch, params: Params) -> Tensor:
        return resized_crop(_canvas(images), params["top"], params["left"], params["height"], params["width"],
                            self.size, _flip(params))

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size


class Resize(BatchOp):
    """Bilinear resize of every image to ``size`` (height, width)."""

    accepts_ragged = True
    fuses_flip = True

    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size, "Resize size")

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        hs, ws = _sizes(n, height, width)
        zeros = torch.zeros(n, dtype=torch.int64)
        return {"top": zeros, "left": zeros, "height": hs, "width": ws}

    def apply(self, images: Tensor | RaggedBatch, params: Params) -> Tensor:
        return resized_crop(_canvas(images), params["top"], params["left"], params["height"], params["width"],
                            self.size, _flip(params))

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size


class CenterCrop(BatchOp):
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

    fuses_gather = True
    fuses_flip = True

    def apply(self, images: Tensor, params: Params, index: Tensor | None = None) -> Tensor:
        return crop_with_padding(images, params["top"], params["left"], self.size, flip=_flip(params),
                                 index=index)

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size


class ResizeCenterCrop(BatchOp):
    """Evaluation resize: scale the shorter side to ``resize_size``, then take the centre ``size`` crop.

    Done as one resample of the matching (possibly fractional) source box, so it accepts images of
    different sizes; it equals resize-then-crop up to sub-pixel placement.
    """

    accepts_ragged = True
    fuses_flip = True

    def __init__(self, size: int | Sequence[int], resize_size: int | None = None):
        self.size = _pair(size, "ResizeCenterCrop size")
        self.resize_size = int(resize_size) if resize_size is not None else int(round(max(self.size) / 0.875))
        if self.resize_size < max(self.size):
            raise ValueError(f"ResizeCenterCrop: resize_size {self.resize_size} is smaller than the crop {self.size}")

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        hs, ws = _sizes(n, height, width)
        factor = self.resize_size / torch.minimum(hs, ws).double()  # output pixels per source pixel
        box_h = self.size[0] / factor
        box_w = self.size[1] / factor
        return {"top": (hs - box_h) / 2, "left": (ws - box_w) / 2, "height": box_h, "width": box_w}

    def apply(self, images: Tensor | RaggedBatch, params: Params) -> Tensor:
        return resized_crop(_canvas(images), params["top"], params["left"], params["height"], params["width"],
                            self.size, _flip(params))

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return self.size


def _check_p(p: float, name: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: probability p must be in [0, 1], got {p}")


class PadIfNeeded(BatchOp):
    """Pad to at least ``min_height`` x ``min_width``, centred (albumentations ``PadIfNeeded`` position
    ``center``: the extra pixel of an odd amount goes to the bottom / right)."""

    def __init__(self, min_height: int, min_width: int, padding_mode: PaddingMode = "constant", fill: float = 0.0):
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"PadIfNeeded: padding_mode must be one of {_PADDING_MODES}, got {padding_mode!r}")
        self.min_height, self.min_width = int(min_height), int(min_width)
        self.padding_mode = padding_mode
        self.fill = float(fill)

    def _padding(self, height: int, width: int) -> tuple[int, int, int, int]:
        dh, dw = max(0, self.min_height - height), max(0, self.min_width - width)
        return (dw // 2, dh // 2, dw - dw // 2, dh - dh // 2)

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return max(int(height), self.min_height), max(int(width), self.min_width)

    def apply(self, images: Tensor, params: Params) -> Tensor:
        padding = self._padding(int(images.shape[-2]), int(images.shape[-1]))
        return Pad(padding, self.padding_mode, self.fill).apply(images, params)
