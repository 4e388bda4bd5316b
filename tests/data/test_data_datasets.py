"""Data set builders and DataModules: real JPEG zip, ImageFolder with mixed sizes, corrupt files, errors."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

import lcv_vision.data.compiled as compiled_data
from lcv_vision.data import CIFAR10DataModule, CorruptImageError, DigitsDataModule, ImageFolderDataModule
from lcv_vision.data.datasets import load_digits_images, load_image_folder, stratified_split


@pytest.fixture(autouse=True)
def _traced_pipelines(monkeypatch):
    """Pipelines traced by dynamo and AOTAutograd, not built by Inductor (a C++ build per pipeline): what the
    loaders and data sets hand out is the subject here; tests/data/test_data_compiled.py checks Inductor's
    pipeline code against the eager ops."""
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")


def _write_folder(root, sizes, bad=()):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = root / split / c
            d.mkdir(parents=True)
            for i, (h, w) in enumerate(sizes):
                arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                ext = "png" if i % 2 else "jpg"
                Image.fromarray(arr).save(d / f"{i}.{ext}")
    for rel in bad:
        (root / rel).write_bytes(b"not an image at all")


def test_cifar_zip_reads_real_jpegs_like_pil(cifar_zip):
    data = load_image_folder(cifar_zip, "test", limit_per_class=20)
    assert data.images.shape == (200, 3, 32, 32) and data.images.dtype == torch.uint8
    assert data.class_names[0] == "airplane" and len(data.class_names) == 10
    assert torch.equal(torch.bincount(data.targets), torch.full((10,), 20))
    with zipfile.ZipFile(cifar_zip) as zf:
        name = sorted(n for n in zf.namelist() if n.startswith("test/airplane/") and n.endswith(".jpg"))[0]
        ref = np.asarray(Image.open(io.BytesIO(zf.read(name))).convert("RGB"))
    # libjpeg (torchvision) vs PIL's libjpeg-turbo: identical or off by one level of IDCT rounding
    assert (data.images[0].permute(1, 2, 0).int() - torch.from_numpy(ref).int()).abs().max() <= 2


def test_cifar_datamodule_from_zip_gives_normalized_channels_last_batches(cifar_zip):
    dm = CIFAR10DataModule(zip_path=cifar_zip, batch_size=50, limit_per_class=10, num_workers=1)
    assert (dm.num_classes, dm.image_size, dm.in_channels) == (10, 32, 3)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (50, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert -3 < x.mean().item() < 3 and 0.5 < x.std().item() < 2  # normalized
    xv, _ = next(iter(dm.val_dataloader()))
    assert xv.shape[1:] == (3, 32, 32)


def test_cifar_missing_root_says_how_to_fix(tmp_path):
    with pytest.raises(ValueError, match="download=True"):
        CIFAR10DataModule()
    dm = CIFAR10DataModule(root=str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="download=True"):
        dm.setup("fit")


def test_image_folder_mixed_sizes_jpeg_png(tmp_path):
    _write_folder(tmp_path, [(40, 60), (50, 30), (33, 33)])
    with pytest.raises(ValueError, match="storage_size"):
        load_image_folder(str(tmp_path), "train")
    dm = ImageFolderDataModule(str(tmp_path), image_size=24, batch_size=4, num_workers=1)
    assert dm.num_classes == 2 and dm.class_names == ["cat", "dog"]
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 24, 24) and x.is_contiguous(memory_format=torch.channels_last)
    xv, yv = next(iter(dm.val_dataloader()))
    assert xv.shape == (4, 3, 24, 24)


def test_corrupt_file_raises_naming_it_or_is_skipped_with_count(tmp_path):
    _write_folder(tmp_path, [(20, 20), (20, 20)], bad=["train/dog/broken.jpg"])
    with pytest.raises(CorruptImageError, match="broken.jpg"):
        load_image_folder(str(tmp_path), "train")
    with pytest.warns(UserWarning, match="skipped 1 corrupt"):
        data = load_image_folder(str(tmp_path), "train", on_corrupt="skip")
    assert len(data) == 4 and data.skipped == 1
    with pytest.raises(ValueError, match="on_corrupt"):
        ImageFolderDataModule(str(tmp_path), on_corrupt="ignore")  # type: ignore[arg-type]


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        ImageFolderDataModule(str(tmp_path / "missing"))
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no .*images"):
        load_image_folder(str(tmp_path), "train")
    with pytest.raises(FileNotFoundError, match="split not found"):
        load_image_folder(str(tmp_path), "val")


def test_digits_images_are_real_and_upscaled():
    from sklearn.datasets import load_digits

    data = load_digits_images(16)
    assert data.images.shape == (1797, 3, 16, 16) and data.images.dtype == torch.uint8
    raw = torch.from_numpy(load_digits().images).float() * 255 / 16
    down = torch.nn.functional.avg_pool2d(data.images[:, :1].float(), 2).squeeze(1)
    assert (down - raw).abs().mean() < 20  # the upscaled image still is the digit
    assert torch.equal(data.images[:, 0], data.images[:, 2])


def test_digits_split_is_stratified_deterministic_and_disjoint():
    dm = DigitsDataModule(batch_size=32, seed=1)
    dm.setup("fit")
    sizes = {k: len(v) for k, v in dm._splits.items()}
    assert sum(sizes.values()) == 1797 and abs(sizes["train"] / 1797 - 0.7) < 0.01
    targets = load_digits_images(8).targets
    a = stratified_split(targets, (0.7, 0.1, 0.2), 1)
    b = stratified_split(targets, (0.7, 0.1, 0.2), 1)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.cat(a).unique().numel() == 1797
    for part in a:  # every class in every split, in proportion
        counts = torch.bincount(targets[part], minlength=10).float()
        assert counts.min() > 0 and (counts / counts.sum() - 0.1).abs().max() < 0.03
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape == (32, 3, 32, 32) and dm.mean == (0.5,) * 3


# --------------------------------------------------------------------------------- unreadable, zips, progress
def test_unreadable_file_is_named_or_skipped(tmp_path):
    _write_folder(tmp_path, [(12, 12)])
    (tmp_path / "train" / "cat" / "gone.jpg").symlink_to(tmp_path / "does-not-exist.jpg")  # open() fails
    with pytest.raises(CorruptImageError, match="cannot read image file .*gone.jpg"):
        load_image_folder(str(tmp_path), "train")
    with pytest.warns(UserWarning, match="skipped 1"):
        assert len(load_image_folder(str(tmp_path), "train", on_corrupt="skip")) == 2


def test_not_a_zip_says_so(tmp_path):
    bad = tmp_path / "data.zip"
    bad.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(ValueError, match="is not a zip file"):
        load_image_folder(str(bad), "train")
    with pytest.raises(ValueError, match="is not a zip file"):
        ImageFolderDataModule(str(bad))


def test_progress_bar_only_for_slow_builds(tmp_path, monkeypatch, capsys):
    import time

    import lcv_vision.data.datasets as ds

    _write_folder(tmp_path, [(8, 8)] * 4)
    load_image_folder(str(tmp_path), "train")
    assert "decoding" not in capsys.readouterr().err  # quick: no bar
    monkeypatch.setattr(ds, "PROGRESS_DELAY_S", 0.05)
    real_decode = ds.decode_image_bytes

    def slow_decode(data, name):
        time.sleep(0.03)
        return real_decode(data, name)

    monkeypatch.setattr(ds, "decode_image_bytes", slow_decode)
    load_image_folder(str(tmp_path), "train", num_threads=1)
    err = capsys.readouterr().err
    assert "decoding" in err and "/8 [" in err  # the bar appeared (and was cleared at the end)


# ----------------------------------------------------------------------------------------- encoded storage
def _encoded_folder(tmp_path):
    _write_folder(tmp_path, [(40, 60), (50, 30), (33, 33), (20, 25)])  # JPEG and PNG, 4 sizes
    return str(tmp_path)


def test_encoded_loader_decodes_each_batch_like_decoding_up_front(tmp_path):
    import torchvision.io as tio

    from lcv_kernels.tolerances import resample_tolerance
    from lcv_vision.data import DeviceLoader, Pipeline, Resize
    from lcv_vision.data.datasets import list_image_folder

    root = _encoded_folder(tmp_path)
    enc = list_image_folder(root, "train")
    assert len(enc) == 8 and enc.class_names == ["cat", "dog"]
    loader = DeviceLoader(
        enc,
        enc.targets,
        3,
        Pipeline([Resize(16)], channels_last=False),
        shuffle=True,
        seed=0,
        decode_threads=2,
    )
    seen = []
    for b, (x, y) in zip(loader.epoch_batches(0), loader):
        for i, img in zip(b.tolist(), x):
            ref = tio.decode_image(enc.sources[i], mode=tio.ImageReadMode.RGB)
            ref = (
                Resize(16).apply(ref[None], Resize(16).sample(1, ref.shape[1], ref.shape[2], None))[0].float()
            )
            # the canvas size changes where the (up to 2 * 10) antialiased taps fall: positions up to 60 px
            torch.testing.assert_close(img, ref, atol=resample_tolerance(2 * 10, 60, scale=255), rtol=0)
        assert torch.equal(y, enc.targets[b])
        seen += b.tolist()
    assert sorted(seen) == list(range(8))


def test_encoded_loader_needs_a_resizing_first_op_and_handles_corrupt_files(tmp_path):
    from lcv_vision.data import DeviceLoader, HorizontalFlip, Pipeline, Resize
    from lcv_vision.data.datasets import list_image_folder

    root = _encoded_folder(tmp_path)
    (tmp_path / "train" / "dog" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff but not a jpeg")
    enc = list_image_folder(root, "train")
    with pytest.raises(ValueError, match="must start with RandomResizedCrop, Resize or ResizeCenterCrop"):
        DeviceLoader(enc, enc.targets, 4, Pipeline([HorizontalFlip()]))
    with pytest.raises(CorruptImageError, match="zz_broken.jpg"):
        list(DeviceLoader(enc, enc.targets, 4, Pipeline([Resize(8)]), shuffle=False))
    loader = DeviceLoader(enc, enc.targets, 3, Pipeline([Resize(8)]), shuffle=False, on_corrupt="skip")
    with pytest.warns(UserWarning, match="skipped 1 corrupt"):
        sizes = [len(y) for _, y in loader]
    assert sizes == [3, 3, 2] and loader.skipped == 1  # the batch with the broken file is one smaller


def test_image_folder_datamodule_encoded_storage_from_zip(cifar_zip):
    dm = ImageFolderDataModule(
        cifar_zip,
        image_size=24,
        batch_size=10,
        storage="encoded",
        val_split="test",
        limit_per_class=2,
        num_workers=2,
    )
    assert dm.num_classes == 10
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (10, 3, 24, 24) and x.is_contiguous(memory_format=torch.channels_last)
    xv, _ = next(iter(dm.val_dataloader()))
    assert xv.shape == (10, 3, 24, 24) and -3 < xv.mean().item() < 3
    with pytest.raises(ValueError, match="storage"):
        ImageFolderDataModule(cifar_zip, storage="lmdb")  # type: ignore[arg-type]


def test_cifar_from_torchvision_is_stored_as_uint8_nchw(monkeypatch, tmp_path):
    """The torchvision path (download=True for users) without downloading: a stand-in with CIFAR10's
    fields."""
    import torchvision

    rng = np.random.default_rng(0)
    arrays = {
        True: rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8),  # NHWC, like torchvision's CIFAR10
        False: rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8),
    }

    class FakeCIFAR10:
        classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

        def __init__(self, root, train, download):
            self.data = arrays[train]
            self.targets = [i % 10 for i in range(len(self.data))]

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    dm = CIFAR10DataModule(root=str(tmp_path), batch_size=10, num_workers=1)
    dm.setup("fit")
    train = dm._splits["train"]
    assert train.images.shape == (30, 3, 32, 32) and train.images.dtype == torch.uint8
    assert torch.equal(train.images[4].permute(1, 2, 0), torch.from_numpy(arrays[True][4]))  # pixel (y, x, c)
    assert train.targets.tolist() == [i % 10 for i in range(30)] and len(dm._splits["val"]) == 20
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (10, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)


def test_datamodule_shards_by_the_trainer_rank():
    from types import SimpleNamespace

    seen = []
    for rank in range(3):
        dm = DigitsDataModule(batch_size=16, image_size=8)
        dm.trainer = SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device("cpu")), global_rank=rank, world_size=3
        )
        loader = dm.val_dataloader()
        assert (loader.rank, loader.world_size, loader.uneven) == (rank, 3, "exact")
        seen.append(torch.cat([b[0][:, 0].flatten(1).sum(1) for b in loader]))
    total = sum(len(s) for s in seen)
    assert total == len(dm._splits["val"])  # every validation sample exactly once across the 3 ranks


def test_batched_jpeg_decode_failure_names_or_skips_the_corrupt_file(tmp_path):
    """The nvJPEG path's fallback, exercised with torchvision's batched decode on the CPU."""
    from lcv_vision.data import DeviceLoader, Pipeline, Resize
    from lcv_vision.data.datasets import list_image_folder

    root = _encoded_folder(tmp_path)
    (tmp_path / "train" / "dog" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff but not a jpeg")
    enc = list_image_folder(root, "train")
    blobs = [enc.read(i) for i in range(len(enc))]
    jpeg_ids = [i for i, b in enumerate(blobs) if b[:3] == b"\xff\xd8\xff"]
    for mode in ("raise", "skip"):
        loader = DeviceLoader(enc, enc.targets, 4, Pipeline([Resize(8)]), on_corrupt=mode)
        call = lambda: loader._decode_jpegs_on_device([blobs[i] for i in jpeg_ids], torch.tensor(jpeg_ids))  # noqa
        if mode == "raise":
            with pytest.raises(CorruptImageError, match="zz_broken.jpg"):
                call()
        else:
            out = call()
            assert [o is None for o in out] == [enc.sources[i].endswith("zz_broken.jpg") for i in jpeg_ids]


@pytest.mark.parametrize("world_size", [3, 7])  # 7 divides none of the splits: the "exact" remainder case
def test_datamodule_shards_are_disjoint_and_cover_every_sample(world_size):
    """Each sample's identity travels as its target (its index in the split); val/test images are checked
    against the stored pixels of that index, so a shard cannot pair one sample's target with another's
    image."""
    from types import SimpleNamespace

    from lcv_vision.data.datasets import ImageSet

    dm = DigitsDataModule(batch_size=16, image_size=8)
    dm.setup("fit")
    for name, split in list(dm._splits.items()):
        dm._splits[name] = ImageSet(split.images, torch.arange(len(split)), split.class_names)
    loaders = {"train": dm.train_dataloader, "val": dm.val_dataloader, "test": dm.test_dataloader}
    for name, train in (("train", True), ("val", False), ("test", False)):
        stored = dm._splits[name].images
        shards = []
        for rank in range(world_size):
            dm.trainer = SimpleNamespace(
                strategy=SimpleNamespace(root_device=torch.device("cpu")),
                global_rank=rank,
                world_size=world_size,
            )
            loader = loaders[name]()
            ids = []
            for x, y in loader:
                if not train:  # eval pipeline: Normalize(0.5, 0.5) of the stored uint8 pixels, no randomness
                    torch.testing.assert_close(x, (stored[y].float() / 255 - 0.5) / 0.5)
                ids.append(y)
            shards.append(torch.cat(ids))
        sizes = sorted(len(s) for s in shards)
        assert sizes[-1] - sizes[0] <= 1, (name, sizes)  # balanced
        everything = torch.cat(shards)
        assert len(everything) == len(stored), name  # no sample twice (so the shards are disjoint) ...
        assert torch.equal(everything.sort().values, torch.arange(len(stored))), name  # ... and none missing
