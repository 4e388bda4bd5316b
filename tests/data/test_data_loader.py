"""DeviceLoader: determinism, per-sample independence, sharding, state round trip, Lightning resume,
errors."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lcv_vision.data.compiled as compiled_data
from lcv_kernels.tolerances import image_tolerance
from lcv_vision.data import DeviceLoader, DigitsDataModule, HorizontalFlip, Normalize, Pipeline, RandomCrop
from lcv_vision.data.loader import shard_indices


@pytest.fixture(autouse=True)
def _traced_pipelines(monkeypatch):
    """Pipelines traced by dynamo and AOTAutograd, not built by Inductor (a C++ build per pipeline): what the
    loaders and data sets hand out is the subject here; tests/data/test_data_compiled.py checks Inductor's
    pipeline code against the eager ops."""
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")


def _data(n=103):
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)  # sample id readable from pixel (0, 0, 0)
    return images, torch.arange(n) % 7


def _ident_pipeline():
    return Pipeline([Normalize((0.0,) * 3, (1 / 255,) * 3)], channels_last=False)  # x -> x (float)


def _ids(batch):
    return batch[0][:, 0, 0, 0].round().long()


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
    loader = DeviceLoader(
        x,
        torch.zeros(256, dtype=torch.long),
        256,
        Pipeline([HorizontalFlip(), Normalize((0.0,) * 3, (1 / 255,) * 3)]),
        seed=0,
    )
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
    dropped = [
        torch.cat(
            [
                _ids(b)
                for b in DeviceLoader(
                    x, y, 5, _ident_pipeline(), seed=1, rank=r, world_size=world, uneven="drop"
                )
            ]
        )
        for r in range(world)
    ]
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
    kw = dict(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
    )
    ckpt = str(tmp_path / "mid.ckpt")
    full: list = []
    pl.Trainer(callbacks=[_SaveAt(ckpt, 1, 3)], **kw).fit(
        _Tiny(full), DigitsDataModule(batch_size=128, image_size=8)
    )
    resumed: list = []
    pl.Trainer(**kw).fit(_Tiny(resumed), DigitsDataModule(batch_size=128, image_size=8), ckpt_path=ckpt)
    expected = [r for r in full if (r[0], r[1]) > (1, 3)]
    assert [(e, i) for e, i, *_ in resumed] == [(e, i) for e, i, *_ in expected]
    for (_, _, s1, y1), (_, _, s2, y2) in zip(resumed, expected):
        # exact: the same images through the same ops, summed in the same order
        assert y1 == y2 and s1 == s2


# ----------------------------------------------------------------------------------------- exact DDP sharding
@pytest.mark.parametrize(
    "n,world,bs,drop_last",
    [
        (103, 4, 5, False),
        (100, 4, 5, False),
        (101, 4, 25, False),
        (9, 4, 2, False),
        (4, 4, 3, False),
        (103, 4, 5, True),
        (50, 3, 7, False),
    ],
)
def test_exact_sharding_sees_every_sample_exactly_once_with_equal_steps(n, world, bs, drop_last):
    x, y = _data(n)
    per_rank = []
    for rank in range(world):
        loader = DeviceLoader(
            x, y, bs, _ident_pipeline(), seed=2, rank=rank, world_size=world, drop_last=drop_last
        )
        assert loader.uneven == "exact"  # the default
        per_rank.append([_ids(b) for b in loader])
    steps = {len(batches) for batches in per_rank}
    assert steps == {
        len(DeviceLoader(x, y, bs, _ident_pipeline(), rank=0, world_size=world, drop_last=drop_last))
    }
    assert len(steps) == 1  # the same number of steps on every rank: DDP cannot hang
    ids = torch.cat([b for batches in per_rank for b in batches])
    assert ids.unique().numel() == ids.numel()  # disjoint: nothing twice
    if not drop_last:
        assert torch.equal(torch.sort(ids).values, torch.arange(n))  # everything once
    sizes = [b.numel() for batches in per_rank for b in batches]
    assert min(sizes) >= 1 and max(sizes) <= bs + 1


def test_exact_sharding_needs_one_sample_per_rank():
    x, y = _data(3)
    with pytest.raises(ValueError, match="uneven='pad'"):
        DeviceLoader(x, y, 2, _ident_pipeline(), rank=0, world_size=4)
    assert len(DeviceLoader(x, y, 2, _ident_pipeline(), rank=3, world_size=4, uneven="pad")) == 1


# ----------------------------------------------------------------------------------------- passes and epochs
def test_each_pass_is_a_new_epoch_and_iter_alone_changes_nothing():
    x, y = _data(40)
    loader = DeviceLoader(x, y, 8, _ident_pipeline(), seed=1)
    it = iter(loader)  # Lightning calls iter() once only to check the loader; that must not start a pass
    del it
    first = [_ids(b) for b in loader]
    assert loader.epoch == 0 and loader.position == 5
    ref = DeviceLoader(x, y, 8, _ident_pipeline(), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, [_ids(b) for b in ref]))
    partial = iter(loader)
    next(partial)  # an abandoned pass still counts: the next one is a new epoch
    assert loader.epoch == 1
    second = [_ids(b) for b in loader]
    assert loader.epoch == 2 and len(second) == 5
    loader.set_epoch(7)
    assert torch.equal(torch.cat([_ids(b) for b in loader]), loader.epoch_indices(7)) and loader.epoch == 7


def test_state_saved_at_the_end_of_an_epoch_resumes_at_the_next_one():
    x, y = _data(40)
    loader = DeviceLoader(x, y, 8, _aug_pipeline(), seed=3)
    list(loader)
    state = loader.state_dict()
    ref = list(loader)  # epoch 1
    resumed = DeviceLoader(x, y, 8, _aug_pipeline(), seed=3)
    resumed.load_state_dict(state)
    got = list(resumed)
    assert resumed.epoch == 1 and all(torch.equal(a[0], b[0]) for a, b in zip(got, ref))


def test_host_store_path_gives_the_same_batches_as_the_resident_one():
    x, y = _data()
    a = list(DeviceLoader(x, y, 16, _aug_pipeline(), seed=4, resident=True))
    b = list(DeviceLoader(x, y, 16, _aug_pipeline(), seed=4, resident=False))
    assert all(torch.equal(u[0], v[0]) and torch.equal(u[1], v[1]) for u, v in zip(a, b))


def test_targets_must_be_class_indices():
    x, _ = _data(8)
    loader = DeviceLoader(x, torch.arange(8).float(), 4, _ident_pipeline())  # whole-number floats are fine
    assert next(iter(loader))[1].dtype == torch.int64
    with pytest.raises(TypeError, match="non-integral"):
        DeviceLoader(x, torch.rand(8), 4, _ident_pipeline())
    with pytest.raises(TypeError, match="torch.bool"):
        DeviceLoader(x, torch.ones(8, dtype=torch.bool), 4, _ident_pipeline())
    with pytest.raises(TypeError, match="tensor of class indices"):
        DeviceLoader(x, list(range(8)), 4, _ident_pipeline())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uneven"):
        DeviceLoader(x, torch.arange(8), 4, _ident_pipeline(), uneven="wrap")  # type: ignore[arg-type]


class _ValModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3 * 8 * 8, 10)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0].flatten(1)), batch[1])

    def validation_step(self, batch, batch_idx):
        self.seen.append((self.trainer.sanity_checking, batch[0].double().sum(dim=(1, 2, 3))))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_validation_after_the_sanity_check_sees_every_sample():
    """Regression: the sanity check's 2 batches used to shift the first real validation pass."""
    dm = DigitsDataModule(batch_size=32, image_size=8)
    model = _ValModule()
    pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    ).fit(model, dm)
    real = torch.cat([s for sanity, s in model.seen if not sanity])
    expected = torch.cat([b[0].double().sum(dim=(1, 2, 3)) for b in dm.val_dataloader()])
    assert len([1 for sanity, _ in model.seen if sanity]) == 2
    assert torch.equal(real, expected)


# -------------------------------------------------------------------------------------- CUDA (skipped on CPU)
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine"
)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "resident", [True, False], ids=["on-device store", "pinned host store + side stream"]
)
def test_cuda_loader_gives_the_cpu_batches(resident):
    x, y = _data()
    cpu = list(DeviceLoader(x, y, 16, _aug_pipeline(), seed=6))
    loader = DeviceLoader(x, y, 16, _aug_pipeline(), seed=6, device="cuda", resident=resident)
    assert loader.resident is resident
    for (a, ta), (b, tb) in zip(cpu, loader):
        assert b.is_cuda and tb.is_cuda and b.is_contiguous(memory_format=torch.channels_last)
        # crop and flip move pixels; Normalize scales, subtracts and divides by a std >= 0.224
        torch.testing.assert_close(b.cpu(), a, atol=image_tolerance(3, gain=1 / 0.224), rtol=0)
        assert torch.equal(tb.cpu(), ta)


@requires_cuda
@pytest.mark.gpu
def test_cuda_encoded_loader_decodes_jpegs_with_nvjpeg(tmp_path):
    import numpy as np
    from PIL import Image

    from lcv_vision.data import Resize
    from lcv_vision.data.datasets import list_image_folder

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "train" / c).mkdir(parents=True)
        for i, (h, w) in enumerate([(40, 52), (64, 48), (30, 30)]):
            img = (rng.random((h, w, 3)) * 60 + np.linspace(0, 180, w)[None, :, None]).astype(np.uint8)
            Image.fromarray(img).save(
                tmp_path / "train" / c / f"{i}.{'png' if i == 2 else 'jpg'}", quality=95
            )
    enc = list_image_folder(str(tmp_path), "train")
    pipe = Pipeline([Resize(24)], channels_last=False)
    cpu = list(DeviceLoader(enc, enc.targets, 4, pipe, seed=0))
    gpu = list(DeviceLoader(enc, enc.targets, 4, pipe, seed=0, device="cuda"))
    for (a, ta), (b, tb) in zip(cpu, gpu):
        assert torch.equal(ta, tb.cpu())
        assert (a - b.cpu()).abs().mean() < 2.0  # nvJPEG and libjpeg differ by IDCT rounding only


def _take(passes, batches):
    """The sample ids of the next ``batches`` batches of each rank's pass."""
    return [_ids(next(p)) for p in passes for _ in range(batches)]


def _ranks(x, y, world, **kwargs):
    return [
        DeviceLoader(x, y, 4, _ident_pipeline(), rank=r, world_size=world, **kwargs) for r in range(world)
    ]


@pytest.mark.parametrize(
    "worlds, steps, drop_last",
    [((1, 2), (7,), False), ((2, 1), (3,), False), ((1, 2, 1), (7, 3), False), ((3, 2), (2,), True)],
)
def test_resume_on_another_world_size_uses_each_sample_of_the_epoch_once(worlds, steps, drop_last):
    """The state saved by rank 0 after `steps` batches, loaded by every rank of the next world size: the
    samples of that epoch seen before and after each change are the epoch's, each once (at most once with
    drop_last). Without the remap the 1 -> 2 resume repeats samples and the 2 -> 1 one skips them."""
    x, y = _data(81)
    seen: list[torch.Tensor] = []
    loaders = _ranks(x, y, worlds[0], seed=2, drop_last=drop_last)
    for loader in loaders:
        list(loader)  # epoch 0; the check is on epoch 1
    passes = [iter(loader) for loader in loaders]
    for world, taken in zip(worlds[1:], steps):
        seen += _take(passes, taken)
        state = loaders[0].state_dict()
        loaders = _ranks(x, y, world, seed=0, drop_last=drop_last)
        for loader in loaders:
            loader.load_state_dict(state)
            assert loader.epoch == 1 and len(loader) >= loader._epoch_length()
        passes = [iter(loader) for loader in loaders]
    lengths = {loader._epoch_length() for loader in loaders}
    assert len(lengths) == 1  # every rank steps as often
    seen += [_ids(b) for p in passes for b in p]
    ids = torch.sort(torch.cat(seen)).values
    if drop_last:
        assert ids.unique().numel() == ids.numel() and ids.numel() > 81 - 4 * 3 * 2
    else:
        assert torch.equal(ids, torch.arange(81))
    assert all(loader.epoch == 1 for loader in loaders)
    following = torch.cat([_ids(b) for loader in loaders for b in loader])  # epoch 2: a whole epoch again
    assert loaders[0].epoch == 2 and loaders[0]._segment_start == 0
    assert torch.equal(torch.sort(following).values, torch.arange(81)) or drop_last


def test_state_saved_at_the_end_of_an_epoch_resumes_at_the_next_one_on_another_world_size():
    x, y = _data(40)
    loader = DeviceLoader(x, y, 4, _ident_pipeline(), seed=3)
    list(loader)
    resumed = _ranks(x, y, 2, seed=3)
    for r in resumed:
        r.load_state_dict(loader.state_dict())
    ids = torch.cat([_ids(b) for r in resumed for b in r])
    assert resumed[0].epoch == 1 and torch.equal(torch.sort(ids).values, torch.arange(40))


def test_a_loader_whose_length_was_read_refuses_a_longer_resumed_epoch():
    """Lightning reads len() of a loader given to fit() before loading its state, and keeps that length."""
    x, y = _data(40)
    one = DeviceLoader(x, y, 4, _ident_pipeline())
    it = iter(one)
    for _ in range(3):
        next(it)
    two = DeviceLoader(x, y, 4, _ident_pipeline(), world_size=2)
    assert len(two) == 5
    with pytest.raises(ValueError, match="LightningDataModule"):
        two.load_state_dict(one.state_dict())  # 3 + ceil(14 / 4) = 7 batches > 5
