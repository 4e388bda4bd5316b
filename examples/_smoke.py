"""Synthetic stand-ins for real data sets, so every example can run one tiny step anywhere (``--smoke``)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image


def synthetic_image_folder(
    splits: dict[str, int], classes: int, sizes: list[tuple[int, int]], root: str | None = None, seed: int = 0
) -> str:
    """Write ``<root>/<split>/class<c>/<i>.png`` (``splits[split]`` images per class, sizes cycling through
    ``sizes``; each class has its own mean colour) and return ``root`` (a new temporary folder by default)."""
    if root is None:
        root = tempfile.mkdtemp(prefix="lcv-smoke-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    base = Path(root)
    rng = np.random.default_rng(seed)
    for split, per_class in splits.items():
        for c in range(classes):
            folder = base / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = np.array([(37 * c) % 256, (91 * c) % 256, (151 * c) % 256], dtype=np.float64)
            for i in range(per_class):
                h, w = sizes[i % len(sizes)]
                pixels = np.clip(colour + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return str(base)
