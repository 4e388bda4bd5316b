"""Property-based tests (hypothesis) of the fused normalization ops vs references, over random small shapes.

Under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` without CUDA) the Triton kernels themselves run;
a guard test asserts the Triton launchers are reached. Each draw is checked against the op reference
(``kernels/norm_reference.py``) and against ``torch.nn.functional`` autograd in float64. Budgets are fixed
and small and ``derandomize=True`` draws the same examples every run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels._common import ACTIVATIONS, use_triton
from kernels.norm_ops import batch_norm_act, group_norm_act, layer_norm2d_act
from kernels.norm_reference import (
    batch_norm_act_forward_reference,
    group_norm_act_forward_reference,
    layer_norm2d_act_forward_reference,
)
from kernels.tolerances import tolerance

PROPERTY_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
ACT = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


@pytest.fixture(autouse=True)
def _needs_the_triton_path() -> None:
    if not use_triton(torch.zeros(1)):
        pytest.skip("the Triton path is not active (no CUDA and TRITON_INTERPRET!=1): nothing to test")


def test_norm_ops_launch_the_triton_kernels(monkeypatch) -> None:
    """Guard against a silent reference fallback: the properties below must exercise Triton."""
    import kernels.norm as norm

    calls = []
    for name in (
        "batch_norm_act_forward_triton",
        "group_norm_act_forward_triton",
        "layer_norm2d_act_forward_triton",
    ):
        real = getattr(norm, name)
        monkeypatch.setattr(norm, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    x = torch.randn(2, 4, 3, 3)
    batch_norm_act(x, None, None, training=True)
    group_norm_act(x, 2)
    layer_norm2d_act(x)
    assert len(calls) == 3


@st.composite
def norm_cases(draw: st.DrawFn) -> dict:
    groups = draw(st.integers(1, 3))
    n = draw(st.integers(1, 3))
    c = groups * draw(st.integers(1, 4))
    h, w = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    if n * h * w < 2:  # batch statistics need two values per channel
        h = 2
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    fmt = draw(st.sampled_from([torch.contiguous_format, torch.channels_last]))
    offset, spread = draw(st.floats(-4, 4)), draw(st.floats(0.25, 4))
    return {
        "x": (torch.randn(n, c, h, w, generator=g) * spread + offset).contiguous(memory_format=fmt),
        "weight": torch.randn(c, generator=g) if draw(st.booleans()) else None,
        "bias": torch.randn(c, generator=g) if draw(st.booleans()) else None,
        "residual": torch.randn(n, c, h, w, generator=g).contiguous(memory_format=fmt)
        if draw(st.booleans())
        else None,
        "activation": draw(st.sampled_from(ACTIVATIONS)),
        "groups": groups,
        "training": draw(st.booleans()),
        "probe": torch.randn(n, c, h, w, generator=g),
    }


def _check(case: dict, ours, eager64, reference) -> None:
    """Forward vs the op reference and vs float64 eager; every gradient vs float64 autograd."""
    atol, rtol = tolerance("norm", torch.float32)
    names = [k for k in ("x", "weight", "bias", "residual") if case[k] is not None]
    leaves = {k: case[k].clone().requires_grad_() for k in names}
    leaves64 = {k: case[k].double().requires_grad_() for k in names}
    y = ours({**case, **leaves})
    e = eager64({**case, **leaves64})
    torch.testing.assert_close(y, reference(case), atol=atol, rtol=rtol)
    torch.testing.assert_close(y.double(), e, atol=atol, rtol=rtol)
    grads = torch.autograd.grad(y, list(leaves.values()), case["probe"])
    want = torch.autograd.grad(e, list(leaves64.values()), case["probe"].double())
    count = case["x"].numel() // case["x"].shape[1]
    grad_atol, grad_rtol = tolerance("norm_grad", torch.float32)
    for name, got, exp in zip(names, grads, want, strict=True):
        scale = count**0.5 if name in ("weight", "bias") else 1.0  # sums over N·H·W
        torch.testing.assert_close(
            got.double(), exp, atol=grad_atol * scale, rtol=grad_rtol, msg=lambda m, n=name: f"d{n}: {m}"
        )


def _act(case: dict, u: torch.Tensor) -> torch.Tensor:
    return ACT[case["activation"]](u if case["residual"] is None else u + case["residual"])


@PROPERTY_SETTINGS
@given(case=norm_cases())
def test_batch_norm_act_matches_references(case: dict) -> None:
    c = case["x"].shape[1]
    g = torch.Generator().manual_seed(1)
    running = (torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5)

    def ours(t):
        rm, rv = running[0].clone(), running[1].clone()
        return batch_norm_act(
            t["x"],
            rm,
            rv,
            t["weight"],
            t["bias"],
            t["training"],
            0.1,
            1e-5,
            activation=t["activation"],
            residual=t["residual"],
        )

    def eager64(t):
        rm, rv = running[0].double(), running[1].double()
        w = None if t["weight"] is None else t["weight"]
        return _act(t, F.batch_norm(t["x"], rm, rv, w, t["bias"], t["training"], 0.1, 1e-5))

    def reference(t):
        return batch_norm_act_forward_reference(
            t["x"],
            t["weight"],
            t["bias"],
            t["residual"],
            running[0],
            running[1],
            None,
            None,
            t["training"],
            1e-5,
            t["activation"],
        )[0]

    _check(case, ours, eager64, reference)


@PROPERTY_SETTINGS
@given(case=norm_cases())
def test_group_norm_act_matches_references(case: dict) -> None:
    groups = case["groups"]
    _check(
        case,
        lambda t: group_norm_act(
            t["x"], groups, t["weight"], t["bias"], 1e-5, activation=t["activation"], residual=t["residual"]
        ),
        lambda t: _act(t, F.group_norm(t["x"], groups, t["weight"], t["bias"], 1e-5)),
        lambda t: group_norm_act_forward_reference(
            t["x"], t["weight"], t["bias"], t["residual"], groups, 1e-5, t["activation"]
        )[0],
    )


@PROPERTY_SETTINGS
@given(case=norm_cases())
def test_layer_norm2d_act_matches_references(case: dict) -> None:
    c = case["x"].shape[1]
    _check(
        case,
        lambda t: layer_norm2d_act(
            t["x"], t["weight"], t["bias"], 1e-6, activation=t["activation"], residual=t["residual"]
        ),
        lambda t: _act(
            t,
            F.layer_norm(t["x"].permute(0, 2, 3, 1), (c,), t["weight"], t["bias"], 1e-6).permute(0, 3, 1, 2),
        ),
        lambda t: layer_norm2d_act_forward_reference(
            t["x"], t["weight"], t["bias"], t["residual"], 1e-6, t["activation"]
        )[0],
    )
