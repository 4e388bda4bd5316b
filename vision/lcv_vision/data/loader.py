"""The batch loader: uint8 images in memory (on the device when they fit), per-batch augmentation on the
device.

Ordering and augmentation are counter-based: the permutation of epoch ``e`` and the augmentation generator
of batch ``b`` are seeded from ``(seed, e)`` and ``(seed, e, rank, b)``, so the loader's whole random state
is ``(seed, epoch, position)``.  That makes runs reproducible, resumable mid-epoch from a checkpoint, and
identical on CPU and CUDA (parameters are always drawn on the CPU).

Resuming on another world size: ranks take strided shares of the epoch's order, so after ``p`` batches of
``B`` on ``W`` ranks exactly the first ``p * B * W`` samples of the order are used. A loader restored with a
different world size shards the rest of that order over its own ranks (a *segment* of the epoch starting at
that sample, and at batch ``p`` in the epoch's count): no sample of the epoch is skipped or repeated.

Two kinds of storage:

- a uint8 ``(N, C, H, W)`` tensor: on the device when it fits; otherwise in host memory, each batch gathered
  into pinned memory and copied on a side CUDA stream one batch ahead (the consumer's stream waits on it);
- :class:`~lcv_vision.data.datasets.EncodedImages` (JPEG/PNG files) for data sets too large to hold decoded:
  worker threads read (and on CPU decode) the next batch while the current one is used; on CUDA the JPEGs
  of a batch are decoded together by ``torchvision.io.decode_jpeg(list, device="cuda")`` (nvJPEG).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch import Tensor

from lcv_vision.data.datasets import CorruptImageError, EncodedImages, OnCorrupt, decode_image_bytes, is_jpeg
from lcv_vision.data.pipeline import Pipeline, RaggedBatch, check_image_batch

Uneven = Literal["exact", "pad", "drop"]
_UNEVEN = ("exact", "pad", "drop")


def derive_seed(*values: int) -> int:
    """A 63-bit seed from a tuple of ints (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(tuple(int(v) for v in values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def shard_indices(order: Tensor, rank: int, world_size: int, uneven: Uneven = "exact") -> Tensor:
    """This rank's share of ``order``: the strided shard ``order[rank::world_size]``.

    ``exact`` keeps every sample once (shard lengths differ by at most one); ``pad`` repeats the first
    samples of ``order`` so that all shards have the same length (every sample at least once, like
    ``DistributedSampler``); ``drop`` cuts the tail instead (every sample at most once).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if uneven not in _UNEVEN:
        raise ValueError(f"uneven must be 'exact', 'pad' or 'drop', got {uneven!r}")
    n = order.numel()
    if world_size == 1:
        return order
    if uneven == "pad":
        total = -(-n // world_size) * world_size
        if total > n:
            order = torch.cat([order, order[: total - n]])
    elif uneven == "drop":
        order = order[: (n // world_size) * world_size]
    return order[rank::world_size]


def num_batches(num_samples: int, batch_size: int, world_size: int, uneven: Uneven, drop_last: bool) -> int:
    """Batches per rank and epoch; the same on every rank (DDP needs equal step counts)."""
    if uneven == "pad":
        shortest = -(-num_samples // world_size)
    else:
        shortest = num_samples // world_size
    return shortest // batch_size if drop_last else -(-shortest // batch_size)


def split_batches(shard: Tensor, batch_size: int, count: int, drop_last: bool) -> list[Tensor]:
    """``count`` batches of ``batch_size`` from ``shard``; without ``drop_last`` the last one takes the rest.

    With ``uneven="exact"`` a rank whose shard is one longer than the shortest gets that extra sample in its
    last batch (which may then hold ``batch_size + 1``): every rank keeps the same number of batches.
    """
    out = [shard[b * batch_size : (b + 1) * batch_size] for b in range(count - 1)]
    if count > 0:
        end = count * batch_size if drop_last else shard.numel()
        out.append(shard[(count - 1) * batch_size : end])
    return out


def first_images(batches: Iterable[tuple[Tensor, Any]], n: int) -> Tensor | None:
    """The first ``n`` images of ``(images, targets)`` batches, reading no more batches than that takes (fewer
    images when they run out; None when there are none). For data-dependent initialisation."""
    chunks, count = [], 0
    for images, _ in batches:
        chunks.append(images)
        count += images.shape[0]
        if count >= n:
            break
    return torch.cat(chunks)[:n] if chunks else None


class DeviceLoader:
    """Iterates ``(images, targets)`` batches augmented by ``pipeline`` on ``device``.

    Args:
        images: uint8 ``(N, C, H, W)`` tensor of the whole data set (any memory format), or
            :class:`~lcv_vision.data.datasets.EncodedImages` decoded per batch (the pipeline must then start
            with a resizing op, as the images have different sizes).
        targets: integer class labels ``(N,)``.
        batch_size: samples per batch (per rank).
        pipeline: the batched augmentation :class:`Pipeline`.
        shuffle: new random order every epoch.
        drop_last: drop the last incomplete batch.
        seed: base seed of ordering and augmentation.
        device: where batches are produced; ``None`` = CPU.
        rank, world_size: DDP shard of this process.
        uneven: when the data set does not split evenly across ranks: ``exact`` (every sample exactly once
            per epoch; last batches may differ by one sample between ranks), ``pad`` or ``drop``.
        resident: keep the whole uint8 store on ``device`` (default: when it uses < 25% of free memory).
        decode_threads: threads that read and decode :class:`EncodedImages`.
        on_corrupt: for :class:`EncodedImages`: ``raise`` (naming the file) or ``skip`` (the batch is one
            smaller; :attr:`skipped` counts them).
    """

    #: Lightning looks for ``loader.sampler.set_epoch`` and inspects ``loader.batch_sampler``.
    batch_sampler = None

    def __init__(
        self,
        images: Tensor | EncodedImages,
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
        uneven: Uneven = "exact",
        resident: bool | None = None,
        decode_threads: int = 2,
        on_corrupt: OnCorrupt = "raise",
    ):
        encoded = isinstance(images, EncodedImages)
        if not isinstance(images, EncodedImages):
            check_image_batch(images)
            if images.dtype != torch.uint8:
                raise TypeError(f"DeviceLoader stores uint8 images (0..255); got dtype {images.dtype}")
        num_samples = len(images) if isinstance(images, EncodedImages) else int(images.shape[0])
        if num_samples == 0:
            raise ValueError("DeviceLoader: the data set is empty (0 images)")
        if batch_size < 1:
            raise ValueError(f"DeviceLoader: batch_size must be >= 1, got {batch_size}")
        if not isinstance(pipeline, Pipeline):
            raise TypeError(
                f"DeviceLoader: pipeline must be a lcv_vision.data.Pipeline, got {type(pipeline).__name__}"
            )
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        shard_indices(torch.arange(1), rank, world_size, uneven)  # validates rank and uneven
        if uneven == "exact" and num_samples < world_size:
            raise ValueError(
                f"DeviceLoader: {num_samples} samples cannot give each of {world_size} ranks one exactly "
                "once; use uneven='pad'"
            )
        targets = _check_targets(targets, num_samples)
        if encoded and (not pipeline.ops or not pipeline.ops[0].accepts_ragged):
            first = type(pipeline.ops[0]).__name__ if pipeline.ops else "nothing"
            raise ValueError(
                "DeviceLoader: images decoded per batch have different sizes, so the pipeline must start "
                f"with RandomResizedCrop, Resize or ResizeCenterCrop; it starts with {first}"
            )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.batch_size = batch_size
        self.pipeline = pipeline
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.uneven: Uneven = uneven
        self.num_samples = num_samples
        self.on_corrupt: OnCorrupt = on_corrupt
        self.skipped = 0
        self._encoded = images if isinstance(images, EncodedImages) else None
        self._pool = ThreadPoolExecutor(max(1, decode_threads), "vision-decode") if encoded else None
        self._images: Tensor | None
        if isinstance(images, EncodedImages):
            self.resident = False
            self._images = None
        else:
            if resident is None:
                resident = self.device.type == "cpu" or _fits_on_device(images, self.device)
            self.resident = resident
            # Not resident: the store stays where it is (pinning it all would copy it); each batch is
            # gathered into a pinned buffer instead.
            self._images = images.to(self.device) if resident else images
        self._targets = targets.to(self.device if self.resident else "cpu")
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        # Where the current epoch's segment begins (both 0 unless resumed on another world size): samples of
        # the epoch's order used before it, and batches of the epoch counted before it.
        self._segment_start = 0
        self._segment_base = 0
        self._length_read: int | None = None  # what __len__ last told a caller (Lightning fixes its limits)
        self._started = False  # whether a pass over `epoch` has begun (the next pass then is a new epoch)
        self._resume = False  # load_state_dict was called: the next pass continues at `position`

    # ----------------------------------------------------------------------------------------- sizes
    def __len__(self) -> int:
        """Batches per epoch and rank. The epoch resumed on another world size may hold more (from 1 rank
        to 2, say) or fewer; ``len`` is then the larger of that and a whole epoch's count, as Lightning
        reads it once per ``fit`` and would cut every longer epoch after (a shorter one just ends)."""
        full = num_batches(self.num_samples, self.batch_size, self.world_size, self.uneven, self.drop_last)
        self._length_read = max(full, self._epoch_length())
        return self._length_read

    def _epoch_length(self) -> int:
        """Batches of the current epoch (in the epoch's count, the resumed segment included)."""
        return self._segment_length(self._segment_start, self._segment_base, self.world_size)

    def _segment_length(self, start: int, base: int, world_size: int) -> int:
        """Batches of the epoch (in the epoch's count) when its samples from ``start`` on, counted from
        batch ``base``, are shared by ``world_size`` ranks."""
        rest = num_batches(self.num_samples - start, self.batch_size, world_size, self.uneven, self.drop_last)
        return base + rest

    # ----------------------------------------------------------------------------------------- order
    def epoch_indices(self, epoch: int) -> Tensor:
        """This rank's sample indices for ``epoch``, in order."""
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        return shard_indices(order, self.rank, self.world_size, self.uneven)

    def epoch_batches(self, epoch: int) -> list[Tensor]:
        """This rank's batches of sample indices for ``epoch``."""
        n = num_batches(self.num_samples, self.batch_size, self.world_size, self.uneven, self.drop_last)
        return split_batches(self.epoch_indices(epoch), self.batch_size, n, self.drop_last)

    def _segment_batches(self, epoch: int) -> list[Tensor]:
        """Batches ``_segment_base`` onwards of ``epoch``: this rank's share of the order from
        ``_segment_start`` on (the whole epoch unless resumed on another world size)."""
        if self._segment_start == 0 and self._segment_base == 0:
            return self.epoch_batches(epoch)
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        shard = shard_indices(order[self._segment_start :], self.rank, self.world_size, self.uneven)
        count = self._epoch_length() - self._segment_base
        return split_batches(shard, self.batch_size, count, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (Lightning calls this before every epoch).

        Calling it with the current epoch changes nothing, so a state restored by :meth:`load_state_dict`
        still resumes mid-epoch.
        """
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._start_epoch()
            self._started = False
            self._resume = False

    def _start_epoch(self) -> None:
        self.position = 0
        self._segment_start = self._segment_base = 0

    def batch_normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """The pipeline's normalisation: implements
        ``lightning_plugin.callbacks.image_grid.NormalizedBatches``, so the monitor's image grid shows the
        images un-normalised."""
        return self.pipeline.batch_normalization()

    @property
    def sampler(self) -> DeviceLoader:
        # Lightning's `_set_sampler_epoch` looks for `loader.sampler.set_epoch`.
        return self

    # ----------------------------------------------------------------------------------------- batches
    def _fetch(self, indices: Tensor | None) -> Any:
        """Start getting the images of one batch: background reads/decodes for encoded files."""
        assert indices is not None  # only batches before a resumed segment are None, and they are not read
        if self._encoded is None:
            return indices
        decode_on_cpu = self.device.type != "cuda"
        assert self._pool is not None  # made with _encoded
        return indices, [self._pool.submit(self._read_one, int(i), decode_on_cpu) for i in indices]

    def _read_one(self, i: int, decode: bool) -> Tensor | bytes | None:
        assert self._encoded is not None
        try:
            data = self._encoded.read(i)
            if decode or not is_jpeg(data):  # nvJPEG takes JPEGs only: other formats decode here
                return decode_image_bytes(data, self._encoded.name(i))
            return data
        except CorruptImageError:
            if self.on_corrupt == "raise":
                raise
            return None

    def _decode(self, fetched: Any) -> tuple[RaggedBatch, Tensor]:
        """The decoded batch (on the device) and the sample indices that survived ``on_corrupt="skip"``."""
        assert self._encoded is not None
        indices, futures = fetched
        items: list[Tensor | bytes | None] = [f.result() for f in futures]
        jpegs = [j for j, item in enumerate(items) if isinstance(item, bytes)]
        if jpegs:
            blobs = [item for item in items if isinstance(item, bytes)]  # items[j] for j in jpegs
            decoded = self._decode_jpegs_on_device(blobs, indices[jpegs])
            for j, img in zip(jpegs, decoded):
                items[j] = img
        keep = [j for j, item in enumerate(items) if item is not None]
        self.skipped += len(items) - len(keep)
        if not keep:
            names = ", ".join(repr(self._encoded.name(int(i))) for i in indices)
            raise CorruptImageError(f"every image of a batch is corrupt, nothing left to skip to: {names}")
        images = [item for item in items if isinstance(item, Tensor)]  # items[j] for j in keep: all decoded
        return RaggedBatch.from_images(images, device=self.device), indices[keep]

    def _decode_jpegs_on_device(self, blobs: list[bytes], indices: Tensor) -> list[Tensor | None]:
        """nvJPEG, all at once; if that fails, one by one on the CPU to name (or skip) the corrupt file."""
        import torchvision.io as tio

        assert self._encoded is not None
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        try:
            return list(tio.decode_jpeg(data, mode=tio.ImageReadMode.RGB, device=self.device))
        except RuntimeError:
            out: list[Tensor | None] = []
            for b, i in zip(blobs, indices.tolist()):
                try:
                    out.append(decode_image_bytes(b, self._encoded.name(i)))
                except CorruptImageError:
                    if self.on_corrupt == "raise":
                        raise
                    out.append(None)
            return out

    def _batch(self, fetched: Any, epoch: int, b: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, self.rank, b))
        if self._encoded is not None:
            ragged, indices = self._decode(fetched)
            targets = self._targets.index_select(0, indices).to(self.device, non_blocking=True)
            return self._augment(ragged, targets, g)
        indices = fetched
        assert self._images is not None  # a tensor store (not encoded)
        if self.resident:  # the pipeline builds its index tables from the CPU indices
            idx = indices.to(self.device, non_blocking=True)
            return self._augment(self._images, self._targets.index_select(0, idx), g, index=indices)
        if self.device.type == "cuda":  # gather straight into pinned memory, then an async copy
            host = torch.empty(
                (indices.numel(), *self._images.shape[1:]),
                dtype=torch.uint8,
                memory_format=_memory_format(self._images),
                pin_memory=True,
            )
            torch.index_select(self._images, 0, indices, out=host)
            store = host.to(self.device, non_blocking=True)
        else:
            store = self._images.index_select(0, indices)
        targets = self._targets.index_select(0, indices).to(self.device, non_blocking=True)
        return self._augment(store, targets, g)

    def _augment(
        self, images: Tensor | RaggedBatch, targets: Tensor, g: torch.Generator, index: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        out, augmented = self.pipeline(images, targets, g, index=index)
        assert augmented is not None  # the pipeline returns targets when it is given them
        return out, augmented

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self._pass()

    def _pass(self) -> Iterator[tuple[Tensor, Tensor]]:
        # A generator: where the pass starts is decided at the first next(), after Lightning's set_epoch and
        # load_state_dict (Lightning also calls iter() once just to check that the loader is iterable).
        if self._resume:
            self._resume = False
            if self.position >= self._epoch_length():  # saved at the very end of an epoch
                self.epoch += 1
                self._start_epoch()
        else:
            if self._started:  # a new pass over an epoch already (partly) seen: the next epoch
                self.epoch += 1
            self._start_epoch()
        self._started = True
        epoch, start = self.epoch, self.position
        # batches[b] is batch b of the epoch's count (None before this segment: never read)
        batches: list[Tensor | None] = [None] * self._segment_base + list(self._segment_batches(epoch))
        skipped_before = self.skipped
        if self.device.type == "cuda":
            yield from self._iterate_cuda(batches, epoch, start)
        else:
            fetched = {start: self._fetch(batches[start])} if start < len(batches) else {}
            for b in range(start, len(batches)):
                if b + 1 < len(batches):  # reads/decodes of the next batch overlap with this one
                    fetched[b + 1] = self._fetch(batches[b + 1])
                x, y = self._batch(fetched.pop(b), epoch, b)
                self.position = b + 1
                yield x, y
        if self.skipped > skipped_before:
            warnings.warn(
                f"skipped {self.skipped - skipped_before} corrupt or unreadable image(s) in epoch {epoch}",
                stacklevel=2,
            )

    def _iterate_cuda(
        self, batches: list[Tensor | None], epoch: int, start: int
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Batch ``b + 1`` is fetched, copied and augmented on a side stream while ``b`` is consumed."""
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)

        def prepare(b: int, fetched: Any) -> tuple[Tensor, Tensor, torch.cuda.Event]:
            side.wait_stream(main)  # the store and reused memory were last written on the main stream
            with torch.cuda.stream(side):
                x, y = self._batch(fetched, epoch, b)
                event = torch.cuda.Event()
                event.record(side)
            return x, y, event

        n = len(batches)
        fetched = {b: self._fetch(batches[b]) for b in range(start, min(start + 2, n))}
        pending = prepare(start, fetched.pop(start)) if start < n else None
        for b in range(start, n):
            assert pending is not None
            x, y, event = pending
            if b + 2 < n:
                fetched[b + 2] = self._fetch(batches[b + 2])
            pending = prepare(b + 1, fetched.pop(b + 1)) if b + 1 < n else None
            main.wait_event(event)
            # x and y were allocated on the side stream: keep the allocator from reusing them while the
            # main stream still works on them.
            x.record_stream(main)
            y.record_stream(main)
            self.position = b + 1
            yield x, y

    # ----------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``(seed, epoch, position)`` is the complete random state (see module docstring); the segment
        fields say where a resumed epoch's current world size took over."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "segment_start": self._segment_start,
            "segment_base": self._segment_base,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "uneven": self.uneven,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved: the next pass yields that epoch's remaining batches.

        Saved with another world size (same data, batch size, ``uneven`` and ``drop_last``), the samples
        of the epoch not yet used are shared over this loader's ranks: the epoch then has a different
        number of batches (``len()`` says how many), each sample still once."""
        for key in ("num_samples", "batch_size", "uneven", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"DeviceLoader.load_state_dict: checkpoint has {key}={state[key]} but this loader has "
                    f"{getattr(self, key)}; the remaining batches would not be the same"
                )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        start, base = int(state.get("segment_start", 0)), int(state.get("segment_base", 0))
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world == self.world_size:
            self._segment_start, self._segment_base = start, base
        elif self.position >= self._segment_length(start, base, saved_world):  # the epoch was used up
            self._segment_start = self._segment_base = 0
            self.position = self._epoch_length()  # the next pass starts the next epoch
        else:
            self._remap(start + (self.position - base) * self.batch_size * saved_world, self.position)
        self._resume = True

    def _remap(self, used: int, base: int) -> None:
        """Share the samples of the epoch's order from ``used`` on over this world size, from batch ``base``."""
        before = self._length_read
        self._segment_start, self._segment_base = used, base
        if before is not None and len(self) > before:
            raise ValueError(
                f"DeviceLoader.load_state_dict: the resumed epoch now has {self._epoch_length()} batches "
                f"(saved on another world size), but {before} were already read from len(); Lightning fixes "
                "its epoch length before loading a loader passed to fit() directly, and would drop the rest. "
                "Pass the loader through a LightningDataModule (as lcv_vision's data modules do)"
            )


def _check_targets(targets: Any, n: int) -> Tensor:
    if not isinstance(targets, Tensor):
        raise TypeError(
            f"DeviceLoader: targets must be a tensor of class indices, got {type(targets).__name__}"
        )
    if targets.ndim != 1 or targets.shape[0] != n:
        raise ValueError(
            f"DeviceLoader: targets must be (N,) with N = {n} images, got {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex:
        if not bool((targets == targets.round()).all()):
            raise TypeError(
                f"DeviceLoader: targets must be integer class indices, got non-integral {targets.dtype} "
                "values (soft targets come from MixupCutmix in the pipeline)"
            )
    elif targets.dtype == torch.bool:
        raise TypeError("DeviceLoader: targets must be integer class indices, got torch.bool")
    return targets.long()


def _memory_format(images: Tensor) -> torch.memory_format:
    if images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def _fits_on_device(images: Tensor, device: torch.device, fraction: float = 0.25) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return images.numel() * images.element_size() < fraction * free
