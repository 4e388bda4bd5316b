"""The CPU fast paths of the pipeline: the uint8 resize of whole-pixel boxes (against OpenCV, what
albumentations runs, and against our float resampler, the compiled/GPU path), compiled-vs-eager parity with
it, and the recycled output buffers (a batch the caller holds is never overwritten)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lcv_vision.data.compiled as compiled_module
from lcv_kernels.tolerances import image_tolerance

cv2 = pytest.importorskip("cv2")

from lcv_vision.data import ColorJitter, HorizontalFlip, Normalize, Pipeline, RaggedBatch, RandomResizedCrop
from lcv_vision.data.functional import color_jitter_cpu, geometry
from lcv_vision.data.functional.geometry import gather_resample, resample_tables, resize_boxes

#: A 100x100 image through ColorJitter() (factors up to 1.2) and Normalize, compiled or C++ against eager:
#: the contrast mean over 100*100*3 values, ~20 elementwise steps, three blends, Normalize's 1/0.224.
JITTER_100_TOLERANCE = image_tolerance(100 * 100 * 3 + 20, gain=1.2**3 / 0.224)


def _ragged(real_images: torch.Tensor, sizes: list[tuple[int, int]]) -> RaggedBatch:
    """Real images upscaled (cv2, bicubic) to odd, different sizes."""
    imgs = []
    for im, (h, w) in zip(real_images, sizes):
        big = cv2.resize(im.permute(1, 2, 0).numpy(), (w, h), interpolation=cv2.INTER_CUBIC)
        imgs.append(torch.from_numpy(big).permute(2, 0, 1))
    return RaggedBatch.from_images(imgs)


@pytest.mark.parametrize("n, out_size", [(1, (23, 37)), (5, (64, 64)), (3, (7, 5))])
def test_uint8_box_resize_matches_opencv_and_the_float_resampler(real_images, n, out_size):
    batch = _ragged(real_images, [(45, 61), (33, 33), (70, 41), (39, 52), (64, 47)][:n])
    params = RandomResizedCrop(out_size, scale=(0.1, 1.0)).sample(
        n, batch.heights, batch.widths, torch.Generator().manual_seed(n)
    )
    flip = torch.arange(n) % 2 == 0
    ours = resize_boxes(
        batch.canvas, params["top"], params["left"], params["height"], params["width"], out_size, flip
    )
    assert ours.dtype == torch.uint8 and ours.shape == (n, 3, *out_size)
    taps = resample_tables(
        params["top"],
        params["left"],
        params["height"],
        params["width"],
        out_size,
        tuple(batch.canvas.shape[-2:]),
        flip,
    )
    exact = gather_resample(batch.canvas, taps)  # float32, no rounding: the compiled and CUDA path
    # ATen's uint8 kernel is separable and rounds to an integer after each pass: at most 0.5 + 0.5 levels.
    assert (ours.float() - exact).abs().max() <= 1.0
    for i in range(n):
        y0, x0, h, w = (int(params[k][i]) for k in ("top", "left", "height", "width"))
        crop = batch.canvas[i, :, y0 : y0 + h, x0 : x0 + w].permute(1, 2, 0).contiguous().numpy()
        ref = cv2.resize(crop, out_size[::-1], interpolation=cv2.INTER_LINEAR)
        ref = ref[:, ::-1] if flip[i] else ref
        diff = np.abs(ours[i].permute(1, 2, 0).numpy().astype(int) - ref.astype(int))
        assert diff.max() <= 1, (
            f"sample {i}: {diff.max()} levels from cv2.resize (both round fixed-point sums)"
        )


def _cv2_boxes(images: torch.Tensor, params: dict, size: tuple[int, int], flip: torch.Tensor) -> torch.Tensor:
    """Each box cut out, resized by cv2.resize (what albumentations runs) and mirrored: the reference."""
    out = []
    for i in range(images.shape[0]):
        y0, x0, h, w = (int(params[k][i]) for k in ("top", "left", "height", "width"))
        crop = np.ascontiguousarray(images[i, :, y0 : y0 + h, x0 : x0 + w].permute(1, 2, 0).numpy())
        ref = cv2.resize(crop, size[::-1], interpolation=cv2.INTER_LINEAR).reshape(*size, -1)
        out.append(torch.from_numpy(np.ascontiguousarray(ref[:, ::-1] if flip[i] else ref)).permute(2, 0, 1))
    return torch.stack(out)


@pytest.mark.parametrize("channels", [3, 1])
def test_box_resize_is_opencv_exactly_from_planar_and_channels_last_batches(real_images, channels):
    x = real_images[:5, :channels]
    params = RandomResizedCrop((23, 37), scale=(0.1, 1.0)).sample(5, 32, 32, torch.Generator().manual_seed(2))
    flip = torch.tensor([True, False, True, True, False])
    boxes = (params["top"], params["left"], params["height"], params["width"])
    ref = _cv2_boxes(x, params, (23, 37), flip)
    for layout in (torch.contiguous_format, torch.channels_last):
        ours = resize_boxes(x.contiguous(memory_format=layout), *boxes, (23, 37), flip)
        assert ours.is_contiguous() and ours.shape == (5, channels, 23, 37)
        assert torch.equal(ours, ref), f"{layout}: {(ours.int() - ref.int()).abs().max()} levels from cv2"


def test_without_opencv_the_aten_kernel_resizes_within_a_level_of_it(real_images, monkeypatch):
    monkeypatch.setattr(geometry, "opencv", lambda: None)
    x = real_images[:4]
    params = RandomResizedCrop((29, 17), scale=(0.1, 1.0)).sample(4, 32, 32, torch.Generator().manual_seed(3))
    flip = torch.tensor([True, False, False, True])
    boxes = (params["top"], params["left"], params["height"], params["width"])
    planar = resize_boxes(x, *boxes, (29, 17), flip)
    assert torch.equal(
        planar, resize_boxes(x.contiguous(memory_format=torch.channels_last), *boxes, (29, 17), flip)
    )
    assert (planar.int() - _cv2_boxes(x, params, (29, 17), flip).int()).abs().max() <= 1


def test_uint8_box_resize_rejects_what_it_cannot_do():
    box = torch.zeros(1, dtype=torch.int64), torch.full((1,), 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="resize_boxes: expects uint8 images"):
        resize_boxes(torch.zeros(1, 3, 4, 4), box[0], box[0], box[1], box[1], (2, 2))


@pytest.mark.parametrize("n", [1, 6])
def test_compiled_cpu_pipeline_with_the_eager_resize_gives_the_eager_images(real_images, n):
    batch = _ragged(real_images, [(45, 61), (33, 33), (70, 41), (39, 52), (64, 47), (31, 99)][:n])
    ops = [RandomResizedCrop((41, 29)), HorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0), Normalize()]
    compiled = Pipeline(ops)
    out, _ = compiled(batch, generator=torch.Generator().manual_seed(7))
    ref, _ = Pipeline(ops, compile=False)(batch, generator=torch.Generator().manual_seed(7))
    assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == (n, 3, 41, 29)
    # The resize is the same eager uint8 kernel on both paths; the jitter differs by float rounding only:
    # the contrast mean over 41*29*3 values, ~20 elementwise steps, three blends up to 1.4, 1/0.224.
    atol = image_tolerance(41 * 29 * 3 + 20, gain=1.4**3 / 0.224)
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
    first, _, runner = compiled._compiled_segments(torch.device("cpu"))[0]
    assert first == 0 and runner is None  # the resize is not compiled on the CPU


def test_output_buffers_are_reused_only_once_the_caller_drops_the_batch(real_images):
    x = torch.nn.functional.interpolate(real_images[:9].float(), size=100).round().byte()
    pipe = Pipeline([RandomResizedCrop(100), Normalize()], compile=False)  # 100 x 100: a chunked CPU output

    def run(seed: int) -> torch.Tensor:
        return pipe(x, generator=torch.Generator().manual_seed(seed))[0]

    a = run(0)
    a_before = a.clone()
    b = run(1)
    view = b[3]  # only a view of the second batch is held from here on
    view_before = view.clone()
    del b
    c = run(2)
    assert torch.equal(a, a_before) and torch.equal(view, view_before), (
        "a batch the caller holds was overwritten"
    )
    assert c.data_ptr() != a.data_ptr()
    del a, c, view
    d = run(3)
    torch.testing.assert_close(
        d, Pipeline(pipe.ops, compile=False)(x, generator=torch.Generator().manual_seed(3))[0]
    )


def test_a_dropped_batch_memory_is_reused_without_page_faults(real_images):
    """A fresh 38 MB output comes from mmap and faults in every page (a third of the augmentation's CPU time
    on 224 px images); reusing a dropped batch's buffer faults in none. Checked on the mechanism, not on a
    page-fault count (which other threads' and the resampler's temporaries made load-dependent): once the
    first batch is dropped, the next outputs are written into its memory and no new buffer is made."""
    pipe = Pipeline([RandomResizedCrop(224), Normalize()], compile=False)
    x = real_images[:64]
    first = pipe(x, generator=torch.Generator().manual_seed(0))[0]
    address = first.untyped_storage().data_ptr()
    del first  # the pool still holds the buffer: no later allocation can get this address by chance
    for seed in (1, 2):
        out = pipe(x, generator=torch.Generator().manual_seed(seed))[0]
        assert out.untyped_storage().data_ptr() == address, "a dropped batch's memory was not reused"
        torch.testing.assert_close(
            out, Pipeline(pipe.ops, compile=False)(x, generator=torch.Generator().manual_seed(seed))[0]
        )
        del out
    assert len(pipe._outputs._buffers) == 1


def _full_size_copies(pipe: Pipeline, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The pipeline's output for ``x`` (seed 1, after a compiling call) and the shapes of the ``aten::copy_``
    calls of its image size that it made."""
    from torch.profiler import ProfilerActivity, profile

    pipe(x, generator=torch.Generator().manual_seed(0))  # compiles
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out, _ = pipe(x, generator=torch.Generator().manual_seed(1))
    size = list(x.shape[-2:])
    copies = [
        e.input_shapes[0]
        for e in prof.events()
        if e.name == "aten::copy_" and e.input_shapes and e.input_shapes[0][-2:] == size
    ]
    return out, copies


def test_the_compiled_cpu_graph_output_is_copied_into_the_batch_once(
    real_images, monkeypatch, torch_color_jitter
):
    """Large outputs: the graph's float planes go into the channels_last output in one copy (ATen converts
    dtype and layout in the same pass), not a converted copy first and then a second one."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the row slices run here, in this thread
    pipe = Pipeline([ColorJitter(p=1.0), Normalize()])  # 100 x 100: a large, chunked output
    x = torch.nn.functional.interpolate(real_images[:6].float(), size=100).round().byte()
    out, full_size_copies = _full_size_copies(pipe, x)
    assert out.is_contiguous(memory_format=torch.channels_last) and not pipe._compile_failed
    # The input goes into the graph as it is: the only full-size copy is the graph's output into `out`.
    assert sum(shape[0] for shape in full_size_copies) == 6, full_size_copies
    ref, _ = Pipeline(pipe.ops, compile=False)(x, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(out, ref, atol=JITTER_100_TOLERANCE, rtol=0)


def test_the_cpp_jitter_writes_straight_into_the_batch(real_images, monkeypatch):
    """With the C++ colour jitter, the jitter and the folded normalize store into the channels_last output
    themselves: not one full-size copy."""
    if color_jitter_cpu.kernel() is None:
        pytest.skip("the C++ colour jitter kernel could not be built here")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    pipe = Pipeline([ColorJitter(p=1.0), Normalize()])
    x = torch.nn.functional.interpolate(real_images[:6].float(), size=100).round().byte()
    out, full_size_copies = _full_size_copies(pipe, x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert full_size_copies == []
    ref, _ = Pipeline(pipe.ops, compile=False)(x, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(out, ref, atol=JITTER_100_TOLERANCE, rtol=0)


@pytest.mark.parametrize("threads, n, chunk", [(2, 64, 16), (2, 20, 5), (2, 512, 16), (8, 64, 4), (1, 6, 4)])
def test_large_cpu_outputs_run_in_calls_of_up_to_16_samples_two_per_thread(
    real_images, monkeypatch, threads, n, chunk
):
    """Fewer, larger compiled calls (each costs ~0.2 ms of overhead), but at least two per thread."""
    chunks: list[int] = []
    map_rows = Pipeline._map_rows

    def recording(n_rows, chunk_size, run_rows, first_alone=False):
        chunks.append(chunk_size)
        map_rows(n_rows, chunk_size, run_rows, first_alone)

    monkeypatch.setattr(Pipeline, "_map_rows", staticmethod(recording))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(compiled_module, "BACKEND", "eager")  # the chunking, not Inductor, is under test
    x = torch.nn.functional.interpolate(real_images[:4].float(), size=100).round().byte()
    x = x.repeat(-(-n // 4), 1, 1, 1)[:n]  # n samples of 100 x 100: a large output
    Pipeline([ColorJitter(p=1.0), Normalize()])(x)
    assert chunks == [chunk]


def _gil_released_inside_compiled_code(call, tries: int = 50) -> set[str]:
    """Files of the caller's innermost Python frame each time another thread got the GIL during ``call``.

    The switch interval is set to 1000 s, so the other thread can run only when the caller releases the GIL
    itself (Python never forces a switch within the test). It records where the caller stands each time it
    runs during a call. ``call`` runs up to ``tries`` times, stopping after the first call during which the
    other thread ran inside Inductor's generated code: no rate and no clock enter the result, and a loaded
    machine that schedules the other thread late only costs more tries.
    """
    import sys
    import threading
    import time

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    generated = cache_dir()
    caller = threading.get_ident()
    state = {"in_call": False, "stop": False}
    seen: set[str] = set()

    def other() -> None:
        while not state["stop"]:
            if state["in_call"]:
                seen.add(sys._current_frames()[caller].f_code.co_filename)
            time.sleep(0)  # releases the GIL: the caller takes it back as soon as it wants it

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=other)
    thread.start()
    try:
        for _ in range(tries):
            state["in_call"] = True
            call()
            state["in_call"] = False
            if any(f.startswith(generated) for f in seen):
                break
    finally:
        state["stop"] = True
        thread.join()
        sys.setswitchinterval(interval)
    return {f for f in seen if f.startswith(generated)}


def test_a_compiled_cpu_graph_lets_other_python_threads_run():
    """Inductor's default Python wrapper holds the GIL while its C++ kernels run, so the pipeline's worker
    threads took turns: with 2 threads the ImageNet-style augmentation ran at one thread's speed. Compiled
    with the C++ wrapper (``CPU_OPTIONS``) the graph releases it: another thread runs while the caller is
    inside the generated code. With ``CPU_OPTIONS = {}`` it never does (checked: 0 of 50 calls), so this
    fails."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, the other thread on the other
    try:
        images = torch.randint(0, 256, (4, 3, 1024, 1024), dtype=torch.uint8)  # one call, one long kernel
        pipe = Pipeline([Normalize()], channels_last=False)
        pipe(images)  # compiles
        assert _gil_released_inside_compiled_code(lambda: pipe(images))
    finally:
        torch.set_num_threads(threads)


def test_a_per_image_resize_inside_rows_on_the_pool_does_not_wait_on_its_own_pool(real_images, monkeypatch):
    """A pipeline's rows run on the pool's workers; a per-image resize inside them splits its images across
    the pool again when torch says 2 threads (a process-wide count). Each worker then waited for tasks queued
    behind itself: a CI run hung 15 minutes. On a worker the resize now runs its images itself."""
    import threading

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    images = real_images[:4].contiguous()
    n = images.shape[0]
    top, left = torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)
    height = torch.full((n,), images.shape[-2] - 1, dtype=torch.long)
    width = torch.full((n,), images.shape[-1] - 3, dtype=torch.long)
    expected = torch.cat(
        [
            resize_boxes(
                images[i : i + 1],
                top[i : i + 1],
                left[i : i + 1],
                height[i : i + 1],
                width[i : i + 1],
                (11, 9),
            )
            for i in range(n)
        ]
    )
    out = torch.empty_like(expected)

    def run_rows(rows: slice) -> None:
        out[rows] = resize_boxes(images[rows], top[rows], left[rows], height[rows], width[rows], (11, 9))

    runner = threading.Thread(target=Pipeline._map_rows, args=(n, 2, run_rows), daemon=True)
    runner.start()
    runner.join(timeout=120)  # a bound for a deadlock, not a speed: the work takes milliseconds
    assert not runner.is_alive(), "the pool's workers wait on each other"
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # per image: the same calls either way


@pytest.fixture
def two_intra_op_threads():
    """Two torch threads, so per-image work splits across the pool's workers (the suite runs with one)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_pool_workers_take_the_callers_grad_and_inference_modes(two_intra_op_threads):
    """Threads do not inherit autograd's thread-local modes; the workers must run in the caller's."""
    from lcv_vision.data.functional.pool import run_rows

    seen: list[tuple[bool, bool]] = []

    def record(rows: range) -> None:
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    for inference, grad in [(True, False), (False, False), (False, True)]:
        seen.clear()
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            run_rows(record, 4)
        assert seen == [(inference, grad)] * 2  # two workers, one range each


def test_a_ragged_batch_is_placed_under_lightnings_inference_mode(two_intra_op_threads):
    """Lightning validates and predicts in inference mode; the canvas is then an inference tensor, which
    workers outside that mode may not write (this failed before the workers took the caller's mode)."""
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 5 + i, 7 - i), dtype=torch.uint8, generator=g) for i in range(5)]
    boxes = [torch.tensor(v) for v in ([0] * 5, [1] * 5, [4] * 5, [3] * 5)]  # top, left, height, width
    expected = RaggedBatch.from_images(images)
    with torch.inference_mode():
        placed = RaggedBatch.from_images(images)
        resized = resize_boxes(placed.canvas, *boxes, (6, 5))
    assert torch.equal(placed.canvas, expected.canvas)
    assert torch.equal(placed.heights, expected.heights) and torch.equal(placed.widths, expected.widths)
    assert torch.equal(resized, resize_boxes(expected.canvas, *boxes, (6, 5)))
