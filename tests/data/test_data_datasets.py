"""Data set builders and DataModules: real JPEG zip, ImageFolder with mixed sizes, corrupt files, errors."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from vision.data import CIFAR10DataModule, CorruptImageError, DigitsDataModule, ImageFolderDataModule
from vision.data.datasets import load_digits_images, load_image_folder, stratified_split


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
