"""The helpers every op shares: layouts and canonical strides, vectors, activation names, the
channel-statistics merge (``lcv_kernels._triton.merge_channel_stats``) and the stand-in used where Triton is not
installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kernel_checks import DEVICE, assert_close, requires_triton_path, size1_restrides
from lcv_kernels._common import (
    activation_name,
    canonical_strides,
    checked_activation_name,
    dense_layout,
    dense_vector,
    empty_in_layout_of,
    in_layout_of,
    unsupported_dtype_reason,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("shape", [(4, 512, 1, 1), (2, 3, 5, 7), (1, 1, 3, 3), (1, 1, 1, 1), (3,), (2, 3)])
def test_canonical_strides_are_those_of_torch_empty(shape):
    formats = [torch.contiguous_format] + ([torch.channels_last] if len(shape) == 4 else [])
    for memory_format in formats:
        assert (
            canonical_strides(shape, memory_format)
            == torch.empty(shape, memory_format=memory_format).stride()
        )


def test_outputs_get_one_stride_set_whatever_the_size1_strides_of_the_input():
    """The rule that keeps fakes and kernels in agreement: the layout comes from contiguity (blind to size-1
    dims), the strides from the layout alone."""
    x = torch.randn(4, 16, 1, 1)
    expected = empty_in_layout_of(x).stride()
    for variant in size1_restrides(x):
        assert dense_layout(variant) == torch.channels_last  # both layouts at once: channels_last wins
        assert empty_in_layout_of(variant).stride() == expected
        assert in_layout_of(variant.clone(), variant).stride() == expected
    nchw = torch.randn(2, 3, 4, 5)
    assert empty_in_layout_of(nchw).stride() == nchw.stride()
    assert dense_layout(nchw.transpose(2, 3)) is None


def test_in_layout_of_returns_a_tensor_that_already_has_the_strides_without_copying():
    like = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    values = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert in_layout_of(values, like) is values
    converted = in_layout_of(torch.randn(2, 3, 4, 5), like)
    assert converted.stride() == like.stride()


def test_dense_vector_copies_only_strided_or_expanded_vectors():
    v = torch.randn(6)
    assert dense_vector(v) is v and dense_vector(None) is None
    assert dense_vector(v[::2]).stride() == (1,) and torch.equal(dense_vector(v[::2]), v[::2])
    expanded = v[:1].expand(6)
    assert dense_vector(expanded).stride() == (1,) and torch.equal(dense_vector(expanded), expanded)


def test_activation_names_have_one_definition():
    assert [activation_name(m) for m in (None, nn.ReLU(), nn.GELU(), nn.SiLU(), nn.Identity())] == [
        "none",
        "relu",
        "gelu",
        "silu",
        "none",
    ]
    assert activation_name(nn.GELU(approximate="tanh")) is None
    assert activation_name(nn.Tanh()) is None
    with pytest.raises(ValueError, match="exact erf"):
        checked_activation_name(nn.GELU(approximate="tanh"))


def test_unsupported_dtype_reason_names_the_tensor_and_dtype():
    assert unsupported_dtype_reason(nn.BatchNorm2d(4), None) is None
    reason = unsupported_dtype_reason(nn.Conv2d(3, 4, 3).double())
    assert "Conv2d.weight is float64" in reason and "bfloat16" in reason


# ---------------------------------------------------------------------------------------------------------
# Channel statistics: per-part (count, mean, M2) merged in a fixed order


def _parts(counts, channels, offset, generator):
    """Random data split into parts of the given row counts; returns the data and each part's summary."""
    rows = [
        torch.randn(int(c), channels, generator=generator, dtype=torch.float64) * 2 + offset for c in counts
    ]
    means = torch.stack(
        [r.mean(0) if len(r) else torch.full((channels,), float("nan"), dtype=torch.float64) for r in rows]
    )
    m2 = torch.stack(
        [
            ((r - r.mean(0)) ** 2).sum(0)
            if len(r)
            else torch.full((channels,), float("nan"), dtype=torch.float64)
            for r in rows
        ]
    )
    return torch.cat(rows), means, m2


@requires_triton_path
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_merge_channel_stats_over_many_blocks_of_parts(offset):
    """300 parts (several merge blocks), uneven counts and never-written parts (count 0, NaN summaries): the
    merge must give the mean and biased variance of all rows, NaNs of unused parts ignored."""
    from lcv_kernels._triton import merge_channel_stats

    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 40, (300,), generator=g).double()
    counts[::7] = 0
    data, means, m2 = _parts(counts, 5, offset, g)
    mean, var = merge_channel_stats(
        counts.float().to(DEVICE), means.float().to(DEVICE), m2.float().to(DEVICE)
    )
    e_var, e_mean = torch.var_mean(data, dim=0, unbiased=False)
    assert_close((mean.double().cpu() - e_mean) / e_var.sqrt(), torch.zeros(5, dtype=torch.float64), "norm")
    assert_close(var.cpu(), e_var, "norm")


def test_kernels_work_without_triton():
    """Triton ships with Linux wheels only: without it the ops must import and run their references."""
    script = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from lcv_kernels.conv_bn_act import conv_bn_act\n"
        "from lcv_kernels.batch_norm_act import batch_norm_act\n"
        "from lcv_kernels._common import use_triton\n"
        "x = torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last)\n"
        "y, mean, var = conv_bn_act(x, torch.randn(4, 3, 3, 3), padding=1, stats=True)\n"
        "z = batch_norm_act(y, None, None, training=True, activation='relu')\n"
        "assert not use_triton(x) and z.shape == (2, 4, 5, 5)\n"
        "print('ran without triton')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ran without triton" in proc.stdout


def test_reduction_tolerance_grows_with_the_square_root_of_the_sum_and_holds_across_summation_orders():
    from lcv_kernels.tolerances import reduction_tolerance

    atol, rtol = reduction_tolerance(torch.float32, 100)
    assert atol == rtol and reduction_tolerance(torch.float32, 400)[1] == pytest.approx(2 * rtol)
    # a half-precision output adds its own rounding; the sum itself is accumulated in fp32
    assert reduction_tolerance(torch.bfloat16, 100)[1] == pytest.approx(
        2 * torch.finfo(torch.bfloat16).eps + rtol
    )
    with pytest.raises(ValueError, match="positive"):
        reduction_tolerance(torch.float32, 0)
    # Two fp32 summation orders (vectorised, sequential) of the same rows stay within the bound.
    generator = torch.Generator().manual_seed(0)
    for length in (256, 65536):
        x = torch.randn(32, length, generator=generator)
        ref = x.double().sum(1)
        atol, rtol = reduction_tolerance(torch.float32, length)
        bound = atol + rtol * float(ref.abs().max())
        for summed in (x.sum(1), x.cumsum(1)[:, -1]):
            error = float((summed.double() - ref).abs().max())
            assert error <= bound, (length, error, bound)


def test_trajectory_tolerance_covers_sgd_steps_whose_gradients_sum_in_two_orders():
    """Least squares by SGD in float32, the gradient's sum over the batch taken two ways (one matmul; a
    running sum over chunks), against float64: both within the bound after each step, which grows with
    the steps."""
    from lcv_kernels.tolerances import bound, trajectory_tolerance

    generator = torch.Generator().manual_seed(0)
    n, d, steps, lr = 4096, 16, 6, 0.5
    x, w_true = torch.randn(n, d, generator=generator), torch.randn(d, 1, generator=generator)
    y = x @ w_true + 0.1 * torch.randn(n, 1, generator=generator)

    def chunked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(a.shape[1], b.shape[1], dtype=a.dtype)
        for i in range(0, n, 64):
            total = total + a[i : i + 64].T @ b[i : i + 64]
        return total

    weights = {
        name: torch.zeros(d, 1, dtype=torch.float64 if name == "ref" else torch.float32)
        for name in ("ref", "matmul", "chunked")
    }
    for step in range(1, steps + 1):
        for name, w in weights.items():
            a, b = (x.double(), y.double()) if name == "ref" else (x, y)
            residual = a @ w - b
            gradient = chunked(a, residual) if name == "chunked" else a.T @ residual
            weights[name] = w - lr * gradient / n
        limit = bound(trajectory_tolerance(torch.float32, n, step), weights["ref"])
        for name in ("matmul", "chunked"):
            error = float((weights[name].double() - weights["ref"]).abs().max())
            assert error <= limit, (step, name, error, limit)
    assert trajectory_tolerance(torch.float32, n, 4)[0] == pytest.approx(
        4 * trajectory_tolerance(torch.float32, n, 1)[0]
    )
    with pytest.raises(ValueError, match="positive"):
        trajectory_tolerance(torch.float32, n, 0)


def test_image_tolerances_cover_float32_image_ops_and_an_8_bit_reference():
    """A contrast blend (a mean over H*W, then a blend by 1.8), bilinear samples at positions computed two
    ways and an 8-bit reference, each in float32 against float64: within the bound. The rounding of the
    8-bit reference is what its extra half level is for: without it the float bound alone is exceeded."""
    from lcv_kernels.tolerances import image_tolerance, resample_tolerance, uint8_tolerance

    generator = torch.Generator().manual_seed(1)
    img = torch.randint(0, 256, (4, 64, 64), generator=generator).float()
    factor = 1.8

    def contrast(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return (factor * x + (1 - factor) * mean).clamp(0, 255)

    truth = contrast(img.double(), img.double().mean(dim=(1, 2), keepdim=True))
    atol = image_tolerance(64 * 64 + 2, scale=255, gain=factor)
    means = (img.mean(dim=(1, 2), keepdim=True), img.flatten(1).cumsum(1)[:, -1].view(4, 1, 1) / (64 * 64))
    for mean in means:
        assert float((contrast(img, mean).double() - truth).abs().max()) <= atol

    # Bilinear samples of a 0/255 edge pattern, the source position from half-pixel centres directly and
    # through grid_sample's [-1, 1] coordinates (align_corners=False), against float64.
    size, out = 61, 97
    row = (torch.arange(size) % 2 * 255).double()

    def sample(position: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        low = position.floor().clamp(0, size - 2)
        frac, low = position - low, low.long()
        return values[low] + (values[low + 1] - values[low]) * frac

    centres = torch.arange(out, dtype=torch.float64)
    exact = sample((centres + 0.5) * size / out - 0.5, row)
    direct = (torch.arange(out).float() + 0.5) * (size / out) - 0.5
    normalized = (2 * (torch.arange(out).float() + 0.5) / out - 1).float()
    via_grid = ((normalized + 1) * size - 1) / 2
    errors = [float((sample(p, row.float()).double() - exact).abs().max()) for p in (direct, via_grid)]
    assert max(errors) <= resample_tolerance(2, size, scale=255), errors
    assert max(errors) > image_tolerance(2, scale=255), errors  # the positions' rounding is what shows

    # An 8-bit reference (rounded to levels) against the float result.
    brightened = (img * 1.3).clamp(0, 255)
    reference = (img.double() * 1.3).clamp(0, 255).round()
    error = float((brightened.double() - reference).abs().max())
    assert error <= uint8_tolerance(0.5, 1, scale=255, gain=1.3)
    assert error > image_tolerance(1, scale=255, gain=1.3)


def test_bound_scales_the_relative_part_by_the_largest_reference_value():
    from lcv_kernels.tolerances import bound

    assert bound((1e-6, 1e-3), torch.tensor([-4.0, 2.0])) == pytest.approx(1e-6 + 4e-3)
    assert bound((1e-6, 1e-3), torch.empty(0)) == 1e-6


def test_network_length_bounds_a_small_network_forward_and_backward_in_two_layouts():
    """conv + BatchNorm + linear: the fan-ins plus the batch's positions per layer; float32 output and
    gradients, contiguous and channels_last (another summation order), against float64 within the bound."""
    from torch import nn

    from lcv_kernels.tolerances import bound, network_length, reduction_tolerance

    assert network_length(nn.Conv2d(3, 4, 3), (2, 3, 5, 5)) == 27 + 50
    with pytest.raises(ValueError, match="batch_shape"):
        network_length(nn.Linear(2, 2), (2,))
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 12 * 12, 10),
    )
    x = torch.randn(4, 8, 12, 12)
    tol = reduction_tolerance(torch.float32, network_length(net, x.shape))

    def run(model: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        out = model(inputs)
        out.square().sum().backward()
        return [out.detach(), *(p.grad for p in model.parameters())]

    want = run(net.double(), x.double())
    for layout in (torch.contiguous_format, torch.channels_last):
        got = run(net.float().to(memory_format=layout), x.contiguous(memory_format=layout))
        for g, w in zip(got, want, strict=True):
            assert float((g.double() - w).abs().max()) <= bound(tol, w)
