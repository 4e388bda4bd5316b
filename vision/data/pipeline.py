"""A composable pipeline of batched augmentation ops with per-sample random parameters.

Every op splits into two steps: ``sample(n, height, width, generator)`` draws the per-sample parameters
on the CPU with an explicit ``torch.Generator`` (so the same seed gives the same batches on CPU and CUDA,
and tests can hand the very same parameters to albumentations), and ``apply(images, params)`` runs the
batched tensor ops on whatever device the images live on.

Images flow through the pipeline as ``(N, C, H, W)`` tensors: uint8 while only indexing ops (crop, flip)
touch them, float32 in 0..255 units after the first arithmetic op, and in normalized units after
:class:`~vision.data.color.Normalize`.  Batches whose images have different sizes enter as a
:class:`RaggedBatch`; the first op must then be a resizing op that brings them to one size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

Params = dict[str, Tensor]


@dataclass
class RaggedBatch:
    """Images of different sizes packed top-left into one zero-padded canvas.

    ``canvas`` is ``(N, C, Hmax, Wmax)`` uint8; ``heights`` and ``widths`` are int64 ``(N,)`` CPU tensors with
    each image's true size.  Resizing ops only ever read inside each image's true extent.
    """

    canvas: Tensor
    heights: Tensor
    widths: Tensor

    @classmethod
    def from_images(cls, images: Sequence[Tensor], device: torch.device | str | None = None) -> "RaggedBatch":
        if len(images) == 0:
            raise ValueError("RaggedBatch.from_images: got an empty list of images")
        channels = {int(im.shape[0]) for im in images}
        if len(channels) != 1:
            raise ValueError(f"RaggedBatch.from_images: images have different channel counts {sorted(channels)}")
        heights = torch.tensor([int(im.shape[-2]) for im in images], dtype=torch.int64)
        widths = torch.tensor([int(im.shape[-1]) for im in images], dtype=torch.int64)
        device = torch.device(device) if device is not None else images[0].device
        canvas = torch.zeros(
            (len(images), channels.pop(), int(heights.max()), int(widths.max())), dtype=images[0].dtype, device=device
        )
        for i, im in enumerate(images):
            canvas[i, :, : im.shape[-2], : im.shape[-1]].copy_(im, non_blocking=True)
        return cls(canvas, heights, widths)

    def __len__(self) -> int:
        return int(self.canvas.shape[0])



class BatchOp:
    """Base class of a batched op: ``sample`` draws per-sample params on the CPU, ``apply`` runs them."""

    #: True for ops that can take a :class:`RaggedBatch` (they resize everything to one output size).
    accepts_ragged: bool = False
    #: True for ops that also transform the targets (mixup / cutmix).
    mixes_targets: bool = False
    #: True for ops whose ``apply(store, params, index=...)`` can pick the batch out of a larger store.
    fuses_gather: bool = False

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        """Draw the parameters for ``n`` samples of size ``height`` x ``width`` (ints, or (N,) tensors)."""
        return {}

    def apply(self, images: Any, params: Params) -> Tensor:
        raise NotImplementedError

    def apply_targets(self, targets: Tensor, params: Params) -> Tensor:
        return targets

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return height, width

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _params_to(params: Params, device: torch.device) -> Params:
    if device.type == "cpu":
        return params
    return {k: v.to(device, non_blocking=True) for k, v in params.items()}


class Pipeline:
    """A list of :class:`BatchOp` run on whole batches, ending in the requested dtype and memory format.

    Args:
        ops: the ops, in order.
        dtype: floating dtype of the output images (e.g. ``torch.float32`` or ``torch.bfloat16``).
        channels_last: return images in ``torch.channels_last`` memory format.
    """

    def __init__(self, ops: Sequence[BatchOp], dtype: torch.dtype = torch.float32, channels_last: bool = True):
        ops = list(ops)
        for i, op in enumerate(ops):
            if not isinstance(op, BatchOp):
                raise TypeError(f"Pipeline: op {i} is {type(op).__name__}, not a vision.data BatchOp")
        if not dtype.is_floating_point:
            raise TypeError(f"Pipeline: output dtype must be floating point, got {dtype}")
        self.ops = ops
        self.dtype = dtype
        self.channels_last = channels_last

    @property
    def mixes_targets(self) -> bool:
        return any(op.mixes_targets for op in self.ops)

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> list[Params]:
        """Draw the parameters of every op for one batch (CPU tensors), tracking the size through the ops."""
        all_params = []
        for op in self.ops:
            all_params.append(op.sample(n, height, width, generator))
            height, width = op.output_size(height, width)
        return all_params

    def __call__(
        self,
        images: Tensor | RaggedBatch,
        targets: Tensor | None = None,
        generator: torch.Generator | None = None,
        params: list[Params] | None = None,
        index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Augment one batch. ``params`` (from :meth:`sample`) replaces sampling when given.

        With ``index`` (N,), ``images`` is a larger store and the batch is ``images[index]``; a first op that
        can, fuses that gather into its own (saves one pass over the batch).
        """
        fused_index = None
        if index is not None:
            if isinstance(images, RaggedBatch):
                raise TypeError("Pipeline: index= is only supported with a tensor image store")
            check_image_batch(images)
            if self.ops and self.ops[0].fuses_gather:
                fused_index = index
            else:
                images = images.index_select(0, index.to(images.device))
        if fused_index is not None:
            n, height, width, device = index.shape[0], int(images.shape[-2]), int(images.shape[-1]), images.device
        elif isinstance(images, RaggedBatch):
            if not self.ops or not self.ops[0].accepts_ragged:
                first = type(self.ops[0]).__name__ if self.ops else "nothing"
                raise ValueError(
                    "Pipeline: images of different sizes need a resizing first op "
                    f"(RandomResizedCrop, Resize, ResizeCenterCrop), but the first op is {first}"
                )
            n, height, width, device = len(images), images.heights, images.widths, images.canvas.device
        else:
            check_image_batch(images)
            n, height, width, device = images.shape[0], int(images.shape[-2]), int(images.shape[-1]), images.device
        if params is None:
            generator = generator if generator is not None else torch.Generator().manual_seed(0)
            params = self.sample(n, height, width, generator)
        if len(params) != len(self.ops):
            raise ValueError(f"Pipeline: got {len(params)} param dicts for {len(self.ops)} ops")
        x: Any = images
        if device.type == "cpu" and fused_index is None and not isinstance(images, RaggedBatch):
            chunk = self._cpu_chunk(int(images.shape[-2]), int(images.shape[-1]), params)
            if chunk is not None and n > chunk:
                return self._run_chunked(images, targets, params, chunk)
        for i, (op, p) in enumerate(zip(self.ops, params)):
            p = _params_to(p, device)
            x = op.apply(x, p, index=fused_index) if i == 0 and fused_index is not None else op.apply(x, p)
            if targets is not None and op.mixes_targets:
                targets = op.apply_targets(targets, p)
        if isinstance(x, RaggedBatch):
            raise ValueError("Pipeline: the batch still has images of different sizes after all ops")
        x = x.to(self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, targets

    def _cpu_chunk(self, height: int, width: int, params: list[Params]) -> int | None:
        """On CPU, large images go through the ops a few samples at a time so they stay in cache."""
        if self.mixes_targets:
            return None
        for op in self.ops:
            height, width = op.output_size(height, width)
        return None if height * width < 96 * 96 else 8

    def _run_chunked(self, images: Tensor, targets: Tensor | None, params: list[Params], chunk: int):
        outs = []
        n = images.shape[0]
        for s in range(0, n, chunk):
            sl = [{k: v[s: s + chunk] for k, v in p.items()} for p in params]
            x: Any = images[s: s + chunk]
            for op, p in zip(self.ops, sl):
                x = op.apply(x, p)
            outs.append(x.to(self.dtype))
        out = torch.cat(outs)
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return out, targets

    def __repr__(self) -> str:
        inner = "".join(f"\n  {op!r}," for op in self.ops)
        return f"Pipeline([{inner}\n], dtype={self.dtype}, channels_last={self.channels_last})"


def check_image_batch(images: Any) -> None:
    """Raise a clear error unless ``images`` is a ``(N, C, H, W)`` uint8 or floating tensor."""
    if not isinstance(images, Tensor):
        raise TypeError(f"expected a (N, C, H, W) tensor of images, got {type(images).__name__}")
    if images.ndim != 4:
        raise ValueError(f"expected images of shape (N, C, H, W), got shape {tuple(images.shape)}")
    if images.dtype != torch.uint8 and not images.dtype.is_floating_point:
        raise TypeError(f"expected uint8 (0..255) or floating images, got dtype {images.dtype}")
    if images.shape[1] not in (1, 3):
        raise ValueError(f"expected 1 or 3 channels in dim 1 (N, C, H, W), got shape {tuple(images.shape)}")


def as_float(images: Tensor) -> Tensor:
    """uint8 -> float32 in 0..255 units (no scaling); floats pass through."""
    return images.float() if images.dtype == torch.uint8 else images


def uniform(n: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    return torch.rand(n, generator=generator, dtype=torch.float64) * (high - low) + low


def bernoulli(n: int, p: float, generator: torch.Generator) -> Tensor:
    return torch.rand(n, generator=generator) < p
