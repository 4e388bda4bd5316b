"""A ``DistributedSampler`` for the epoch resumed on another world size: it skips what the old ranks used.

``DistributedSampler`` gives rank ``r`` of ``W`` the strided share ``order[r::W]`` of the epoch's order
(seeded by ``seed + epoch``), so after ``k`` batches of ``B`` on every rank exactly the first ``k * B * W``
samples of the order were used. The resumed epoch shares the rest of that order over the new ranks; every
other epoch is the plain sampler's. ``len`` is the larger of a whole epoch's and the resumed epoch's count
(in Lightning's count, which keeps the ``k`` batches done): Lightning reads it once per ``fit`` and would cut
a longer epoch, while a shorter one just ends (the same rule as lcv's ``DeviceLoader``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumedDistributedSampler(DistributedSampler):
    """``base``'s sampler, except that epoch ``epoch`` begins at sample ``start`` of its order.

    Args:
        base: the sampler Lightning injected (its dataset, ranks, shuffle, seed and drop_last are kept).
        epoch: the epoch that was interrupted.
        start: samples of that epoch's order already used (``batches_done * batch_size * old_world_size``).
        batches_done: batches per rank Lightning counts as done in that epoch.
        batch_size: the DataLoader's batch size.
    """

    def __init__(
        self, base: DistributedSampler, *, epoch: int, start: int, batches_done: int, batch_size: int
    ) -> None:
        super().__init__(
            base.dataset,
            num_replicas=base.num_replicas,
            rank=base.rank,
            shuffle=base.shuffle,
            seed=base.seed,
            drop_last=base.drop_last,
        )
        if start < 0 or batches_done < 0 or batch_size < 1:
            raise ValueError(
                f"start={start}, batches_done={batches_done}, batch_size={batch_size}: out of range"
            )
        self.epoch = base.epoch
        self.resumed_epoch = epoch
        self.start = start
        self.batches_done = batches_done
        self.batch_size = batch_size

    def _order(self) -> list[int]:
        """The epoch's order, drawn as ``DistributedSampler`` draws it."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _rest(self) -> list[int]:
        """This rank's share of the samples the interrupted epoch had not used."""
        rest = self._order()[self.start :]
        world = self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) // world * world]
        elif rest and len(rest) % world:
            pad = world - len(rest) % world
            rest += (rest * (pad // len(rest) + 1))[:pad]  # as DistributedSampler pads: from the front
        return rest[self.rank :: world]

    def _resumed_length(self) -> int:
        rest = max(0, len(self.dataset) - self.start)  # type: ignore[arg-type]
        share = rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)
        return self.batches_done * self.batch_size + share

    def __iter__(self) -> Iterator[int]:
        if self.epoch != self.resumed_epoch:
            return super().__iter__()
        return iter(self._rest())

    def __len__(self) -> int:
        return max(self.num_samples, self._resumed_length())
