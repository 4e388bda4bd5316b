"""The resumed epoch's sampler: ranks simulated in one process by explicit ``num_replicas``/``rank``."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from lightning_plugin.resumed_sampler import ResumedDistributedSampler

EPOCH, BATCH, DONE = 3, 2, 2  # interrupted in epoch 3 after 2 batches of 2 on every rank


def _plain(n: int, world: int, rank: int, epoch: int = EPOCH) -> DistributedSampler:
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    return sampler


def _resumed(n: int, old: int, world: int, rank: int) -> ResumedDistributedSampler:
    base = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)  # as injected
    sampler = ResumedDistributedSampler(
        base, epoch=EPOCH, start=DONE * BATCH * old, batches_done=DONE, batch_size=BATCH
    )
    sampler.set_epoch(EPOCH)  # what Lightning's fit loop does before the epoch
    return sampler


@pytest.mark.parametrize("n", [24, 23])
@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_every_sample_of_the_epoch_once_across_the_resume(n, old, new):
    used = [i for r in range(old) for i in list(_plain(n, old, r))[: DONE * BATCH]]
    shares = [list(_resumed(n, old, new, r)) for r in range(new)]
    rest = [i for share in shares for i in share]
    assert len(set(used)) == len(used) and not set(used) & set(rest)
    assert set(used) | set(rest) == set(range(n))
    padding = -(n - len(used)) % new  # DistributedSampler's own: ranks get equal shares
    assert len(rest) == n - len(used) + padding and len(rest) - len(set(rest)) == padding
    assert len({len(share) for share in shares}) == 1  # every rank the same number of batches
    for r in range(new):
        assert len(_resumed(n, old, new, r)) == max(
            _plain(n, new, r).num_samples, DONE * BATCH + len(shares[r])
        )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_same_world_size_continues_exactly_where_the_epoch_stopped(world):
    for r in range(world):
        assert list(_resumed(24, world, world, r)) == list(_plain(24, world, r))[DONE * BATCH :]


def test_other_epochs_are_the_plain_samplers():
    sampler = _resumed(23, 2, 3, 1)
    for epoch in (EPOCH - 1, EPOCH + 1):
        sampler.set_epoch(epoch)
        assert list(sampler) == list(_plain(23, 3, 1, epoch))


def test_rejects_a_negative_start():
    with pytest.raises(ValueError, match="start=-1"):
        ResumedDistributedSampler(_plain(4, 1, 0), epoch=0, start=-1, batches_done=0, batch_size=1)
