"""Say what a mid-epoch resume on another world size does to a training loader nobody remaps.

Lightning 2.6 saves no position for a ``DataLoader`` without ``state_dict``/``load_state_dict``: on a
mid-epoch resume it iterates the loader again from the epoch's first batch (the sampler gets the same
epoch, so the same order, now over the new ranks) while its batch counter keeps the ``k`` batches already
done, so the epoch ends ``k`` batches early (Lightning warns of this itself, at any world size). The
compiled strategies record the world size in their checkpoints and, on another one, swap Lightning's own
``DistributedSampler`` for :class:`~lightning_plugin.resumed_sampler.ResumedDistributedSampler`; lcv's
``DeviceLoader`` remaps itself. Any other loader (a custom sampler or batch sampler, or
``use_distributed_sampler=False``) gets one line saying what this epoch will do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_plugin.resumed_sampler import ResumedDistributedSampler

#: Checkpoint key under which the compiled strategies record the world size that wrote it.
WORLD_SIZE_KEY = "lcv_world_size"


def saved_world_size(checkpoint: Mapping[str, Any]) -> int | None:
    """The world size recorded in ``checkpoint`` (``None`` for checkpoints written by other strategies)."""
    value = checkpoint.get(WORLD_SIZE_KEY)
    return value if isinstance(value, int) else None


def is_stateful_loader(loader: Any) -> bool:
    """Whether Lightning saves and restores ``loader``'s position (it checks the same two methods)."""
    return all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))


def _is_remapped(loader: Any) -> bool:
    return isinstance(getattr(loader, "sampler", None), ResumedDistributedSampler)


def plain_resume_warning(
    *, saved: int | None, world_size: int, batches_done: int, mid_epoch: bool, loaders: Iterable[Any]
) -> str | None:
    """One line saying what happens to the rest of the epoch, or ``None`` when nothing is lost.

    Args:
        saved: world size that wrote the checkpoint (``None``: unknown, no warning).
        world_size: world size now.
        batches_done: batches per rank the epoch's loop counts as done (restored by Lightning).
        mid_epoch: whether Lightning restarted inside an epoch.
        loaders: the training loaders (Lightning's flattened ``CombinedLoader``).
    """
    if saved is None or saved == world_size or not mid_epoch or batches_done <= 0:
        return None
    if all(is_stateful_loader(loader) or _is_remapped(loader) for loader in loaders):
        return None  # lcv's DeviceLoader remaps its position itself; Lightning's sampler was swapped
    return (
        f"Resumed mid-epoch on world size {world_size} from a checkpoint written on {saved} after "
        f"{batches_done} batches per rank, with a DataLoader whose sampler cannot be remapped (a custom sampler or "
        "batch sampler, or no DistributedSampler): Lightning restarts this "
        f"epoch's sampler order from its first batch, sharded over {world_size} ranks, and ends the epoch "
        f"{batches_done} batches early, so some samples of this epoch repeat and others are skipped "
        "(later epochs are whole); resume from an end-of-epoch checkpoint or use a stateful loader "
        "(lcv's DeviceLoader) to use each sample once."
    )
