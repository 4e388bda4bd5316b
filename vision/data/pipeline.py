"""A composable pipeline of batched augmentation ops with per-sample random parameters.

Every op splits into two steps: ``sample(n, height, width, generator)`` draws the per-sample parameters
on the CPU with an explicit ``torch.Generator`` (so the same seed gives the same batches on CPU and CUDA,
and tests can hand the very same parameters to albumentations), and ``apply(images, params)`` runs the
batched tensor ops on whatever device the images live on.

Images flow through the pipeline as ``(N, C, H, W)`` tensors: uint8 while only indexing ops (crop, flip)
touch them, float32 in 0..255 units after the first arithmetic op, and in normalized units after
:class:`~vision.data.color.Normalize`.  Batches whose images have different sizes enter as a
:class:`RaggedBatch`; the first op must then be a resizing op that brings them to one size.

On CPU a batch runs in slices on single-threaded workers (see :meth:`Pipeline._run_chunked`); on a GPU it
runs whole.  Both give the same result.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

Params = dict[str, Tensor]
#: Params key of a horizontal flip folded into the op before it (see ``BatchOp.fuses_flip``).
FLIP_AFTER = "flip_after"


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

    def __getitem__(self, rows: slice) -> "RaggedBatch":
        """The images ``rows`` (a slice) of the batch."""
        return RaggedBatch(self.canvas[rows], self.heights[rows], self.widths[rows])


class BatchOp:
    """Base class of a batched op: ``sample`` draws per-sample params on the CPU, ``apply`` runs them.

    Every params tensor has the batch in dim 0, and a sample's result may depend only on its own image and
    params (unless ``mixes_targets``): the pipeline may run any slice of a batch on its own.
    """

    #: True for ops that can take a :class:`RaggedBatch` (they resize everything to one output size).
    accepts_ragged: bool = False
    #: True for ops that also transform the targets (mixup / cutmix).
    mixes_targets: bool = False
    #: True for ops whose ``apply(store, params, index=...)`` can pick the batch out of a larger store.
    fuses_gather: bool = False
    #: True for ops that mirror their output where ``params[FLIP_AFTER]`` (N,) is set, at no extra cost;
    #: the pipeline then folds a directly following :class:`~vision.data.geometry.HorizontalFlip` into them.
    fuses_flip: bool = False
    #: True for ops whose ``apply(..., out=buffer)`` can write their result straight into the pipeline's
    #: output (any dtype and memory format), saving the final conversion pass.
    writes_out: bool = False

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
        plan = self._plan(params)
        channels = images.canvas.shape[1] if isinstance(images, RaggedBatch) else images.shape[1]
        out = self._empty_output(n, channels, height, width, device)
        if device.type == "cpu" and not self.mixes_targets:
            chunk = _cpu_chunk_size(n, out.shape[-2] * out.shape[-1])
            if chunk < n:
                self._run_chunked(images, plan, chunk, fused_index, out)
                return out, targets
        x: Any = images
        for i, (op, p) in enumerate(plan):
            p = _params_to(p, device)
            kwargs: dict[str, Any] = {}
            if i == 0 and fused_index is not None:
                kwargs["index"] = fused_index
            if i == len(plan) - 1 and op.writes_out:
                kwargs["out"] = out
            x = op.apply(x, p, **kwargs)
            if targets is not None and op.mixes_targets:
                targets = op.apply_targets(targets, p)
        if isinstance(x, RaggedBatch):
            raise ValueError("Pipeline: the batch still has images of different sizes after all ops")
        if x is not out:
            out.copy_(x)  # dtype and memory format in one pass
        return out, targets

    def _empty_output(self, n: int, channels: int, height: Any, width: Any, device: torch.device) -> Tensor:
        for op in self.ops:
            height, width = op.output_size(height, width)
        if isinstance(height, Tensor):
            raise ValueError("Pipeline: the batch still has images of different sizes after all ops")
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return torch.empty((n, channels, int(height), int(width)), dtype=self.dtype, device=device, memory_format=fmt)

    def _plan(self, params: list[Params]) -> list[tuple[BatchOp, Params]]:
        """The (op, params) pairs to run: a HorizontalFlip right after an op that ``fuses_flip`` is folded
        into it (one pass less; the result is identical)."""
        from vision.data.geometry import HorizontalFlip  # geometry imports this module

        plan: list[tuple[BatchOp, Params]] = []
        i = 0
        while i < len(self.ops):
            op, p = self.ops[i], params[i]
            nxt = self.ops[i + 1] if i + 1 < len(self.ops) else None
            if op.fuses_flip and type(nxt) is HorizontalFlip:
                p = {**p, FLIP_AFTER: params[i + 1]["flip"]}
                i += 1
            plan.append((op, p))
            i += 1
        return plan

    def _run_chunked(
        self, images: Tensor | RaggedBatch, plan: list[tuple[BatchOp, Params]], chunk: int, index: Tensor | None,
        out: Tensor,
    ) -> None:
        """CPU: run the ops on slices of the batch, in parallel on single-threaded workers, into ``out``.

        Same result as the whole batch (every op is per sample).  Workers with one thread each, rather than
        multi-threaded ops, keep going when another process takes a core (no barrier after every op), like
        the worker processes of a DataLoader.
        """
        starts = list(range(0, out.shape[0], chunk))

        def run_into(s: int) -> None:
            x: Any = images if index is not None else images[s: s + chunk]
            dest = out[s: s + chunk]
            for i, (op, p) in enumerate(plan):
                kwargs: dict[str, Any] = {}
                if i == 0 and index is not None:
                    kwargs["index"] = index[s: s + chunk]
                if i == len(plan) - 1 and op.writes_out:
                    kwargs["out"] = dest
                x = op.apply(x, {k: v[s: s + chunk] for k, v in p.items()}, **kwargs)
            if x is not dest:
                dest.copy_(x)

        threads = torch.get_num_threads()
        if threads > 1 and len(starts) > 1:
            # Worker threads do not inherit the caller's inference/grad mode: without this, Lightning's
            # evaluation (inference mode) fails copying into `out`, an inference tensor.
            inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

            def run_in_mode(s: int) -> None:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    run_into(s)

            list(_cpu_pool(threads).map(run_in_mode, starts))
        else:
            for s in starts:
                run_into(s)

    def __repr__(self) -> str:
        inner = "".join(f"\n  {op!r}," for op in self.ops)
        return f"Pipeline([{inner}\n], dtype={self.dtype}, channels_last={self.channels_last})"


#: Output pixels per sample above which CPU chunks hold a few samples (their float intermediates then stay
#: in the per-core cache: 4 x 224^2 x 3 float32 ~ 2.4 MB); below it the batch is split across the threads.
_LARGE_OUTPUT = 96 * 96
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _cpu_chunk_size(n: int, out_pixels: int) -> int:
    threads = torch.get_num_threads()
    if out_pixels >= _LARGE_OUTPUT:
        return 4
    return max(1, -(-n // (4 * threads)))


def _cpu_pool(threads: int) -> ThreadPoolExecutor:
    """A shared pool of ``threads`` workers, each with one intra-op thread (OpenMP's setting is per thread)."""
    key = (os.getpid(), threads)  # a forked child (DataLoader worker) must not reuse the parent's dead threads
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(threads, "vision-data", initializer=torch.set_num_threads, initargs=(1,))
    return _POOLS[key]


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
