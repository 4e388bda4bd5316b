"""The compiled pipeline: same images as the eager ops, one compile for every batch size, eager fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import lcv_vision.data.compiled as compiled_module
from lcv_kernels.tolerances import image_tolerance
from lcv_vision.data import (
    CoarseDropout,
    ColorJitter,
    Erasing,
    HorizontalFlip,
    MixupCutmix,
    Normalize,
    PadIfNeeded,
    Pipeline,
    RaggedBatch,
    RandomCrop,
    RandomResizedCrop,
    ResizeCenterCrop,
    ToGray,
    TrivialAugmentWide,
    VerticalFlip,
)

#: The compiled graph is what these tests check: on the CPU the colour jitter would otherwise run as the C++
#: kernel between compiled runs of the other ops (tests/data/test_data_jitter_cpp.py checks that kernel).
pytestmark = pytest.mark.usefixtures("torch_color_jitter")

#: Integer ops only: crops with every border mode, flips, grayscale on uint8, holes with whole-number fills.
INTEGER_OPS = [
    PadIfNeeded(36, 34, "symmetric"),
    RandomCrop(30, padding=2, padding_mode="reflect"),
    HorizontalFlip(),
    VerticalFlip(),
    ToGray(p=0.5),
    CoarseDropout((1, 3), (2, 6), (2, 6), fill=17, p=0.7),
    Erasing(p=0.5),
]
#: Float arithmetic: resampling, colour jitter (every order, hue), normalize, mixing.
FLOAT_OPS = [
    RandomResizedCrop(20, scale=(0.2, 1.0)),
    HorizontalFlip(),
    ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8),
    Normalize(),
    MixupCutmix(10, mode="elem"),
]
#: Compiled minus eager, in normalized units (a 1/255 level is ~0.017): float rounding of the reordered math
#: behind one output: a resample to 20 px (at most 2 * 6 taps; the ragged test's 50 -> 12 has 2 * 11),
#: the contrast mean over 20*20*3 values and ~20 elementwise steps; three blends by factors up to 1.4 and
#: Normalize's 1/0.224 magnify it.
FLOAT_TOLERANCE = image_tolerance(2 * 11 + 20 * 20 * 3 + 20, gain=1.4**3 / 0.224)
#: Mixed one-hot targets: ``lam * a + (1 - lam) * b``, two terms of at most 1.
TARGET_TOLERANCE = image_tolerance(2)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _run(ops, images, seed, targets=None, **kwargs):
    outs = []
    for compile_ in (False, True):
        pipe = Pipeline(ops, compile=compile_, **kwargs)
        outs.append(pipe(images, targets, generator=torch.Generator().manual_seed(seed)))
    return outs


def test_integer_ops_compiled_give_the_eager_pixels_bitwise(real_images):
    (eager, _), (compiled, _) = _run(INTEGER_OPS, real_images[:24], seed=1)
    assert compiled.shape == (24, 3, 30, 30) and compiled.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(compiled, eager)
    assert (compiled == 17).any() and (compiled == 0).any()  # the holes really are there


def test_float_ops_compiled_match_eager_within_rounding(real_images):
    targets = torch.arange(16) % 10
    (eager, eager_t), (compiled, compiled_t) = _run(
        FLOAT_OPS, real_images[:16], seed=2, targets=targets, dtype=torch.float32, channels_last=False
    )
    assert compiled.is_contiguous() and compiled.shape == (16, 3, 20, 20)
    torch.testing.assert_close(compiled, eager, atol=FLOAT_TOLERANCE, rtol=0)
    torch.testing.assert_close(compiled_t, eager_t, atol=TARGET_TOLERANCE, rtol=0)


def test_one_compile_serves_every_batch_size_and_both_grad_modes(real_images):
    pipe = Pipeline(FLOAT_OPS[:4])
    reference = Pipeline(FLOAT_OPS[:4], compile=False)
    before = _graphs()
    for n in (5, 8, 3, 1, 2, 7):
        g = torch.Generator().manual_seed(n)
        params = pipe.sample(n, 32, 32, g)
        out, _ = pipe(real_images[:n], params=params)
        torch.testing.assert_close(
            out, reference(real_images[:n], params=params)[0], atol=FLOAT_TOLERANCE, rtol=0
        )
    with torch.inference_mode():  # Lightning's evaluation fetches batches in inference mode
        out, _ = pipe(real_images[:4])
    assert out.shape == (4, 3, 20, 20)
    assert _graphs() - before == 1, "the pipeline compiled more than once"
    assert not pipe._compile_failed


def test_ragged_batches_of_any_canvas_size_share_one_compile():
    pipe = Pipeline([ResizeCenterCrop(12), Normalize()])
    reference = Pipeline([ResizeCenterCrop(12), Normalize()], compile=False)
    before = _graphs()
    for sizes in ([(20, 30), (33, 17)], [(16, 16), (40, 24), (18, 50)], [(21, 23)] * 3):
        batch = RaggedBatch.from_images(
            [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in sizes]
        )
        torch.testing.assert_close(pipe(batch)[0], reference(batch)[0], atol=FLOAT_TOLERANCE, rtol=0)
    assert _graphs() - before == 1


def test_store_gather_compiles_once_for_any_batch(real_images):
    pipe = Pipeline([RandomCrop(28, padding=4, padding_mode="reflect"), HorizontalFlip(), Normalize()])
    reference = Pipeline(pipe.ops, compile=False)
    before = _graphs()
    for n in (6, 9, 1):
        index = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))
        params = pipe.sample(n, 32, 32, torch.Generator().manual_seed(n))
        out, _ = pipe(real_images, params=params, index=index)
        assert torch.equal(out, reference(real_images, params=params, index=index)[0])
    assert _graphs() - before == 1


def test_ops_that_cannot_be_traced_run_eagerly_between_compiled_runs(real_images):
    ops = [RandomCrop(32, padding=2), TrivialAugmentWide(), Normalize()]
    (eager, _), (compiled, _) = _run(ops, real_images[:8], seed=3)
    assert torch.equal(compiled, eager)


def test_a_compile_failure_falls_back_to_eager_with_one_warning(real_images, monkeypatch):
    def failing_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_module, "BACKEND", failing_backend)
    pipe = Pipeline(FLOAT_OPS[:4])
    reference = Pipeline(FLOAT_OPS[:4], compile=False)
    with pytest.warns(UserWarning, match="torch.compile failed.*eagerly") as caught:
        first, _ = pipe(real_images[:6], generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        second, _ = pipe(real_images[:6], generator=torch.Generator().manual_seed(1))
    assert len([w for w in caught if "torch.compile failed" in str(w.message)]) == 1
    assert torch.equal(first, reference(real_images[:6], generator=torch.Generator().manual_seed(0))[0])
    assert torch.equal(second, reference(real_images[:6], generator=torch.Generator().manual_seed(1))[0])


def test_errors_of_the_ops_themselves_are_not_taken_for_compile_failures():
    pipe = Pipeline([Normalize((0.5, 0.5), (0.2, 0.2))])
    with pytest.raises(ValueError, match="2 mean values for images with 3 channels"):
        pipe(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
    assert not pipe._compile_failed


@pytest.mark.parametrize("with_index", [False, True])
def test_a_model_compiled_on_the_pipelines_batches_keeps_a_static_batch(real_images, with_index):
    """The pipeline's graph has a dynamic batch; torch >= 2.14 stamps that on the graph's outputs for the
    next compiled graph to read, and the model's graph then compiled with a symbolic batch from its first
    compile (16% slower kernels for ``digits-small`` on a 2-core CPU). The batch must reach the model
    unmarked, images and targets, and a model compiled on it must see concrete sizes. A mark left in part
    (``_has_dynamo_dim_marking`` without the indices) failed dynamo's guard check on the graph that had just
    been compiled from it ("Guard failed on the same frame it was created")."""
    pipe = Pipeline([RandomCrop(28, padding=4), HorizontalFlip(), Normalize()])
    targets = torch.arange(12) % 10
    if with_index:
        index = torch.arange(12)
        params = pipe.sample(12, 32, 32, torch.Generator().manual_seed(0))
        images, labels = pipe(real_images, targets, params=params, index=index)
    else:
        images, labels = pipe(real_images[:12], targets, generator=torch.Generator().manual_seed(0))
    for t in (images, labels):  # none of mark_dynamic's attributes (a part left confuses dynamo's guards)
        assert not [k for k in vars(t) if "dynamo" in k or k == "_specialize_on"], vars(t)
    symbolic = []

    def backend(gm, example_inputs):
        symbolic.extend(isinstance(s, torch.SymInt) for t in example_inputs for s in getattr(t, "shape", ()))
        return gm.forward

    torch._dynamo.reset()
    # images and targets in one graph, as a whole training step takes them (compile_step=True)
    torch.compile(lambda t, y: t.relu() * 2 + y.float().mean(), backend=backend)(images, labels)
    assert symbolic and not any(symbolic)
