"""The recipe's evaluation transform, run on the host before the compiled graph: decode, size, crop.

Why on the host: resizing and cropping images of any size is data-dependent work the exported graph should not
hold (its input is one fixed size). The steps are the ones the recipe's DataModule uses for evaluation, run
with the same ``lcv_vision.data`` ops, so a package sees exactly the pixels the checkpoint was tested on. The
normalisation is not here: it is inside the graph, after the uint8 -> float conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from lcv_vision.data.color import Normalize
from lcv_vision.data.datasets import fit_to_square
from lcv_vision.data.geometry import CenterCrop, Resize, ResizeCenterCrop
from lcv_vision.data.ops import BatchOp

__all__ = ["HostTransform"]

#: The eval ops a package can replay on the host, by the name stored in its metadata.
_OPS: dict[str, type[BatchOp]] = {
    "center_crop": CenterCrop,
    "resize": Resize,
    "resize_center_crop": ResizeCenterCrop,
}


@dataclasses.dataclass(frozen=True)
class HostTransform:
    """``fit_to_square`` (how the DataModule stores images, if it does) then the eval pipeline's sizing ops.

    Attributes:
        storage_size: side of the square every image is stored at (shorter side resized, centre crop), as
            ``load_image_folder(storage_size=)``; ``None`` when the first op takes any size.
        ops: ``(name, arguments)`` of each sizing op of the eval pipeline, in order.
        size: ``(height, width)`` the graph takes.
    """

    storage_size: int | None
    ops: tuple[tuple[str, tuple[int, ...]], ...]
    size: tuple[int, int]

    @classmethod
    def from_datamodule(cls, datamodule: Any) -> HostTransform:
        """The transform of a recipe DataModule (``DigitsData``, ``CIFAR10Data``, ``ImageFolderData``)."""
        ops: list[tuple[str, tuple[int, ...]]] = []
        for op in datamodule.eval_pipeline.ops:
            if isinstance(op, Normalize):
                continue  # in the graph
            if isinstance(op, ResizeCenterCrop):
                ops.append(("resize_center_crop", (*op.size, op.resize_size)))
            elif isinstance(op, (CenterCrop, Resize)):
                ops.append(("center_crop" if isinstance(op, CenterCrop) else "resize", tuple(op.size)))
            else:
                raise ValueError(
                    f"the eval op {type(op).__name__} has no host equivalent in lcv_vision.deploy"
                )
        encoded = getattr(datamodule, "storage", "uint8") == "encoded"
        storage = None if encoded else int(getattr(datamodule, "storage_size", None) or datamodule.image_size)
        side = int(getattr(datamodule, "eval_image_size", None) or datamodule.image_size)
        return cls(storage_size=storage, ops=tuple(ops), size=(side, side))

    def to_json(self) -> dict[str, Any]:
        return {
            "storage_size": self.storage_size,
            "ops": [[n, list(a)] for n, a in self.ops],
            "size": self.size,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostTransform:
        ops = tuple((str(name), tuple(int(a) for a in args)) for name, args in data["ops"])
        for name, _ in ops:
            if name not in _OPS:
                raise ValueError(f"unknown host op {name!r} (known: {', '.join(_OPS)})")
        return cls(data["storage_size"], ops, (int(data["size"][0]), int(data["size"][1])))

    def __call__(self, image: Image.Image | torch.Tensor) -> torch.Tensor:
        """A PIL image (any mode, converted to RGB) or a uint8 ``(3, H, W)`` tensor -> uint8 ``(3, *size)``."""
        pixels = _rgb_tensor(image) if isinstance(image, Image.Image) else image
        if pixels.dtype != torch.uint8 or pixels.ndim != 3 or pixels.shape[0] != 3:
            raise ValueError(f"expected a uint8 (3, H, W) image, got {pixels.dtype} {tuple(pixels.shape)}")
        if self.storage_size is not None:
            pixels = fit_to_square(pixels, self.storage_size)
        batch = pixels.unsqueeze(0)
        for name, args in self.ops:
            op = _OPS[name](*_op_args(name, args))
            params = op.sample(1, batch.shape[-2], batch.shape[-1], torch.Generator().manual_seed(0))
            if isinstance(op, CenterCrop):  # one image's window: a view, where the batch op gathers (~1 ms)
                top, left = int(params["top"][0]), int(params["left"][0])
                batch = batch[..., top : top + op.size[0], left : left + op.size[1]]
            else:
                batch = op.apply(batch, params)
        if batch.is_floating_point():  # a fractional resample (ResizeCenterCrop): the package takes uint8
            batch = batch.round().clamp(0, 255).to(torch.uint8)
        if tuple(batch.shape[-2:]) != self.size:
            raise ValueError(f"the host transform gave {tuple(batch.shape[-2:])}, not {self.size}")
        return batch[0].contiguous()


def _op_args(name: str, args: Sequence[int]) -> tuple[Any, ...]:
    if name == "resize_center_crop":
        return ((args[0], args[1]), args[2])
    return ((args[0], args[1]),)


def _rgb_tensor(image: Image.Image) -> torch.Tensor:
    """``(3, H, W)`` over the decoder's interleaved pixels (channels-last strides, no planar copy): the
    antialiased uint8 resize of ``fit_to_square`` runs about twice as fast on that layout, with equal
    results."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
