"""The pipeline on a CUDA device gives the CPU's images (needs only torch: runs where albumentations is
absent)."""

from __future__ import annotations

import pytest
import torch

from vision.data import CoarseDropout, ColorJitter, HorizontalFlip, Normalize, Pipeline, RandomResizedCrop

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.gpu
def test_cuda_matches_cpu(real_images):
    p = Pipeline(
        [
            RandomResizedCrop(64),
            HorizontalFlip(),
            ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0),
            Normalize(),
            CoarseDropout(p=1.0),
        ]
    )
    params = p.sample(len(real_images), 32, 32, torch.Generator().manual_seed(0))
    cpu, _ = p(real_images, params=params)
    gpu, _ = p(real_images.cuda(), params=params)
    assert torch.allclose(cpu, gpu.cpu(), atol=2e-3)
