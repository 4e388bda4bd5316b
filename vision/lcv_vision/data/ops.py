"""The op contract every batched augmentation follows, the ragged batch, and the CPU parameter samplers.

An op splits into ``sample`` (draw per-sample parameters on the CPU with an explicit ``torch.Generator``:
the same seed gives the same batches on CPU and CUDA, compiled or not, and tests can hand the very same
parameters to albumentations), ``prepare`` (derive per-sample tables from them, eagerly: index tables,
per-step coefficients, so that no per-sample scalar math is left inside the per-pixel kernel) and
``apply`` (the batched tensor ops, on whatever device the images live on, traceable by ``torch.compile``:
no Python branches on tensor values, no host syncs).

What an op can fuse is declared on the op, never inferred from its type by the pipeline:

- ``fold_key``/``folds``: an op that can be expressed as a parameter of the op before it (a horizontal flip
  becomes the mirrored sampling grid of a crop; a normalize, the last step of a colour jitter) names that
  parameter in ``fold_key`` and gives its value with :meth:`BatchOp.fold_as`; the op before it lists the
  keys it can take in ``folds``.
- ``fuses_gather``: the first op of a pipeline may pick the batch out of a larger store itself
  (``apply(store, params, index=...)``).
- ``compilable``: the op's ``apply`` can be traced into one graph with its neighbours; ``compiles_on(device)``
  says whether it should be on that device (an op with a faster eager kernel there says no).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lcv_vision.data.functional.pool import run_rows

Params = dict[str, Tensor]
#: Params key of a horizontal flip folded into the op before it.
FLIP_AFTER = "flip_after"
#: Params key of a normalize folded into the op before it: its ``(mean, std, max_pixel_value)`` as rows.
NORMALIZE_AFTER = "normalize_after"


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
    def from_images(cls, images: Sequence[Tensor], device: torch.device | str | None = None) -> RaggedBatch:
        if len(images) == 0:
            raise ValueError("RaggedBatch.from_images: got an empty list of images")
        channels = {int(im.shape[0]) for im in images}
        if len(channels) != 1:
            raise ValueError(
                f"RaggedBatch.from_images: images have different channel counts {sorted(channels)}"
            )
        heights = torch.tensor([int(im.shape[-2]) for im in images], dtype=torch.int64)
        widths = torch.tensor([int(im.shape[-1]) for im in images], dtype=torch.int64)
        device = torch.device(device) if device is not None else images[0].device
        # channels_last: decoders give (C, H, W) views of (H, W, C) pixels, so each copy is a plain memcpy,
        # and the CPU resize (functional.geometry.resize_boxes) reads channels_last.
        canvas = torch.empty(
            (len(images), channels.pop(), int(heights.max()), int(widths.max())),
            dtype=images[0].dtype,
            device=device,
            memory_format=torch.channels_last,
        )

        def place(rows: range) -> None:
            for i in rows:
                h, w = int(images[i].shape[-2]), int(images[i].shape[-1])
                canvas[i, :, :h, :w].copy_(images[i], non_blocking=True)
                canvas[i, :, h:].zero_()
                canvas[i, :, :h, w:].zero_()

        if device.type == "cpu":
            run_rows(place, len(images))  # single-threaded workers: see functional.pool
        else:
            place(range(len(images)))
        return cls(canvas, heights, widths)

    def __len__(self) -> int:
        return int(self.canvas.shape[0])

    def __getitem__(self, rows: slice) -> RaggedBatch:
        """The images ``rows`` (a slice) of the batch."""
        return RaggedBatch(self.canvas[rows], self.heights[rows], self.widths[rows])


class BatchOp:
    """Base class of a batched op (see the module docstring for the contract).

    Every params tensor has the batch in dim 0, and a sample's result may depend only on its own image and
    params (unless ``mixes_targets``): the pipeline may run any slice of a batch on its own.
    """

    #: True for ops that can take a :class:`RaggedBatch` (they resize everything to one output size).
    accepts_ragged: bool = False
    #: True for ops that also transform the targets (mixup / cutmix).
    mixes_targets: bool = False
    #: True for ops whose ``apply(store, params, index=...)`` can pick the batch out of a larger store.
    fuses_gather: bool = False
    #: Params keys of following ops this op can take over (see :meth:`fold_as`), e.g. ``{FLIP_AFTER}``.
    folds: frozenset[str] = frozenset()
    #: The params key under which this op can be folded into the op before it, if that op ``folds`` it.
    fold_key: str | None = None
    #: False for ops whose ``apply`` cannot be traced by ``torch.compile`` (Python loops over samples).
    compilable: bool = True
    #: True for ops whose ``prepare`` builds its tables on the device its params are on (element-wise
    #: arithmetic that gives the same tables everywhere): on a GPU the pipeline hands it the params there,
    #: so only the per-sample params cross from the CPU, not the larger tables, nor the CPU time to make them.
    prepares_on_device: bool = False

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        """Draw the parameters for ``n`` samples of size ``height`` x ``width`` (ints, or (N,) tensors)."""
        return {}

    def prepare(self, params: Params, shape: Sequence[int], index: Tensor | None = None) -> Params:
        """Per-sample tables derived from ``params``, computed eagerly before ``apply`` (default: none).

        ``shape`` is the ``(N, C, H, W)`` shape of the tensor ``apply`` will get (a batch, the store that
        ``index`` (CPU) picks the batch from, or the canvas of a :class:`RaggedBatch`).
        """
        return params

    def apply(self, images: Any, params: Params) -> Tensor:
        raise NotImplementedError

    def apply_into(self, images: Any, params: Params, out: Tensor) -> bool:
        """Write :meth:`apply`'s result, in ``out``'s dtype and layout, into ``out`` and return True; False
        (nothing written) where this op cannot, the default: the pipeline then copies ``apply``'s."""
        return False

    def compiles_on(self, device: torch.device) -> bool:
        """Whether the pipeline compiles this op's ``apply`` for images on ``device`` (default:
        ``compilable``)."""
        return self.compilable

    def apply_targets(self, targets: Tensor, params: Params) -> Tensor:
        return targets

    def output_size(self, height: Any, width: Any) -> tuple[Any, Any]:
        return height, width

    def fold_as(self, params: Params) -> Params:
        """This op's effect as params of the op before it: ``{self.fold_key: ...}``."""
        raise NotImplementedError(f"{type(self).__name__} declares no fold_key")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


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


def check_p(p: float, name: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: probability p must be in [0, 1], got {p}")


def uniform(n: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    return torch.rand(n, generator=generator, dtype=torch.float64) * (high - low) + low


def bernoulli(n: int, p: float, generator: torch.Generator) -> Tensor:
    return torch.rand(n, generator=generator) < p
