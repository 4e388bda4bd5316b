"""DeviceLoader: determinism, per-sample independence, sharding, state round trip, Lightning resume, errors."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from vision.data import DeviceLoader, DigitsDataModule, HorizontalFlip, Normalize, Pipeline, RandomCrop
from vision.data.loader import shard_indices


def _data(n=103):
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)  # sample id readable from pixel (0, 0, 0)
    return images, torch.arange(n) % 7


def _ident_pipeline():
    return Pipeline([Normalize((0.0,) * 3, (1 / 255,) * 3)], channels_last=False)  # x -> x (float)


def _ids(batch):
    return batch[1].new_tensor(batch[0][:, 0, 0, 0].round().long())


def _aug_pipeline():
    return Pipeline([RandomCrop(8, padding=2, padding_mode="reflect"), HorizontalFlip(), Normalize()])


def test_same_seed_same_batches_other_seed_differs():
    x, y = _data()
    a = [b[0] for b in DeviceLoader(x, y, 16, _aug_pipeline(), seed=3)]
    b = [b[0] for b in DeviceLoader(x, y, 16, _aug_pipeline(), seed=3)]
    c = [b[0] for b in DeviceLoader(x, y, 16, _aug_pipeline(), seed=4)]
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not all(torch.equal(u, v) for u, v in zip(a, c))


def test_epochs_reshuffle_and_cover_every_sample_once():
    x, y = _data()
    loader = DeviceLoader(x, y, 10, _ident_pipeline(), seed=0, drop_last=False)
    epochs = []
    for _ in range(2):
        ids = torch.cat([_ids(b) for b in loader])
        assert torch.equal(torch.sort(ids).values, torch.arange(103))
        epochs.append(ids)
    assert not torch.equal(epochs[0], epochs[1])
    assert len(loader) == 11
    assert len(DeviceLoader(x, y, 10, _ident_pipeline(), drop_last=True)) == 10


def test_augmentation_params_independent_per_sample():
    x = torch.zeros(256, 3, 8, 8, dtype=torch.uint8)
    x[:, :, :, :4] = 255  # left half bright: flips are visible
    loader = DeviceLoader(x, torch.zeros(256, dtype=torch.long), 256,
                          Pipeline([HorizontalFlip(), Normalize((0.0,) * 3, (1 / 255,) * 3)]), seed=0)
    imgs, _ = next(iter(loader))
    flipped = imgs[:, 0, 0, 0] == 0
    assert 0.35 < flipped.float().mean() < 0.65  # not one decision for the whole batch


@pytest.mark.parametrize("n,world", [(100, 4), (103, 4), (7, 3)])
def test_ddp_shards_disjoint_and_cover(n, world):
    x, y = _data(n)
    per_rank = []
    for rank in range(world):
        loader = DeviceLoader(x, y, 5, _ident_pipeline(), seed=1, rank=rank, world_size=world, uneven="pad")
        per_rank.append(torch.cat([_ids(b) for b in loader]))
    assert len({len(p) for p in per_rank}) == 1  # equal steps on every rank (no DDP hang)
    allids = torch.cat(per_rank)
    assert set(allids.tolist()) == set(range(n))  # every sample seen
    if n % world == 0:  # exactly once
        assert torch.equal(torch.sort(allids).values, torch.arange(n))
    else:
        assert allids.numel() - n == world - n % world  # only the pad repeats
    dropped = [torch.cat([_ids(b) for b in DeviceLoader(x, y, 5, _ident_pipeline(), seed=1, rank=r,
                                                        world_size=world, uneven="drop")]) for r in range(world)]
    d = torch.cat(dropped)
    assert d.unique().numel() == d.numel() == (n // world) * world  # at most once


def test_shard_indices_errors():
    with pytest.raises(ValueError, match="rank"):
        shard_indices(torch.arange(4), 2, 2)
    with pytest.raises(ValueError, match="uneven"):
        shard_indices(torch.arange(4), 0, 2, "wrap")  # type: ignore[arg-type]


def test_state_round_trip_resumes_mid_epoch_with_same_batches():
    x, y = _data()
    ref_loader = DeviceLoader(x, y, 8, _aug_pipeline(), seed=5)
    list(ref_loader)  # epoch 0
    ref = list(ref_loader)  # epoch 1
    loader = DeviceLoader(x, y, 8, _aug_pipeline(), seed=5)
    list(loader)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    resumed = DeviceLoader(x, y, 8, _aug_pipeline(), seed=0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(ref) - 4
    for (a, ta), (b, tb) in zip(rest, ref[4:]):
        assert torch.equal(a, b) and torch.equal(ta, tb)


def test_load_state_dict_rejects_other_dataset():
    x, y = _data()
    state = DeviceLoader(x, y, 8, _aug_pipeline()).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        DeviceLoader(x[:50], y[:50], 8, _aug_pipeline()).load_state_dict(state)


def test_bad_inputs_have_clear_errors():
    x, y = _data()
    with pytest.raises(TypeError, match="uint8"):
        DeviceLoader(x.float(), y, 8, _aug_pipeline())
    with pytest.raises(ValueError, match="empty"):
        DeviceLoader(x[:0], y[:0], 8, _aug_pipeline())
    with pytest.raises(ValueError, match="targets"):
        DeviceLoader(x, y[:5], 8, _aug_pipeline())
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        DeviceLoader(x[0], y, 8, _aug_pipeline())
    with pytest.raises(ValueError, match="batch_size"):
        DeviceLoader(x, y, 0, _aug_pipeline())


class _Tiny(pl.LightningModule):
    def __init__(self, log):
        super().__init__()
        self.net = torch.nn.Linear(3 * 8 * 8, 10)
        self.log_ = log

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert x.is_contiguous(memory_format=torch.channels_last) and x.dtype == torch.float32
        assert y.dtype == torch.int64 and x.device == self.device
        self.log_.append((self.current_epoch, batch_idx, float(x.double().sum()), y.tolist()))
        return torch.nn.functional.cross_entropy(self.net(x.flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _SaveAt(pl.Callback):
    def __init__(self, path, epoch, idx):
        self.path, self.epoch, self.idx = path, epoch, idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.idx:
            trainer.save_checkpoint(self.path)


def test_trainer_resume_mid_epoch_sees_same_remaining_batches(tmp_path):
    kw = dict(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1)
    ckpt = str(tmp_path / "mid.ckpt")
    full: list = []
    pl.Trainer(callbacks=[_SaveAt(ckpt, 1, 3)], **kw).fit(_Tiny(full), DigitsDataModule(batch_size=128, image_size=8))
    resumed: list = []
    pl.Trainer(**kw).fit(_Tiny(resumed), DigitsDataModule(batch_size=128, image_size=8), ckpt_path=ckpt)
    expected = [r for r in full if (r[0], r[1]) > (1, 3)]
    assert [(e, i) for e, i, *_ in resumed] == [(e, i) for e, i, *_ in expected]
    for (_, _, s1, y1), (_, _, s2, y2) in zip(resumed, expected):
        assert y1 == y2 and abs(s1 - s2) < 1e-6
