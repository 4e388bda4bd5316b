"""The pipeline on a CUDA device gives the CPU's images (needs only torch: runs where albumentations is
absent)."""

from __future__ import annotations

import pytest
import torch

from lcv_kernels.tolerances import resample_tolerance
from lcv_vision.data import CoarseDropout, ColorJitter, HorizontalFlip, Normalize, Pipeline, RandomResizedCrop

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
    # Triton's resample against grid_sample (positions up to 32 px computed apart, 2 * 2 taps), the contrast
    # mean over 64*64*3 values, ~20 elementwise steps; three blends up to 1.4, Normalize's 1/0.224.
    atol = resample_tolerance(4 + 64 * 64 * 3 + 20, 32, gain=1.4**3 / 0.224)
    torch.testing.assert_close(cpu, gpu.cpu(), atol=atol, rtol=0)


def test_a_resampling_op_gets_its_params_on_the_device_to_make_its_tables_there(monkeypatch):
    """On a GPU only the per-sample boxes cross from the CPU; the (N, h)/(N, w) taps are made there (making
    them on the CPU cost 4 us per 224-px image, more than the GPU's whole augmentation)."""
    seen: list[str] = []
    prepare = RandomResizedCrop.prepare

    def spy(self, params, shape, index=None):
        seen.extend(v.device.type for v in params.values())
        return prepare(self, params, shape, index)

    monkeypatch.setattr(RandomResizedCrop, "prepare", spy)
    p = Pipeline([RandomResizedCrop(8), HorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0)])
    params = p.sample(4, 16, 20, torch.Generator().manual_seed(0))
    prepared = p._prepare(params, (4, 3, 16, 20), 4, None, torch.device("meta"))
    assert seen and set(seen) == {"meta"}
    assert {k for k, v in prepared[0].items() if v.device.type == "meta"} >= {
        "y0",
        "y1",
        "wy",
        "x0",
        "x1",
        "wx",
    }


@requires_cuda
@pytest.mark.gpu
def test_resample_tables_made_on_the_gpu_equal_the_cpus():
    """Bitwise: the CUDA division by a Python number (a reciprocal multiply) would round differently."""
    g = torch.Generator().manual_seed(0)
    op = RandomResizedCrop(224)
    params = {**op.sample(512, 256, 300, g), "flip_after": torch.rand(512, generator=g) < 0.5}
    cpu = op.prepare(params, (512, 3, 256, 300))
    gpu = op.prepare({k: v.cuda() for k, v in params.items()}, (512, 3, 256, 300))
    for key in ("y0", "y1", "wy", "x0", "x1", "wx"):
        assert gpu[key].is_cuda and torch.equal(cpu[key], gpu[key].cpu()), key
