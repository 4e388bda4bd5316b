"""OpenCV's uint8 bilinear resize of integer boxes, written straight into a planar (NCHW) batch.

The CPU resize of whole-pixel boxes (see ``geometry.resize_boxes``) uses ``cv2.resize`` when OpenCV is
there (it comes with albumentations, a dependency): the very kernel albumentations runs, so the pixels are
OpenCV's exactly, and it is cheaper than ATen's uint8 kernel plus ATen's copy of its channels_last output to
planes.  It also reads planar images plane by plane, so an NCHW batch needs no channels_last copy of the
whole batch first (ATen's kernel wants channels_last; that copy cost more than the resize on 256 px images).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

#: (top, left, height, width) of one box, whole pixels.
Box = tuple[int, int, int, int]


@functools.cache
def opencv() -> ModuleType | None:
    """The ``cv2`` module, or None where OpenCV is not installed (then ATen's kernel runs)."""
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def resize_rows(
    images: Tensor, boxes: Sequence[Box], mirror: Sequence[bool], out: Tensor, rows: range
) -> None:
    """For each ``i`` in ``rows``: ``out[i]`` = box ``boxes[i]`` of ``images[i]`` resized to ``out``'s size,
    mirrored if ``mirror[i]``.

    ``images`` is uint8 (N, C, H, W) on the CPU, channels_last (decoded batches) or contiguous, ``out``
    uint8 (N, C, h, w) contiguous.  Channels_last RGB is resized as interleaved pixels and split into
    ``out``'s planes; contiguous images are resized plane by plane, straight into ``out``.
    """
    cv2 = opencv()
    assert cv2 is not None, "resize_rows needs OpenCV (check opencv() first)"
    c, (h_out, w_out) = images.shape[1], out.shape[-2:]
    dst = out.numpy()
    if c == 3 and images.is_contiguous(memory_format=torch.channels_last):
        src = images.permute(0, 2, 3, 1).numpy()  # (N, H, W, 3) view of the same memory
        resized, mirrored = np.empty((h_out, w_out, 3), np.uint8), np.empty((h_out, w_out, 3), np.uint8)
        for i in rows:
            y0, x0, h, w = boxes[i]
            cv2.resize(
                src[i, y0 : y0 + h, x0 : x0 + w], (w_out, h_out), dst=resized, interpolation=cv2.INTER_LINEAR
            )
            pixels = cv2.flip(resized, 1, dst=mirrored) if mirror[i] else resized
            cv2.mixChannels([pixels], [dst[i, 0], dst[i, 1], dst[i, 2]], [0, 0, 1, 1, 2, 2])
        return
    if not images.is_contiguous():
        raise ValueError("resize_rows: images must be channels_last RGB or contiguous")
    src = images.numpy()
    plane = np.empty((h_out, w_out), np.uint8)
    for i in rows:
        y0, x0, h, w = boxes[i]
        for ch in range(c):
            box = src[i, ch, y0 : y0 + h, x0 : x0 + w]
            if mirror[i]:
                cv2.resize(box, (w_out, h_out), dst=plane, interpolation=cv2.INTER_LINEAR)
                cv2.flip(plane, 1, dst=dst[i, ch])
            else:
                cv2.resize(box, (w_out, h_out), dst=dst[i, ch], interpolation=cv2.INTER_LINEAR)
