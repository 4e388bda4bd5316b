"""ImageFolder trees of real photos in every format, and each way a real folder goes wrong (one test each).

The tree comes from ``tests/photo_folder.py`` (scikit-learn's two bundled photos, cut and saved as JPEG,
8/16-bit PNG, RGBA, grayscale, CMYK JPEG, GIF, WebP); pixels are compared with PIL's decoding.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lcv_vision.data import DeviceLoader, ImageFolderDataModule, Pipeline, RaggedBatch, ResizeCenterCrop
from lcv_vision.data.datasets import (
    CorruptImageError,
    DatasetError,
    decode_image_bytes,
    fit_to_square,
    list_image_folder,
    load_image_folder,
)
from photo_folder import CLASSES, TRAIN_FILES, VAL_FILES, image_files, reference_rgb

SIDE = 24


def _no_warnings(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        return call()


def test_every_format_decodes_like_pil(photo_folder):
    for path in image_files(photo_folder, "train") + image_files(photo_folder, "val"):
        got = decode_image_bytes(path.read_bytes(), str(path))
        assert got.dtype == torch.uint8, path
        torch.testing.assert_close(got, reference_rgb(path), rtol=0, atol=0, msg=str(path))


def test_stored_squares_match_pil_decoding_and_cover_sub_folders(photo_folder):
    """Default storage: every file (sub-folders included, 16-bit PNGs included) is read, in the listed order,
    and its stored square equals PIL's pixels put through the same resize."""
    data = _no_warnings(lambda: load_image_folder(photo_folder, "train", storage_size=SIDE))
    files = image_files(photo_folder, "train")
    assert len(data) == len(files) == len(CLASSES) * len(TRAIN_FILES)  # "more/9.webp" included
    assert data.class_names == list(CLASSES)
    assert data.targets.tolist() == [
        CLASSES.index(p.parent.name if p.parent.name in CLASSES else p.parent.parent.name) for p in files
    ]
    want = torch.stack([fit_to_square(reference_rgb(p), SIDE) for p in files])
    torch.testing.assert_close(data.images, want, rtol=0, atol=0)


def test_listing_matches_torchvision_image_folder(photo_folder):
    from torchvision.datasets.folder import make_dataset

    from lcv_vision.data.datasets import IMAGE_EXTENSIONS

    encoded = list_image_folder(photo_folder, "train")
    reference = make_dataset(
        os.path.join(photo_folder, "train"),
        {c: i for i, c in enumerate(CLASSES)},
        extensions=IMAGE_EXTENSIONS,
    )
    assert [(os.path.normpath(s), int(t)) for s, t in zip(encoded.sources, encoded.targets)] == [
        (os.path.normpath(p), c) for p, c in reference
    ]


def test_encoded_storage_decodes_16_bit_pngs_like_pil(photo_folder):
    """``storage="encoded"``: batches decoded per step equal the same op run on PIL-decoded images."""
    encoded = list_image_folder(photo_folder, "val")
    op = Pipeline([ResizeCenterCrop(SIDE, SIDE)])
    loader = DeviceLoader(encoded, encoded.targets, len(encoded), op, shuffle=False)
    ((got, _),) = list(loader)
    files = image_files(photo_folder, "val")
    assert any(reference_rgb(p).shape and p.suffix == ".png" for p in files)
    ragged = RaggedBatch.from_images([reference_rgb(p) for p in files])
    want, _ = op(ragged, encoded.targets, torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_apple_double_and_hidden_files_are_not_images(photo_copy):
    for split in ("train", "val"):
        (photo_copy / split / "china" / "._0.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble resource fork")
    (photo_copy / "train" / "china" / ".DS_Store").write_bytes(b"Bud1")
    (photo_copy / "train" / ".ipynb_checkpoints").mkdir()
    data = _no_warnings(lambda: load_image_folder(str(photo_copy), "train", storage_size=SIDE))
    assert len(data) == len(CLASSES) * len(TRAIN_FILES) and data.class_names == list(CLASSES)
    assert len(list_image_folder(str(photo_copy), "val")) == len(CLASSES) * len(VAL_FILES)


def test_truncated_jpeg_is_named(photo_copy):
    good = (photo_copy / "train" / "flower" / "0.jpg").read_bytes()
    (photo_copy / "train" / "flower" / "cut.jpg").write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptImageError, match=r"cannot decode image '.*flower/cut\.jpg'.*truncated"):
        load_image_folder(str(photo_copy), "train", storage_size=SIDE)


def test_dangling_link_is_named(photo_copy):
    os.symlink(photo_copy / "nowhere.jpg", photo_copy / "train" / "china" / "link.jpg")
    with pytest.raises(CorruptImageError, match=r"cannot read image file '.*china/link\.jpg'"):
        load_image_folder(str(photo_copy), "train", storage_size=SIDE)


def test_skipped_files_are_named(photo_copy):
    names = [f"bad{i}.jpg" for i in range(7)]
    for name in names:
        (photo_copy / "train" / "china" / name).write_bytes(b"\xff\xd8\xff not really a jpeg")
    with pytest.warns(UserWarning, match=r"skipped 7 corrupt .*'.*bad0\.jpg', '.*bad1\.jpg'.* and 2 more"):
        data = load_image_folder(str(photo_copy), "train", storage_size=SIDE, on_corrupt="skip")
    assert len(data) == len(CLASSES) * len(TRAIN_FILES) and data.skipped == 7
    assert [os.path.basename(f) for f in data.skipped_files] == names


def test_images_torchvision_cannot_decode_are_named(photo_copy):
    from PIL import Image

    Image.new("RGB", (9, 9)).save(photo_copy / "train" / "china" / "scan.bmp")
    with pytest.warns(UserWarning, match=r"ignored 1 image file.*cannot decode.*scan\.bmp"):
        data = load_image_folder(str(photo_copy), "train", storage_size=SIDE)
    assert len(data) == len(CLASSES) * len(TRAIN_FILES)


def test_empty_class_folder_fails_in_train_and_warns_in_val(photo_copy):
    (photo_copy / "val" / "zebra").mkdir()
    with pytest.warns(UserWarning, match=r"class folder\(s\) 'zebra' .*hold no images"):
        val = load_image_folder(str(photo_copy), "val", storage_size=SIDE)
    assert val.class_names == [*CLASSES, "zebra"]
    (photo_copy / "train" / "zebra").mkdir()
    with pytest.raises(DatasetError, match=r"class folder\(s\) 'zebra' .*hold no images.*cannot be learnt"):
        ImageFolderDataModule(str(photo_copy), image_size=SIDE, num_workers=1).setup("fit")


def test_class_mismatch_between_train_and_val_names_the_classes(photo_copy):
    (photo_copy / "val" / "flower").rename(photo_copy / "val" / "flowers")
    dm = ImageFolderDataModule(str(photo_copy), image_size=SIDE, num_workers=1)
    with pytest.raises(DatasetError, match=r"only in train: \['flower'\], only in val: \['flowers'\]"):
        dm.setup("fit")


def test_missing_val_folder_says_how_to_hold_out_part_of_train(photo_copy):
    import shutil

    shutil.rmtree(photo_copy / "val")
    with pytest.raises(DatasetError, match=r"no 'val' folder in .*--data\.val_split 0\.2"):
        ImageFolderDataModule(str(photo_copy), image_size=SIDE)


@pytest.mark.parametrize("val_split", [0.4, "0.4"])
def test_val_split_fraction_holds_out_a_stratified_seeded_share_of_train(photo_copy, val_split):
    import shutil

    shutil.rmtree(photo_copy / "val")
    dm = ImageFolderDataModule(str(photo_copy), image_size=SIDE, num_workers=1, val_split=val_split, seed=3)
    dm.setup("fit")
    train, val = dm._splits["train"], dm._splits["val"]
    assert len(train) + len(val) == len(CLASSES) * len(TRAIN_FILES)
    assert torch.bincount(val.targets).tolist() == [4, 4]  # 40% of each class's 10
    every = load_image_folder(str(photo_copy), "train", storage_size=dm.storage_size)
    rows = {tuple(x.flatten().tolist()) for x in every.images}
    assert all(tuple(x.flatten().tolist()) in rows for x in val.images)  # held out of train, not made up
    assert not {tuple(x.flatten().tolist()) for x in val.images} & {
        tuple(x.flatten().tolist()) for x in train.images
    }
    again = ImageFolderDataModule(
        str(photo_copy), image_size=SIDE, num_workers=1, val_split=val_split, seed=3
    )
    again.setup("fit")
    torch.testing.assert_close(again._splits["val"].images, val.images, rtol=0, atol=0)


def test_val_split_names_a_folder(photo_copy):
    (photo_copy / "val").rename(photo_copy / "holdout")
    dm = ImageFolderDataModule(str(photo_copy), image_size=SIDE, num_workers=1, val_split="holdout")
    dm.setup("fit")
    assert len(dm._splits["val"]) == len(CLASSES) * len(VAL_FILES)


def test_batch_larger_than_the_train_split_with_drop_last_fails_naming_the_numbers(photo_folder):
    dm = ImageFolderDataModule(photo_folder, image_size=SIDE, num_workers=1, batch_size=32, drop_last=True)
    dm.setup("fit")
    with pytest.raises(
        DatasetError,
        match=r"train split has 20 images, fewer than batch_size=32 .*at most 20.*"
        r"--data\.batch_size.*--data\.drop_last false",
    ):
        dm.train_dataloader()
    assert len(dm.val_dataloader()) == 1  # evaluation keeps its partial batch


def test_build_prints_its_time(photo_folder, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        ImageFolderDataModule(photo_folder, image_size=SIDE, num_workers=1).setup("fit")
    assert any(m.startswith("train: 20 images in 2 classes decoded to 27x27 in ") for m in caplog.messages)
