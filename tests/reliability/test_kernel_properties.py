"""Property-based tests (hypothesis) of the Triton kernels against references, over random small shapes.

Under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` on a machine without CUDA) the
Triton code itself runs, in numpy; each test asserts that the Triton path is taken, so a
reference is never compared with itself. Each op is checked against two references: the
kernel author's (``kernels/*_reference.py``) and one written here from ``torch.nn.functional``.
The example budgets are fixed and small (``max_examples``) so the suite stays fast, and
``derandomize=True`` makes every run draw the same examples.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernels._common import ACTIVATIONS, use_triton
from kernels.conv_ops import conv2d_fused
from kernels.conv_reference import conv2d_fused_reference, conv2d_output_hw
from kernels.tolerances import tolerance

PROPERTY_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _activation(u: torch.Tensor, name: str) -> torch.Tensor:
    return {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}[name](u)


@st.composite
def conv_cases(draw: st.DrawFn) -> dict:
    n, c, k = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    h, w = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    padding = [draw(st.integers(0, 2)), draw(st.integers(0, 2))]
    dilation = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    p, q = conv2d_output_hw(h, w, r, s, stride, padding, dilation)
    assume(p > 0 and q > 0)
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    case = {
        "x": torch.randn(n, c, h, w, generator=g).contiguous(memory_format=torch.channels_last),
        "weight": torch.randn(k, c, r, s, generator=g),
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "activation": draw(st.sampled_from(ACTIVATIONS)),
        "stats": draw(st.booleans()),
    }
    for name in ("bias", "scale", "shift"):
        case[name] = torch.randn(k, generator=g) if draw(st.booleans()) else None
    case["residual"] = (
        torch.randn(n, k, p, q, generator=g).contiguous(memory_format=torch.channels_last)
        if draw(st.booleans())
        else None
    )
    return case


def _conv_from_functional(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Independent reference: F.conv2d in float64, then the epilogue, then the BatchNorm sums."""
    z = F.conv2d(
        case["x"].double(),
        case["weight"].double(),
        None if case["bias"] is None else case["bias"].double(),
        case["stride"],
        case["padding"],
        case["dilation"],
    )
    u = z
    if case["scale"] is not None:
        u = u * case["scale"].double().view(1, -1, 1, 1)
    if case["shift"] is not None:
        u = u + case["shift"].double().view(1, -1, 1, 1)
    if case["residual"] is not None:
        u = u + case["residual"].double()
    return _activation(u, case["activation"]), z.sum(dim=(0, 2, 3)), (z * z).sum(dim=(0, 2, 3))


def _conv_kwargs(case: dict) -> dict:
    return {
        key: case[key]
        for key in ("stride", "padding", "dilation", "scale", "shift", "residual", "activation", "stats")
    }


@pytest.fixture(autouse=True)
def _needs_the_triton_path() -> None:
    probe = torch.zeros(1, 1, 1, 1)
    if not use_triton(probe):
        pytest.skip("the Triton path is not active (no CUDA and TRITON_INTERPRET!=1): nothing to test")


def test_conv2d_fused_launches_the_triton_kernel(monkeypatch) -> None:
    """Guard against a silent reference fallback: the property tests below must exercise Triton."""
    import kernels.conv

    calls = []
    real = kernels.conv.conv2d_fused_triton
    monkeypatch.setattr(kernels.conv, "conv2d_fused_triton", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 2, 5, 5).contiguous(memory_format=torch.channels_last)
    conv2d_fused(x, torch.randn(3, 2, 3, 3), padding=1, activation="relu")
    assert calls


@PROPERTY_SETTINGS
@given(case=conv_cases())
def test_conv2d_fused_matches_references(case: dict) -> None:
    atol, rtol = tolerance("conv", torch.float32)
    out = conv2d_fused(case["x"], case["weight"], case["bias"], **_conv_kwargs(case))
    y, sums, sumsq = out if case["stats"] else (out, None, None)
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == case["x"].dtype
    ref_y, ref_sums, ref_sumsq = conv2d_fused_reference(
        case["x"], case["weight"], case["bias"], **_conv_kwargs(case)
    )
    ind_y, ind_sums, ind_sumsq = _conv_from_functional(case)
    torch.testing.assert_close(y, ref_y, atol=atol, rtol=rtol)
    torch.testing.assert_close(y.double(), ind_y, atol=atol, rtol=rtol)
    if case["stats"]:
        # Sums over N*P*Q elements: scale the tolerance with their magnitude.
        torch.testing.assert_close(sums, ref_sums, atol=atol * y[:, 0].numel(), rtol=rtol)
        torch.testing.assert_close(sums.double(), ind_sums, atol=atol * y[:, 0].numel(), rtol=rtol)
        sq_atol, sq_rtol = tolerance("conv_sumsq", torch.float32)
        torch.testing.assert_close(sumsq.double(), ind_sumsq, atol=sq_atol * y[:, 0].numel(), rtol=sq_rtol)


@settings(PROPERTY_SETTINGS, max_examples=10)
@given(case=conv_cases())
def test_conv2d_fused_gradients_match_autograd_of_functional(case: dict) -> None:
    case = {**case, "stats": False}
    leaves = {
        name: case[name].clone().requires_grad_(True)
        for name in ("x", "weight", "bias", "scale", "shift", "residual")
        if case[name] is not None
    }
    ours = {**case, **leaves}
    y = conv2d_fused(ours["x"], ours["weight"], ours["bias"], **_conv_kwargs(ours))
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(y, list(leaves.values()), grad_out)
    ref_leaves = {name: t.detach().double().requires_grad_(True) for name, t in leaves.items()}
    ref_y = _conv_from_functional({**case, **ref_leaves})[0]
    ref_grads = torch.autograd.grad(ref_y, list(ref_leaves.values()), grad_out.double())
    atol, rtol = tolerance("conv_grad", torch.float32)
    for name, got, want in zip(leaves, grads, ref_grads, strict=True):
        torch.testing.assert_close(
            got.double(), want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )
