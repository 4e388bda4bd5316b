"""Fixtures shared by the data tests: real images, the CIFAR-10 JPEGs from the shared zip when it is there.

Without the zip (a clean CI clone), the op-parity tests still run on real photographs: 32x32 patches of the
two JPEG photos that ship inside scikit-learn (``load_sample_images``), so they never skip for want of data.
"""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest
import torch

SHARED_ZIP = os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "cifar10-jpeg.zip")
)


@pytest.fixture(scope="session")
def real_images() -> torch.Tensor:
    """64 real 32x32 images (uint8 NCHW): CIFAR-10 test JPEGs spread over all classes, decoded by PIL, or
    patches of scikit-learn's bundled photos when the shared zip is absent."""
    if os.environ.get("LCV_TESTS_WITHOUT_SHARED_DATA") or not os.path.exists(SHARED_ZIP):
        return _photo_patches(64)
    from PIL import Image

    out = []
    with zipfile.ZipFile(SHARED_ZIP) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("test/") and n.endswith(".jpg"))[::150][:64]
        for n in names:
            out.append(np.asarray(Image.open(io.BytesIO(zf.read(n))).convert("RGB")))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()


def _photo_patches(n: int, size: int = 32) -> torch.Tensor:
    """``n`` patches on a fixed grid over scikit-learn's two sample photos (china.jpg, flower.jpg)."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images  # two (427, 640, 3) uint8 photographs
    patches = []
    for k in range(n):
        photo = photos[k % len(photos)]
        row, col = divmod(k // len(photos), 8)
        top = 20 + row * (photo.shape[0] - 40 - size) // 3
        left = 20 + col * (photo.shape[1] - 40 - size) // 7
        patches.append(photo[top : top + size, left : left + size])
    return torch.from_numpy(np.ascontiguousarray(np.stack(patches))).permute(0, 3, 1, 2).contiguous()


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compiled(request) -> bool:
    """Run a pipeline test on both paths: the eager ops and the ops compiled into one graph."""
    return request.param


@pytest.fixture
def torch_color_jitter(monkeypatch) -> None:
    """ColorJitter on the CPU as if its C++ kernel could not be built: the torch ops (eager, or compiled in
    the pipeline's graph), for the tests of those paths."""
    from lcv_vision.data.functional import color_jitter_cpu

    monkeypatch.setattr(color_jitter_cpu, "_state", {"module": None})
