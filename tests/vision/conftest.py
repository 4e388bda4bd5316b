"""Tiny on-disk image sets for the recipe/CLI tests (real files, synthetic pixels, a few KB)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def write_image_folder(
    root: Path, splits: dict[str, int], classes: int, sizes: list[tuple[int, int]], seed: int = 0
) -> Path:
    """``root/<split>/<class>/<i>.png`` with ``splits[split]`` images per class, cycling through ``sizes``.

    Each class has its own mean colour, so a model can tell them apart."""
    rng = np.random.default_rng(seed)
    for split, per_class in splits.items():
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = np.array([(37 * c) % 256, (91 * c) % 256, (151 * c) % 256], dtype=np.float64)
            for i in range(per_class):
                h, w = sizes[i % len(sizes)]
                pixels = np.clip(colour + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="session")
def tiny_cifar(tmp_path_factory) -> str:
    """CIFAR-10 layout (train/ and test/, 10 classes, 32x32), 4 train and 2 test images per class."""
    root = tmp_path_factory.mktemp("tiny_cifar")
    return str(write_image_folder(root, {"train": 4, "test": 2}, 10, [(32, 32)]))


@pytest.fixture(scope="session")
def tiny_imagefolder(tmp_path_factory) -> str:
    """ImageFolder layout (train/ and val/, 3 classes) with images of different sizes."""
    root = tmp_path_factory.mktemp("tiny_imagefolder")
    return str(write_image_folder(root, {"train": 6, "val": 2}, 3, [(40, 48), (36, 36), (52, 40)]))
