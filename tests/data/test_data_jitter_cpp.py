"""The C++ CPU colour jitter (``lcv_vision.data.functional.color_jitter_cpu``) against the eager torch path run in
float64 (the truth): every one of the 24 orders with different factors per sample, odd and size-1 sizes, one
and several tiles, uint8 and float32 input of any layout, contiguous and channels_last output, a folded
normalize; the pipeline with and without it; the fallback when it cannot be built; the GIL released."""

from __future__ import annotations

import itertools
import sys
import threading
import warnings

import pytest
import torch

import lcv_vision.data.compiled as compiled_data
from lcv_vision.data import ColorJitter, HorizontalFlip, Normalize, Pipeline, RandomResizedCrop
from lcv_vision.data.functional import color_jitter_cpu
from lcv_vision.data.functional.color import color_jitter

#: Every order of (0 brightness, 1 contrast, 2 saturation, 3 hue), one sample each.
ORDERS = torch.tensor(list(itertools.permutations(range(4))))
EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
#: Largest factor by which one step can grow an error already in its input, with the factors of _factors
#: (at most 1.8): a blend ``f x + (1 - f) z`` by ``|f| + |1 - f|`` <= 2.6, a hue rotation (each output is
#: ``max - delta * ramp``, the ramp's slope 1 in sixths of a turn of ``num / delta``) by at most 3.
GAIN = 3.0
#: Roundings of values up to 255 in one step (hue: max/min, three differences, a division, the mod and the
#: ramp's product); a blend has fewer.
ROUNDINGS_PER_STEP = 8


def tolerance(pixels: int) -> float:
    """Largest |float32 kernel - float64 truth| in 0..255 levels for images of ``pixels`` pixels.

    Each of the 4 steps adds its own rounding (``ROUNDINGS_PER_STEP`` float32 roundings of values up to 255)
    and, for contrast, the error of the mean grey level (the grey level is rounded in float32 and summed in
    float64 over ``pixels``); later steps grow what came before by up to ``GAIN`` each.  The clip to
    [0, 255] only shrinks errors.  Far below a level: a contrast mean taken at the wrong step shows by levels.
    """
    step = ROUNDINGS_PER_STEP * 255 * EPS32
    mean = 255 * (2 * EPS32 + pixels * EPS64)
    return (step + mean) * sum(GAIN**k for k in range(4))


def _factors(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Strong, different factors per sample (float32, as ColorJitter draws them)."""
    g = torch.Generator().manual_seed(seed)
    brightness = 0.5 + torch.rand(n, generator=g)
    contrast = torch.where(torch.arange(n) % 2 == 0, 0.3, 1.7) + 0.1 * torch.rand(n, generator=g)
    saturation = 0.2 + 1.6 * torch.rand(n, generator=g)
    hue = 0.4 * torch.rand(n, generator=g) - 0.2
    return brightness, contrast, saturation, hue


def _images(n: int, c: int, h: int, w: int, real_images: torch.Tensor) -> torch.Tensor:
    """Real pixels tiled (or cut) to (n, c, h, w) uint8."""
    x = real_images[torch.arange(n) % len(real_images), :c]
    reps = (1, 1, -(-h // x.shape[2]), -(-w // x.shape[3]))
    return x.repeat(*reps)[:, :, :h, :w].contiguous()


def _truth(x: torch.Tensor, factors: tuple[torch.Tensor, ...], order: torch.Tensor) -> torch.Tensor:
    """The eager torch path in float64."""
    return color_jitter(x.double(), *(f.double() for f in factors), order)


def _check(
    out: torch.Tensor, x: torch.Tensor, factors: tuple[torch.Tensor, ...], order: torch.Tensor
) -> None:
    """``out`` (the kernel's) against the float64 truth, within the tolerance for ``x``'s image size."""
    atol = tolerance(x.shape[-2] * x.shape[-1])
    torch.testing.assert_close(out.double(), _truth(x, factors, order), atol=atol, rtol=0)


def _kernel(
    x: torch.Tensor,
    factors: tuple[torch.Tensor, ...],
    order: torch.Tensor,
    fmt: torch.memory_format = torch.contiguous_format,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.full(x.shape, float("nan")).contiguous(memory_format=fmt)
    assert color_jitter_cpu.color_jitter_into(x, out, *factors, order, scale, bias)
    return out


@pytest.fixture(autouse=True)
def _needs_the_kernel() -> None:
    if color_jitter_cpu.kernel() is None:
        pytest.skip("the C++ colour jitter kernel could not be built here (no C++ compiler?)")


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize(
    "size",
    [(17, 23), (70, 61), (1, 4500), (1, 1), (41, 1)],
    ids=["odd", "several-tiles", "row-longer-than-a-tile", "1x1", "one-column"],
)
def test_kernel_equals_float64_eager_in_every_order(real_images, fmt, size):
    x = _images(24, 3, *size, real_images)
    factors = _factors(24)
    out = _kernel(x, factors, ORDERS, fmt)
    _check(out, x, factors, ORDERS)


@pytest.mark.parametrize("layout", ["channels_last", "float32", "strided"])
def test_any_input_layout_and_float_input(real_images, layout):
    x = _images(24, 3, 19, 30, real_images)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "float32":
        x = x.float()
    else:
        x = x[:, :, :, ::2]  # every other column: no unit stride anywhere
    factors = _factors(24, seed=1)
    out = _kernel(x, factors, ORDERS, torch.channels_last)
    _check(out, x, factors, ORDERS)


def test_a_batch_of_one_in_each_order(real_images):
    for i, order in enumerate(ORDERS):
        x = _images(1, 3, 9, 7, real_images[i:])
        factors = _factors(1, seed=i)
        out = _kernel(x, factors, order.view(1, 4))
        _check(out, x, factors, order.view(1, 4))


def test_a_gray_batch_runs_brightness_and_contrast_only(real_images):
    x = _images(24, 1, 13, 11, real_images)
    factors = _factors(24, seed=2)
    out = _kernel(x, factors, ORDERS)
    _check(out, x, factors, ORDERS)


def test_samples_without_a_change_come_out_as_their_pixels(real_images):
    """Factors of 1 and a hue shift of 0 (samples ColorJitter's ``p`` left alone) are no step at all."""
    x = _images(24, 3, 15, 16, real_images)
    one = torch.ones(24)
    out = _kernel(x, (one, one, one, torch.zeros(24)), ORDERS, torch.channels_last)
    assert torch.equal(out, x.float())


def test_a_folded_normalize_per_sample_and_channel(real_images):
    x = _images(24, 3, 21, 18, real_images)
    factors = _factors(24, seed=3)
    g = torch.Generator().manual_seed(4)
    scale = (0.5 + torch.rand(24, 3, generator=g)) / 255
    bias = torch.rand(24, 3, generator=g) - 2.0
    out = _kernel(x, factors, ORDERS, torch.channels_last, scale, bias)
    truth = _truth(x, factors, ORDERS) * scale.double().view(24, 3, 1, 1) + bias.double().view(24, 3, 1, 1)
    # The levels' tolerance scaled like the pixels, plus the rounding of the affine map's result (|y| < 4).
    atol = tolerance(21 * 18) * float(scale.max()) + 4 * 4 * EPS32
    torch.testing.assert_close(out.double(), truth, atol=atol, rtol=0)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_pipeline_with_the_kernel_equals_its_torch_path(
    real_images, monkeypatch, compile_, dtype, channels_last
):
    """The same batches as ColorJitter's torch ops (eager or compiled): the kernel stores into the batch or
    its result is converted like theirs.  80 px: large output, the batch runs in slices on the workers.
    Compiled with ``aot_eager``: the kernel between the compiled segments is the subject, not Inductor's code
    (tests/data/test_data_compiled.py checks that against the eager ops)."""
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")
    ops = [RandomResizedCrop(80), HorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8), Normalize()]
    x = _images(12, 3, 96, 96, real_images)
    pipe = Pipeline(ops, compile=compile_, dtype=dtype, channels_last=channels_last)
    ours, _ = pipe(x, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(color_jitter_cpu, "_state", {"module": None})
    torch_path, _ = Pipeline(ops, compile=compile_, dtype=dtype, channels_last=channels_last)(
        x, generator=torch.Generator().manual_seed(5)
    )
    assert ours.dtype == dtype and ours.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    # The torch path in float32 is itself within rounding of the truth: twice the kernel's tolerance, in
    # normalized units (Normalize's largest scale is 1 / (0.224 * 255)), or one bfloat16 rounding of |y| < 3.
    atol = 2 * tolerance(80 * 80) / (0.224 * 255) if dtype == torch.float32 else 3 * torch.finfo(dtype).eps
    torch.testing.assert_close(ours.float(), torch_path.float(), atol=atol, rtol=0)


def test_without_a_compiler_the_pipeline_runs_the_torch_ops_after_one_warning(real_images, monkeypatch):
    def no_compiler() -> None:
        raise RuntimeError("no C++ compiler found (test)")

    monkeypatch.setattr(color_jitter_cpu, "_state", {})
    monkeypatch.setattr(color_jitter_cpu, "build", no_compiler)
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")  # the fallback is the subject, not Inductor
    ops = [RandomResizedCrop(80), HorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0), Normalize()]
    x = _images(12, 3, 96, 96, real_images)
    pipe = Pipeline(ops)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [pipe(x, generator=torch.Generator().manual_seed(seed))[0] for seed in range(2)]
    ours = [str(w.message) for w in caught if "C++" in str(w.message)]
    assert len(ours) == 1 and "no C++ compiler found (test)" in ours[0], ours
    assert not pipe._compile_failed  # the jitter went into the compiled graph
    eager, _ = Pipeline(ops, compile=False)(x, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(outs[1], eager, atol=2 * tolerance(80 * 80) / (0.224 * 255), rtol=0)


def test_the_kernel_releases_the_gil(real_images):
    """With a switch interval of 1000 s, a thread woken while this one runs Python gets the GIL only when
    this one releases it: it stays blocked through a pure-Python loop, and runs during the kernel call."""
    ext = color_jitter_cpu.kernel()
    x = _images(8, 3, 128, 128, real_images)
    out = torch.empty(x.shape, dtype=torch.float32)
    factors = torch.stack(_factors(8), dim=1).contiguous()
    order = ORDERS[:8].contiguous()
    args = (x.data_ptr(), True, list(x.stride()), out.data_ptr(), list(out.stride()), 8, 3, 128, 128)
    args += (factors.data_ptr(), order.data_ptr(), 0, 0, True)
    go, ran = threading.Event(), threading.Event()
    helper = threading.Thread(target=lambda: (go.wait(), ran.set()))
    helper.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        go.set()
        busy = sum(range(200_000))  # holds the GIL: the helper cannot run
        held = ran.is_set()
        for _ in range(100):  # each call releases it; one is enough
            ext.color_jitter(*args)
            if ran.is_set():
                break
        released = ran.is_set()
    finally:
        sys.setswitchinterval(interval)
    helper.join()
    assert busy > 0 and not held and released
