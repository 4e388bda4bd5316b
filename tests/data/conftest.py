"""Fixtures shared by the data tests: real CIFAR-10 JPEGs from the shared zip (skip with the reason if absent)."""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest
import torch

SHARED_ZIP = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                                          "cifar10-jpeg.zip"))


@pytest.fixture(scope="session")
def real_images() -> torch.Tensor:
    """64 real CIFAR-10 test JPEGs (uint8 NCHW, decoded by PIL), spread over all classes."""
    if not os.path.exists(SHARED_ZIP):
        pytest.skip(f"shared CIFAR-10 JPEG zip not found at {SHARED_ZIP}")
    from PIL import Image

    out = []
    with zipfile.ZipFile(SHARED_ZIP) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("test/") and n.endswith(".jpg"))[::150][:64]
        for n in names:
            out.append(np.asarray(Image.open(io.BytesIO(zf.read(n))).convert("RGB")))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()
