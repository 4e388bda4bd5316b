"""The CUDA resampling kernel, run in the Triton interpreter on CPU tensors (set up by tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from lcv_kernels._common import interpreter_enabled, triton_available
from lcv_kernels.tolerances import image_tolerance, resample_tolerance
from lcv_vision.data.functional._triton import resample_triton
from lcv_vision.data.functional.geometry import gather_resample, resample, resample_tables

pytestmark = pytest.mark.skipif(
    not (triton_available() and (interpreter_enabled() or torch.cuda.is_available())),
    reason="needs Triton (on a GPU, or its interpreter)",
)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "n,channels,canvas,size,layout",
    [
        (5, 3, (37, 29), (24, 20), "nchw"),  # odd sizes, downscale in one axis and upscale in the other
        (1, 3, (16, 16), (40, 72), "channels_last"),  # one sample, upscale, more columns than one tile
        (3, 1, (20, 33), (9, 70), "nchw"),  # one channel
    ],
)
def test_kernel_equals_the_pytorch_resample(n, channels, canvas, size, layout):
    """Same taps, same arithmetic: equal to the formula the CPU and compiled paths use, flips and
    fractional boxes included (a ragged canvas reads only inside each box)."""
    g = torch.Generator().manual_seed(n)
    images = torch.randint(0, 256, (n, channels, *canvas), dtype=torch.uint8, generator=g)
    if layout == "channels_last":
        images = images.contiguous(memory_format=torch.channels_last)
    height = torch.rand(n, generator=g, dtype=torch.float64) * (canvas[0] - 2) + 2
    width = torch.rand(n, generator=g, dtype=torch.float64) * (canvas[1] - 2) + 2
    top = torch.rand(n, generator=g, dtype=torch.float64) * (canvas[0] - height)
    left = torch.rand(n, generator=g, dtype=torch.float64) * (canvas[1] - width)
    flip = torch.rand(n, generator=g) < 0.5
    taps = resample_tables(top, left, height, width, size, canvas, flip)
    device = _device()
    got = resample_triton(
        images.to(device), *(taps[k].to(device) for k in ("y0", "y1", "wy", "x0", "x1", "wx"))
    )
    assert got.dtype == torch.float32 and got.shape == (n, channels, *size)
    # same arithmetic: four taps of values up to 255, in another order (FMA, fused mixes)
    torch.testing.assert_close(
        got.cpu(), gather_resample(images, taps), atol=image_tolerance(4, scale=255), rtol=0
    )
    # and the eager grid_sample form, whose coordinates take a round trip through [-1, 1]
    atol = resample_tolerance(4, max(canvas), scale=255)
    torch.testing.assert_close(got.cpu(), resample(images, taps), atol=atol, rtol=0)


def test_custom_op_has_a_shape_only_fake_for_the_compiler():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        images = torch.empty(4, 3, 30, 40, dtype=torch.uint8)
        y = torch.empty(4, 12, dtype=torch.int64)
        x = torch.empty(4, 17, dtype=torch.int64)
        out = torch.ops.lcv_data.resample_bilinear(images, y, y, y.float(), x, x, x.float())
    assert out.shape == (4, 3, 12, 17) and out.dtype == torch.float32
