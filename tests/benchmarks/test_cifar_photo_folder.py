"""``benchmarks/cifar_photo_folder.py``: the photo folder the 224-px serving check trains on, from a CIFAR zip."""

from __future__ import annotations

import io
import sys
import zipfile

import numpy as np
import pytest
from PIL import Image

from lcv_vision.data.datasets import load_image_folder
from script_loader import load_script


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


@pytest.fixture
def cifar_zip(tmp_path):
    """train/ and test/ with 3 JPEGs of each of two classes, and a stray file outside any class."""
    path = tmp_path / "cifar.zip"
    files = {}
    with zipfile.ZipFile(path, "w") as archive:
        for split in ("train", "test"):
            for label in ("cat", "dog"):
                for i in range(3):
                    name = f"{split}/{label}/{i}.jpg"
                    files[name] = _jpeg(len(files))
                    archive.writestr(name, files[name])
        archive.writestr("README.jpg", _jpeg(99))
    return path, files


def test_the_folder_holds_the_first_files_of_each_class_byte_for_byte(cifar_zip, tmp_path):
    bench = load_script("benchmarks/cifar_photo_folder.py")
    zip_path, files = cifar_zip
    out = tmp_path / "photos"
    written = bench.write_cifar_photo_folder(str(zip_path), out, {"train": 2, "val": 1})
    assert written == {"train": 4, "val": 2}
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*.jpg")}
    want = {f"train/{c}/{i}.jpg": files[f"train/{c}/{i}.jpg"] for c in ("cat", "dog") for i in (0, 1)}
    want.update({f"val/{c}/0.jpg": files[f"test/{c}/0.jpg"] for c in ("cat", "dog")})
    assert got == want
    images = load_image_folder(str(out), "train")  # what `lcv fit --recipe imagefolder-*` reads
    assert images.class_names == ["cat", "dog"] and images.targets.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--train-per-class", "0"], "--train-per-class and --val-per-class must be >= 1"),
        (["--zip-path", "missing.zip"], "--zip-path missing.zip does not exist"),
    ],
)
def test_bad_options_are_one_line(argv, message, tmp_path, monkeypatch, capsys):
    bench = load_script("benchmarks/cifar_photo_folder.py")
    monkeypatch.setattr(sys, "argv", ["cifar_photo_folder.py", "--out", str(tmp_path / "new"), *argv])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
    assert not (tmp_path / "new").exists()
