"""A mid-epoch resume on another world size with a plain DataLoader says what happens to the epoch.

In one process (DDP at world size 1, the checkpoint's world size edited to 2): Lightning's injected
``DistributedSampler`` is swapped and the resumed epoch uses exactly the samples 2 ranks had not; a sampler
that cannot be swapped gets the line, whose claim about Lightning (the epoch restarts at its first batch
and ends as many batches early as were done) is checked against the samples seen.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from boring import TRAINER_KWARGS, TinyModule
from lightning_plugin import CompiledDDPStrategy
from lightning_plugin.world_size_resume import WORLD_SIZE_KEY, plain_resume_warning, saved_world_size

N, BATCH, DONE = 24, 4, 2  # 6 batches an epoch; the checkpoint is written after 2


class _Stateful:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _warning(**overrides: Any) -> str | None:
    kwargs: dict[str, Any] = dict(saved=2, world_size=1, batches_done=3, mid_epoch=True, loaders=[object()])
    return plain_resume_warning(**{**kwargs, **overrides})


def test_warns_only_for_a_plain_loader_mid_epoch_on_another_world_size():
    message = _warning()
    assert message is not None and "world size 1" in message and "written on 2" in message
    assert "3 batches early" in message and "\n" not in message
    assert _warning(saved=1) is None  # same world size: Lightning's own warning covers it
    assert _warning(saved=None) is None  # checkpoint of another strategy
    assert _warning(mid_epoch=False) is None  # epoch boundary: nothing of the epoch is lost
    assert _warning(batches_done=0) is None
    assert _warning(loaders=[_Stateful()]) is None  # the loader remaps its own position
    assert _warning(loaders=[_Stateful(), object()]) is not None
    assert saved_world_size({WORLD_SIZE_KEY: 2}) == 2 and saved_world_size({}) is None


class _SeenSamples(Callback):
    """Sample ids (stored in the first pixel) of every training batch."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.ids.extend(int(v) for v in batch[0][:, 0, 0, 0])


def _loader() -> DataLoader:
    x = torch.randn(N, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    x[:, 0, 0, 0] = torch.arange(N, dtype=x.dtype)
    return DataLoader(TensorDataset(x, torch.arange(N) % 3), batch_size=BATCH, shuffle=False)


def _fit(
    tmp_path: Any,
    ckpt_path: Any = None,
    callbacks: list[Callback] | None = None,
    steps: int = -1,
    **kwargs: Any,
) -> list[str]:
    """DDP in this process (world size 1: Lightning injects its DistributedSampler); cleans up after."""
    environ = dict(os.environ)
    trainer = L.Trainer(
        strategy=CompiledDDPStrategy(backend="aot_eager"),
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **{**TRAINER_KWARGS, "enable_checkpointing": bool(callbacks), "max_steps": steps, **kwargs},
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyModule(), _loader(), ckpt_path=ckpt_path)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return [str(w.message) for w in caught if "Resumed mid-epoch" in str(w.message)]


@pytest.fixture(scope="module")
def mid_epoch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("resume")
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=DONE, save_top_k=-1, filename="{step}")
    _fit(root, callbacks=[every], steps=DONE)
    return root / f"step={DONE}.ckpt"


def test_checkpoint_records_the_world_size(mid_epoch_checkpoint):
    assert torch.load(mid_epoch_checkpoint, weights_only=False)[WORLD_SIZE_KEY] == 1


@pytest.fixture
def from_two_ranks(mid_epoch_checkpoint, tmp_path):
    """The checkpoint as if 2 ranks had written it (each used 2 batches: the first 16 samples)."""
    state = torch.load(mid_epoch_checkpoint, weights_only=False)
    state[WORLD_SIZE_KEY] = 2
    torch.save(state, tmp_path / "from_two_ranks.ckpt")
    return tmp_path / "from_two_ranks.ckpt"


def test_resume_on_another_world_size_uses_the_rest_of_the_epoch_once(from_two_ranks, tmp_path):
    seen = _SeenSamples()
    assert _fit(tmp_path, ckpt_path=from_two_ranks, callbacks=[seen]) == []
    # Lightning injects a shuffling sampler for training (seed 0, epoch 0); 2 ranks used its first 16 samples.
    order = list(DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=0))
    assert seen.ids == order[DONE * BATCH * 2 :]


def test_a_sampler_that_cannot_be_remapped_gets_the_line_and_it_is_true(from_two_ranks, tmp_path):
    seen = _SeenSamples()
    messages = _fit(tmp_path, ckpt_path=from_two_ranks, callbacks=[seen], use_distributed_sampler=False)
    assert len(messages) == 1 and f"{DONE} batches early" in messages[0]
    # What the line says: the order restarts at the epoch's first batch and the epoch ends DONE batches early.
    assert seen.ids == list(range(N - DONE * BATCH))
