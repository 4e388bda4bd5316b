"""Batched geometry as tensor functions: per-sample integer crops (any border mode) and bilinear resampling.

Both are gathers driven by small per-sample index tables: ``(N, out_h)`` source rows and ``(N, out_w)``
source columns (with weights for bilinear).  The tables carry everything that varies per sample (offset,
border mode, mirroring, scale), are built on the CPU from the drawn parameters (:func:`crop_tables`,
:func:`resample_tables`), and leave the per-pixel work a plain gather that ``torch.compile`` fuses with the
ops after it.  No padded copy of the images is ever made: a border pixel is just a mapped index.

Bilinear resampling follows OpenCV's half-pixel convention with the border replicated at the crop's edge,
so it matches ``cv2.resize(crop, size, INTER_LINEAR)`` (what albumentations does) up to OpenCV's fixed-point
rounding; like OpenCV it does not antialias.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lcv_vision.data.functional._triton import use_resample_kernel
from lcv_vision.data.functional.opencv_resize import Box, opencv, resize_rows
from lcv_vision.data.functional.pool import run_rows

BORDER_MODES = ("constant", "reflect", "symmetric", "edge")


def map_border(idx: np.ndarray, size: int, mode: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Map out-of-range indices back into ``[0, size)``; for ``constant`` also return the in-range mask."""
    if mode == "constant":
        return idx.clip(0, size - 1), (idx >= 0) & (idx < size)
    if mode == "edge":
        return idx.clip(0, size - 1), None
    if mode == "reflect":  # dcb|abcd|cba  (cv2.BORDER_REFLECT_101, torch "reflect")
        period = max(2 * size - 2, 1)
        idx = idx % period
        return np.where(idx >= size, period - idx, idx), None
    # symmetric: cba|abcd|dcb  (cv2.BORDER_REFLECT)
    period = 2 * size
    idx = idx % period
    return np.where(idx >= size, period - 1 - idx, idx), None


@functools.lru_cache(maxsize=256)
def _border_lookup(
    length: int, before: int, after: int, mode: str, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """Source index of every position of an axis padded by ``before``/``after`` (and, for ``constant``,
    whether it is inside the image), on ``device``: a few dozen entries, made once per size."""
    mapped, inside = map_border(np.arange(-before, length + after), length, mode)
    return (
        torch.from_numpy(mapped).to(device),
        None if inside is None else torch.from_numpy(inside).to(device),
    )


def crop_tables(
    top: Tensor,
    left: Tensor,
    size: tuple[int, int],
    image_size: tuple[int, int],
    padding: tuple[int, int, int, int] = (0, 0, 0, 0),
    padding_mode: str = "constant",
    flip: Tensor | None = None,
) -> dict[str, Tensor]:
    """Source rows ``(N, h)`` and columns ``(N, w)`` of a per-sample crop at (``top``, ``left``) of the image
    padded by ``padding`` = (left, top, right, bottom); ``flip`` (N,) bool mirrors the chosen crops.

    For ``constant`` padding also ``row_ok``/``col_ok``, the masks of rows and columns inside the image.
    Made on the device of ``top`` (a GPU then gets only the offsets from the CPU), as lookups into the padded
    axes' source indices.
    """
    (ch, cw), (height, width) = size, image_size
    n, device = top.shape[0], top.device
    rows = top.long().view(n, 1) + torch.arange(ch, device=device)  # positions in the padded frame
    if flip is None:
        cols = left.long().view(n, 1) + torch.arange(cw, device=device)
    else:  # a mirrored crop walks its columns backwards from its right edge
        mirrored = flip.to(device).long().view(n, 1)
        cols = (left.long().view(n, 1) + mirrored * (cw - 1)) + (1 - 2 * mirrored) * torch.arange(
            cw, device=device
        )
    row_map, row_in = _border_lookup(height, padding[1], padding[3], padding_mode, device)
    col_map, col_in = _border_lookup(width, padding[0], padding[2], padding_mode, device)

    def look_up(table: Tensor, at: Tensor) -> Tensor:
        return table.index_select(0, at.view(-1)).view(at.shape)

    tables = {"rows": look_up(row_map, rows), "cols": look_up(col_map, cols)}
    if row_in is not None and col_in is not None:
        tables.update(row_ok=look_up(row_in, rows), col_ok=look_up(col_in, cols))
    return tables


def _index(images: Tensor, indices: list[Tensor]) -> Tensor:
    """``images[indices]`` for index tables that are in range by construction (built on the CPU by this
    module): compiled, without a bounds check per pixel, which costs as much as the gather itself."""
    if torch.compiler.is_compiling():
        return torch.ops.aten._unsafe_index(images, indices)
    return images[tuple(indices)]


def gather_crop(
    images: Tensor, tables: dict[str, Tensor], fill: float = 0.0, index: Tensor | None = None
) -> Tensor:
    """The crops described by :func:`crop_tables`, in the input dtype, channels_last; ``index`` (N,) picks
    the batch out of a larger ``images`` store in the same gather."""
    rows, cols = tables["rows"], tables["cols"]
    n, ch, cw = rows.shape[0], rows.shape[1], cols.shape[1]
    batch = index.view(n, 1, 1) if index is not None else torch.arange(n, device=images.device).view(n, 1, 1)
    # Advanced indexing on (N, H, W, C) gives (N, h, w, C) directly: permuting back makes it channels_last.
    out = _index(images.permute(0, 2, 3, 1), [batch, rows.view(n, ch, 1), cols.view(n, 1, cw)]).permute(
        0, 3, 1, 2
    )
    if "row_ok" in tables:
        ok = tables["row_ok"].view(n, 1, ch, 1) & tables["col_ok"].view(n, 1, 1, cw)
        out = torch.where(ok, out, torch.tensor(fill, dtype=out.dtype, device=out.device))
    return out


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
    tables = crop_tables(
        top.to(images.device),
        left.to(images.device),
        size,
        (int(images.shape[-2]), int(images.shape[-1])),
        padding,
        padding_mode,
        flip,
    )
    return gather_crop(images, tables, fill, None if index is None else index.to(images.device))


def resample_axis(
    start: Tensor, length: Tensor, out_size: int, limit: int, flip: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Bilinear taps along one axis: ``(i0, i1, weight of i1)``, each ``(N, out_size)``.

    Source coordinate ``(o + 0.5) * length / out_size - 0.5`` (OpenCV), clamped to the box
    ``[start, start + length - 1]`` so no pixel outside it is read; ``i1`` is kept below ``limit`` (the
    canvas side).  ``flip`` reverses the chosen samples' taps (a mirrored output, for free).
    """
    n, device = start.shape[0], start.device
    start = start.to(torch.float32).view(n, 1)
    length = length.to(torch.float32).view(n, 1)
    # A tensor divisor: CUDA divides by a Python number as a multiplication by its reciprocal, which rounds
    # differently from the CPU's division (the tables must be the same on every device).
    scale = length / torch.full_like(length, out_size)
    pos = (torch.arange(out_size, dtype=torch.float32, device=device).view(1, out_size) + 0.5) * scale - 0.5
    pos = start + torch.minimum(pos.clamp_min(0), length - 1)
    if flip is not None:
        pos = torch.where(flip.to(device).view(n, 1), pos.flip(1), pos)
    i0 = pos.floor()
    weight = pos - i0
    i0 = i0.long().clamp(0, limit - 1)
    return i0, (i0 + 1).clamp(max=limit - 1), weight


def resample_tables(
    top: Tensor,
    left: Tensor,
    height: Tensor,
    width: Tensor,
    size: tuple[int, int],
    canvas_size: tuple[int, int],
    flip: Tensor | None = None,
) -> dict[str, Tensor]:
    """The row and column taps of :func:`resample` for per-sample boxes (may be fractional)."""
    y0, y1, wy = resample_axis(top, height, size[0], canvas_size[0])
    x0, x1, wx = resample_axis(left, width, size[1], canvas_size[1], flip)
    return {"y0": y0, "y1": y1, "wy": wy, "x0": x0, "x1": x1, "wx": wx}


def resample(images: Tensor, taps: dict[str, Tensor]) -> Tensor:
    """Bilinear resampling by :func:`resample_tables`: float32 ``(N, C, h, w)`` in the input's units.

    Compiled: four gathers at the taps, mixed along x and then along y, written as one expression over
    ``(N, C, h, w)`` so that the compiler fuses it with the ops after it.  Eagerly: ``grid_sample`` at the
    same coordinates (one ATen kernel).  On CUDA: the Triton kernel of :mod:`lcv_vision.data.functional._triton`.
    """
    y0, y1, wy, x0, x1, wx = (taps[k] for k in ("y0", "y1", "wy", "x0", "x1", "wx"))
    if use_resample_kernel(images):  # CUDA: our Triton kernel (see functional/_triton.py for why)
        return torch.ops.lcv_data.resample_bilinear(images, y0, y1, wy, x0, x1, wx)
    if not torch.compiler.is_compiling():  # eagerly, ATen's grid_sample does the same in one kernel
        n, oh, ow = y0.shape[0], y0.shape[1], x0.shape[1]
        return _grid_sample(images, (y0 + wy).view(n, oh, 1), (x0 + wx).view(n, 1, ow))
    return gather_resample(images, taps)


def gather_resample(images: Tensor, taps: dict[str, Tensor]) -> Tensor:
    """:func:`resample` as four gathers and two mixes over ``(N, C, h, w)`` (the compiled form)."""
    y0, y1, wy, x0, x1, wx = (taps[k] for k in ("y0", "y1", "wy", "x0", "x1", "wx"))
    n, oh, ow, c = y0.shape[0], y0.shape[1], x0.shape[1], images.shape[1]
    batch = torch.arange(n, device=images.device).view(n, 1, 1, 1)
    channel = torch.arange(c, device=images.device).view(1, c, 1, 1)
    r0, r1 = y0.view(n, 1, oh, 1), y1.view(n, 1, oh, 1)
    c0, c1 = x0.view(n, 1, 1, ow), x1.view(n, 1, 1, ow)
    wx, wy = wx.view(n, 1, 1, ow), wy.view(n, 1, oh, 1)
    a, b = _index(images, [batch, channel, r0, c0]).float(), _index(images, [batch, channel, r0, c1]).float()
    d, e = _index(images, [batch, channel, r1, c0]).float(), _index(images, [batch, channel, r1, c1]).float()
    upper = a + (b - a) * wx
    lower = d + (e - d) * wx
    return upper + (lower - upper) * wy


def resize_boxes(
    images: Tensor,
    top: Tensor,
    left: Tensor,
    height: Tensor,
    width: Tensor,
    size: tuple[int, int],
    flip: Tensor | None = None,
) -> Tensor:
    """Bilinear resize of each integer box to ``size``, uint8 in and out: ``(N, C, h, w)`` contiguous.

    The CPU path of :func:`resample` for whole-pixel boxes (random resized crops, resizes): one call per image
    of OpenCV's ``INTER_LINEAR`` (what albumentations runs; see :mod:`.opencv_resize`), or, without OpenCV,
    of ATen's uint8 bilinear kernel (vectorized fixed-point arithmetic on channels_last RGB like OpenCV's);
    either is about 6x faster on the CPU than the gather Inductor compiles from :func:`gather_resample` (byte
    loads one at a time).  Same sampling positions as :func:`resample_tables` (half-pixel centres, the box's
    border replicated).  Both kernels are separable and round to integers, so they are within 1 level of the
    float resampler, and ATen's of OpenCV's (tests check this).  ``flip`` (N,) bool mirrors the chosen
    outputs.  The output is planar (NCHW): the compiled colour ops after it vectorize over planes, and read
    interleaved pixels 3x slower.
    """
    if images.dtype != torch.uint8 or images.device.type != "cpu":
        raise ValueError(
            f"resize_boxes: expects uint8 images on the CPU, got {images.dtype} on {images.device}"
        )
    n, c = images.shape[0], images.shape[1]
    out = torch.empty((n, c, *size), dtype=torch.uint8)
    mirror = [False] * n if flip is None else flip.tolist()
    boxes = [
        (int(y), int(x), int(h), int(w))
        for y, x, h, w in zip(*(t.tolist() for t in (top, left, height, width)))
    ]
    resize: Callable[[range], None]
    if opencv() is not None:
        if not (c == 3 and images.is_contiguous(memory_format=torch.channels_last)):
            images = images.contiguous()  # read plane by plane (a no-op for NCHW batches)
        resize = functools.partial(resize_rows, images, boxes, mirror, out)
    else:
        resize = functools.partial(
            _aten_resize_rows, images.contiguous(memory_format=torch.channels_last), boxes, mirror, out
        )
    run_rows(resize, n)  # one small call per image, on single-threaded workers (see functional.pool)
    return out


def _aten_resize_rows(src: Tensor, boxes: list[Box], mirror: list[bool], out: Tensor, rows: range) -> None:
    """:func:`resize_boxes` of the images ``rows`` with ATen's kernel; ``src`` channels_last (the kernel's
    fast layout: a no-op for decoded batches, see RaggedBatch)."""
    size, c = list(out.shape[-2:]), out.shape[1]
    one = torch.empty((1, c, *size), dtype=torch.uint8, memory_format=torch.channels_last)
    for i in rows:
        y0, x0, h, w = boxes[i]
        box = src[i : i + 1, :, y0 : y0 + h, x0 : x0 + w]
        # torch's stub of this ATen op lacks its (..., scales_h, scales_w, out=) overload.
        torch._C._nn.upsample_bilinear2d(box, size, False, None, None, out=one)  # type: ignore[call-arg]
        out[i : i + 1].copy_(one.flip(-1) if mirror[i] else one)


def whole_pixel_boxes(images: Tensor, params: dict[str, Tensor]) -> bool:
    """True when :func:`resize_boxes` applies: uint8 images on the CPU, integer boxes, not being compiled."""
    return (
        images.dtype == torch.uint8
        and images.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not params["top"].dtype.is_floating_point
        and not params["height"].dtype.is_floating_point
    )


def _grid_sample(images: Tensor, ys: Tensor, xs: Tensor) -> Tensor:
    """Bilinear samples at pixel coordinates ``ys`` (N, h, 1) and ``xs`` (N, 1, w), edge replicated."""
    n, _, height, width = images.shape
    gy = ((2 * ys + 1) / height - 1).expand(n, ys.shape[1], xs.shape[2])
    gx = ((2 * xs + 1) / width - 1).expand(n, ys.shape[1], xs.shape[2])
    src = images if images.dtype in (torch.float32, torch.float64) else images.float()
    return F.grid_sample(
        src, torch.stack((gx, gy), dim=-1), mode="bilinear", padding_mode="border", align_corners=False
    )


def sqrt_params(x: Tensor) -> Tensor:
    """``torch.sqrt`` of a float64 parameter tensor, by numpy on the CPU (the same correctly rounded values).

    ATen's float64 sqrt on the CPU is MKL's ``vdSqrt``, which opens an OpenMP parallel region even for a few
    hundred values; its threads then spin for a while at the end of it, on the cores the loader's decode
    and augmentation threads need (a third of the ImageNet-style loader's CPU samples on a 2-core machine).
    """
    if x.device.type != "cpu":
        return torch.sqrt(x)
    return torch.from_numpy(np.sqrt(x.numpy()))


def random_resized_crop_params(
    heights: Tensor,
    widths: Tensor,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator,
    attempts: int = 10,
) -> dict[str, Tensor]:
    """Per-sample crop boxes with the torchvision / albumentations RandomResizedCrop algorithm, vectorized.

    Up to ``attempts`` (area, log-aspect) draws per sample, the first one that fits wins; offsets are uniform
    over all valid positions; samples with no fitting draw fall back to the ratio-clamped centre crop.
    Returns int64 ``top, left, height, width``.
    """
    n = heights.shape[0]
    H = heights.double().view(n, 1)
    W = widths.double().view(n, 1)
    area = H * W
    target = area * (
        torch.rand(n, attempts, generator=generator, dtype=torch.float64) * (scale[1] - scale[0]) + scale[0]
    )
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(
        torch.rand(n, attempts, generator=generator, dtype=torch.float64) * (log_hi - log_lo) + log_lo
    )
    w = torch.round(sqrt_params(target * aspect))  # round half to even, as Python's round()
    h = torch.round(sqrt_params(target / aspect))
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


def random_crop_params(
    n: int, padded_height: int, padded_width: int, size: tuple[int, int], generator: torch.Generator
) -> dict[str, Tensor]:
    """Offsets uniform over every valid position (inclusive), like albumentations and torchvision."""
    ch, cw = size
    if ch > padded_height or cw > padded_width:
        raise ValueError(
            f"RandomCrop: crop {size} is larger than the (padded) image {(padded_height, padded_width)}"
        )
    top = torch.randint(0, padded_height - ch + 1, (n,), generator=generator)
    left = torch.randint(0, padded_width - cw + 1, (n,), generator=generator)
    return {"top": top, "left": left}


def resized_crop(
    images: Tensor,
    top: Tensor,
    left: Tensor,
    height: Tensor,
    width: Tensor,
    size: tuple[int, int],
    flip: Tensor | None = None,
) -> Tensor:
    """Bilinear resize of each per-sample box (may be fractional) to ``size``: float32 ``(N, C, h, w)``."""
    taps = resample_tables(
        top.cpu(),
        left.cpu(),
        height.cpu(),
        width.cpu(),
        size,
        (int(images.shape[-2]), int(images.shape[-1])),
        None if flip is None else flip.cpu(),
    )
    return resample(images, {k: v.to(images.device) for k, v in taps.items()})
