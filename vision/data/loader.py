"""The batch loader: uint8 images in memory (on the device when they fit), per-batch augmentation on the device.

Ordering and augmentation are counter-based: the permutation of epoch ``e`` and the augmentation generator
of batch ``b`` are seeded from ``(seed, e)`` and ``(seed, e, rank, b)``, so the loader's whole random state
is ``(seed, epoch, position)``.  That makes runs reproducible, resumable mid-epoch from a checkpoint, and
identical on CPU and CUDA (parameters are always drawn on the CPU).

On CUDA with a host-resident store, the next batch is gathered into pinned memory, copied and augmented on a
side stream one batch ahead; the consumer's stream waits on it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Literal

import torch
from torch import Tensor

from vision.data.pipeline import Pipeline, check_image_batch

Uneven = Literal["pad", "drop"]


def derive_seed(*values: int) -> int:
    """A 63-bit seed from a tuple of ints (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(tuple(int(v) for v in values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def shard_indices(order: Tensor, rank: int, world_size: int, uneven: Uneven = "pad") -> Tensor:
    """This rank's share of ``order``: disjoint strided shards of equal length.

    ``pad`` repeats the first samples of ``order`` so every sample is seen at least once (and, when the size
    divides evenly, exactly once); ``drop`` cuts the tail so every sample is seen at most once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    n = order.numel()
    if world_size == 1:
        return order
    if uneven == "pad":
        total = -(-n // world_size) * world_size
        if total > n:
            order = torch.cat([order, order[: total - n]])
    elif uneven == "drop":
        order = order[: (n // world_size) * world_size]
    else:
        raise ValueError(f"uneven must be 'pad' or 'drop', got {uneven!r}")
    return order[rank::world_size]


class DeviceLoader:
    """Iterates ``(images, targets)`` batches augmented by ``pipeline`` on ``device``.

    Args:
        images: uint8 ``(N, C, H, W)`` tensor of the whole data set (any memory format).
        targets: int64 ``(N,)`` labels.
        batch_size: samples per batch (per rank).
        pipeline: the batched augmentation :class:`Pipeline`.
        shuffle: new random order every epoch.
        drop_last: drop the last incomplete batch.
        seed: base seed of ordering and augmentation.
        device: where batches are produced; ``None`` = CPU.
        rank, world_size: DDP shard of this process.
        uneven: ``pad`` or ``drop`` when the data set does not split evenly across ranks.
        resident: keep the whole uint8 store on ``device`` (default: when it uses < 25% of free memory).
    """

    def __init__(
        self,
        images: Tensor,
        targets: Tensor,
        batch_size: int,
        pipeline: Pipeline,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
        rank: int = 0,
        world_size: int = 1,
        uneven: Uneven = "pad",
        resident: bool | None = None,
    ):
        check_image_batch(images)
        if images.dtype != torch.uint8:
            raise TypeError(f"DeviceLoader stores uint8 images (0..255); got dtype {images.dtype}")
        if images.shape[0] == 0:
            raise ValueError("DeviceLoader: the data set is empty (0 images)")
        if targets.ndim != 1 or targets.shape[0] != images.shape[0]:
            raise ValueError(
                f"DeviceLoader: targets must be (N,) with N = {images.shape[0]} images, got {tuple(targets.shape)}"
            )
        if batch_size < 1:
            raise ValueError(f"DeviceLoader: batch_size must be >= 1, got {batch_size}")
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"DeviceLoader: pipeline must be a vision.data.Pipeline, got {type(pipeline).__name__}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.batch_size = batch_size
        self.pipeline = pipeline
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.uneven = uneven
        shard_indices(torch.arange(1), rank, world_size, uneven)  # validate early
        self.num_samples = int(images.shape[0])
        if resident is None:
            resident = self.device.type == "cpu" or _fits_on_device(images, self.device)
        self.resident = resident
        if resident:
            self._images = images.to(self.device)
        else:
            self._images = images.pin_memory() if self.device.type == "cuda" else images
        self._targets = targets.long().to(self.device if resident else "cpu")
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    # ----------------------------------------------------------------------------------------- sizes
    def _shard_len(self) -> int:
        n = self.num_samples
        if self.world_size == 1:
            return n
        return -(-n // self.world_size) if self.uneven == "pad" else n // self.world_size

    def __len__(self) -> int:
        m = self._shard_len()
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    # ----------------------------------------------------------------------------------------- order
    def epoch_indices(self, epoch: int) -> Tensor:
        """This rank's sample indices for ``epoch``, in order."""
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        return shard_indices(order, self.rank, self.world_size, self.uneven)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (Lightning calls this each epoch); keeps the position when it is the current one."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.position = 0

    @property
    def sampler(self) -> "DeviceLoader":
        # Lightning's `_set_sampler_epoch` looks for `loader.sampler.set_epoch`.
        return self

    # ----------------------------------------------------------------------------------------- batches
    def _batch(self, indices: Tensor, epoch: int, b: int, stream: Any = None) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, self.rank, b))
        if self.resident:
            idx = indices.to(self.device, non_blocking=True)
            store, targets = self._images, self._targets.index_select(0, idx)
        else:
            host = self._images.index_select(0, indices)
            if self.device.type == "cuda":
                host = host.pin_memory()
            store = host.to(self.device, non_blocking=True)
            targets = self._targets.index_select(0, indices).to(self.device, non_blocking=True)
            idx = None
        images, targets = self.pipeline(store, targets, g, index=idx)
        return images, targets

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self._iterate()

    def _iterate(self) -> Iterator[tuple[Tensor, Tensor]]:
        # Lazy: reads (epoch, position) at the first next(), after Lightning's set_epoch / load_state_dict.
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        epoch, start = self.epoch, self.position
        indices = self.epoch_indices(epoch)
        starts = list(range(0, indices.numel(), self.batch_size))[: len(self)]
        use_stream = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if use_stream else None

        def prepare(b: int) -> tuple[Tensor, Tensor, Any]:
            sel = indices[starts[b]: starts[b] + self.batch_size]
            if stream is None:
                return (*self._batch(sel, epoch, b), None)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # store / buffers written on the main stream
            with torch.cuda.stream(stream):
                x, y = self._batch(sel, epoch, b)
                event = torch.cuda.Event()
                event.record(stream)
            return x, y, event

        pending = prepare(start) if start < len(starts) else None
        for b in range(start, len(starts)):
            assert pending is not None
            x, y, event = pending
            pending = prepare(b + 1) if b + 1 < len(starts) else None  # one batch ahead
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                x.record_stream(torch.cuda.current_stream(self.device))
                y.record_stream(torch.cuda.current_stream(self.device))
            self.position = b + 1
            yield x, y

    # ----------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``(seed, epoch, position)`` is the complete random state (see module docstring)."""
        return {
            "seed": self.seed, "epoch": self.epoch, "position": self.position,
            "num_samples": self.num_samples, "world_size": self.world_size, "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "world_size", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"DeviceLoader.load_state_dict: checkpoint has {key}={state[key]} but this loader has "
                    f"{getattr(self, key)}; the remaining batches would not be the same"
                )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def _fits_on_device(images: Tensor, device: torch.device, fraction: float = 0.25) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return images.numel() * images.element_size() < fraction * free
