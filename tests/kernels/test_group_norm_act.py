"""``lcv::group_norm_act`` (``kernels/lcv_kernels/group_norm_act.py``): op, backward op, functional, module forward,
module.

On CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py), so shapes
stay tiny and odd; tests that claim to test Triton count the launcher calls. Two oracles everywhere: the op
references (``kernels/lcv_kernels/group_norm_act_reference.py``) and ``torch.nn.functional`` autograd in float64.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from kernel_checks import (
    DEVICE,
    EAGER_ACTIVATIONS,
    STRIDE_CASES,
    TRITON_PATH,
    as_leaf,
    assert_close,
    assert_grads_close,
    check_fake_vs_real,
    count_calls,
    grads_of,
    leaves64,
    make,
    note_case,
    probe_for,
    requires_cuda,
    requires_triton_path,
    vector_variants,
)
from lcv_kernels._common import ACTIVATIONS, canonical_strides, dense_layout, use_triton
from lcv_kernels.group_norm_act import FusedGroupNormAct, group_norm_act, group_norm_act_forward
from lcv_kernels.group_norm_act_reference import (
    group_norm_act_backward_reference,
    group_norm_act_forward_reference,
)
from offline_compile import run_offline_compile

# ``lcv_kernels.group_norm_act`` is the function re-exported by ``lcv_kernels/__init__.py``; the module is this one.
GN = importlib.import_module("lcv_kernels.group_norm_act")
# Masked lanes load x = 0, which a mean of 1000 normalises to about -1000: numpy warns that exp() overflows
# there (the lane is never stored; on a GPU exp gives inf and the activation 0, as for real inputs that
# negative).
MASKED_LANE_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
LAUNCHERS = ("group_norm_act_forward_triton", "group_norm_act_backward_triton")
FWD, BWD = LAUNCHERS
ops = torch.ops.lcv


@pytest.fixture
def launches(monkeypatch):
    """The Triton launchers called so far (each still runs)."""
    return count_calls(monkeypatch, GN, *LAUNCHERS)


def _d(t):
    return None if t is None else t.detach()


def check_group_norm(
    x,
    groups,
    weight,
    bias,
    residual,
    *,
    activation,
    eps=1e-5,
    grad_family="norm",
    probe_layout=None,
    ref_scale=1.0,
):
    """``group_norm_act`` vs float64 eager (``F.group_norm`` → + residual → activation) and vs the op
    references: output (dtype, canonical strides of x's layout) and every gradient. Leaves that are not None
    must require grad. ``ref_scale`` widens the output comparison with the (fp32) op reference: two fp32
    results that are each within the tolerance of float64 can be twice that apart."""
    dtype, c = x.dtype, x.shape[1]
    y = group_norm_act(x, groups, weight, bias, eps, activation=activation, residual=residual)
    assert y.dtype == dtype
    assert y.stride() == canonical_strides(x.shape, dense_layout(x)), (y.stride(), x.stride())

    x6, w6, b6, r6 = leaves64(x, weight, bias, residual)
    e = F.group_norm(x6, groups, w6, b6, eps)
    e = EAGER_ACTIVATIONS[activation](e if r6 is None else e + r6)
    ref_y, mean, rstd = group_norm_act_forward_reference(
        _d(x), _d(weight), _d(bias), _d(residual), groups, eps, activation
    )
    assert_close(y, e, "norm", dtype, msg="y vs float64 eager")
    assert_close(y, ref_y, "norm", dtype, scale=ref_scale, msg="y vs op reference")

    probe = probe_for(x, probe_layout)
    inputs = [x, weight, bias, residual]
    grads = grads_of(y, inputs, probe)
    grads64 = grads_of(e, [x6, w6, b6, r6], probe.double())
    ref_grads = group_norm_act_backward_reference(
        probe,
        _d(x),
        _d(weight),
        _d(bias),
        _d(residual),
        mean,
        rstd,
        groups,
        activation,
        [t is not None for t in inputs],
    )
    assert_grads_close(grads, grads64, ref_grads, dtype=dtype, count=x.numel() // c, grad_family=grad_family)


# ---------------------------------------------------------------------------------------------------------
# Forward and backward vs the references and float64 eager

# (N, C, H, W, groups): one group; one channel a group (N=1); 1x1; 70 channels a group (two channel blocks);
# odd HW.
CASES = [(2, 6, 5, 3, 3), (1, 5, 3, 7, 5), (2, 4, 1, 1, 1), (1, 140, 2, 3, 2), (2, 6, 9, 11, 2)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}C{}H{}W{}G{}".format(*c))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_backward_vs_reference_and_torch(case, activation, launches):
    n, c, h, w, groups = case
    layout = "nhwc" if CASES.index(case) % 2 else "nchw"
    x = make((n, c, h, w), layout, offset=2.0, scale=3.0)
    r = make((n, c, h, w), layout) if activation != "none" else None
    check_group_norm(x, groups, make((c,)), make((c,)), r, activation=activation)
    if TRITON_PATH:
        assert launches == [FWD, BWD]


def test_without_affine_parameters():
    check_group_norm(make((2, 4, 3, 5)), 2, None, None, None, activation="silu")


@MASKED_LANE_OVERFLOW
@pytest.mark.parametrize("offset", [0.0, 30.0, 300.0, 1000.0])
@pytest.mark.parametrize(
    ("shape", "groups"),
    [((2, 140, 3, 3), 2), ((1, 64, 10, 10), 2)],
    ids=["two_channel_tiles", "two_pixel_tiles"],
)
def test_statistics_at_large_means(offset, shape, groups, launches):
    """std ~1 around a mean of up to 1000: output and gradients within the GroupNorm tolerance of float64
    eager (the group statistics merge several tiles: 70 channels a group, or 32 channels x 100 pixels)."""
    x = make(shape, "nhwc", offset=offset)
    c = shape[1]
    # at a mean of 1000 one fp32 rounding of the mean (3e-5) times |γ| ~ 2 is most of the tolerance: the
    # kernel and the fp32 reference are each compared with float64 at 1x, with each other at 2x
    check_group_norm(x, groups, make((c,)), make((c,)), None, activation="gelu", ref_scale=2.0)
    if TRITON_PATH:
        assert launches == [FWD, BWD]


# ---------------------------------------------------------------------------------------------------------
# Issue: bad input is refused as PyTorch refuses it (same exception type, PyTorch's message)

ONE_VALUE = "Expected more than 1 value per channel when training"


@pytest.mark.parametrize(
    ("shape", "groups"),
    [((1, 4, 1, 1), 4), ((1, 3, 1, 1), 2), ((2, 6, 3, 3), 4), ((2, 6, 1, 1), 4), ((1, 6, 3, 3), 4)],
    ids=["N1_1x1_G=C", "N1_1x1_C3_G2", "C6_G4", "C6_G4_1x1", "N1_C6_G4"],
)
def test_bad_input_raises_what_f_group_norm_raises(shape, groups):
    """Where ``F.group_norm`` raises, so do the functional, the module and the op's fake (what torch.compile
    runs): the same exception type; for one value per group PyTorch's ValueError message, for channels not
    divisible by the groups PyTorch's RuntimeError message."""
    x = torch.randn(shape, device=DEVICE)
    with pytest.raises(Exception) as torch_info:
        F.group_norm(x, groups)
    torch_error = torch_info.value
    assert type(torch_error) in (ValueError, RuntimeError), repr(torch_error)
    if isinstance(torch_error, ValueError):
        assert str(torch_error).startswith(ONE_VALUE)
        match = ONE_VALUE
    else:
        match = re.escape(str(torch_error))
    with pytest.raises(type(torch_error), match=match):
        group_norm_act(x, groups)
    if (
        shape[1] % groups == 0
    ):  # (nn.GroupNorm itself refuses to be built with channels not divisible by groups)
        with pytest.raises(type(torch_error), match=match):
            nn.GroupNorm(groups, shape[1]).to(DEVICE)(x)
        with pytest.raises(type(torch_error), match=match):
            FusedGroupNormAct(groups, shape[1], activation="relu").to(DEVICE)(x)
    with pytest.raises(type(torch_error), match=match), FakeTensorMode() as mode:
        ops.group_norm_act.default(mode.from_tensor(x), None, None, None, groups, 1e-5, "none")


@MASKED_LANE_OVERFLOW
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_two_samples_of_one_value_per_group_are_allowed_as_in_pytorch(layout, launches):
    """N=2, 1x1, G=C: PyTorch normalises each value by itself (x̂ = 0, y = β); so must we, forward and
    backward."""
    x = make((2, 4, 1, 1), layout)
    F.group_norm(x.detach(), 4)  # PyTorch accepts it
    check_group_norm(x, 4, make((4,)), make((4,)), make((2, 4, 1, 1), layout), activation="silu")
    if TRITON_PATH:
        assert launches == [FWD, BWD]


# ---------------------------------------------------------------------------------------------------------
# Issue: per-channel vectors that are not contiguous (``t[::2]``, a stride-0 expand) on the Triton path


@requires_triton_path
@pytest.mark.parametrize("kind", ["strided", "expanded"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_strided_and_expanded_vectors_on_the_triton_path(kind, layout, launches):
    """weight and bias as ``t[::2]`` with NaN in the gaps, or as a stride-0 expand of a longer tensor: forward
    and backward must match the references (a kernel indexing them as ``ptr + c`` reads the NaNs or wrong
    entries)."""
    c = 6
    g = torch.Generator().manual_seed(3)
    weight = as_leaf(vector_variants((torch.rand(c, generator=g) + 0.5).to(DEVICE))[kind])
    bias = as_leaf(vector_variants(torch.randn(c, generator=g).to(DEVICE))[kind])
    x = make((2, c, 4, 3), layout, offset=1.0, scale=2.0)
    check_group_norm(x, 3, weight, bias, make((2, c, 4, 3), layout), activation="silu")
    assert launches == [FWD, BWD]


# ---------------------------------------------------------------------------------------------------------
# Issue: fake vs real strides (NCHW, channels_last, N=1, H=W=1, C=1; size-1 dims re-strided); opcheck


def _op_args(case, requires_grad=False):
    shape, layout = STRIDE_CASES[case]
    c = shape[1]
    x = make(shape, layout, requires_grad=requires_grad)
    w, b = make((c,), requires_grad=requires_grad), make((c,), requires_grad=requires_grad)
    r = make(shape, layout, requires_grad=requires_grad)
    return x, w, b, r, 2 if c % 2 == 0 else 1


@pytest.mark.parametrize("case", STRIDE_CASES)
def test_fake_strides_match_real_forward_and_backward(case, launches):
    x, w, b, r, groups = _op_args(case)
    check_fake_vs_real(ops.group_norm_act.default, (x, w, b, r, groups, 1e-5, "silu"))
    _, mean, rstd = ops.group_norm_act.default(x, w, b, r, groups, 1e-5, "silu")
    g = probe_for(x)
    args = (g, x, w, b, r, mean, rstd, groups, "silu", [True, True, True, True])
    check_fake_vs_real(ops.group_norm_act_backward.default, args)
    args = (g, x, w, None, None, mean, rstd, groups, "gelu", [False, True, False, False])
    check_fake_vs_real(ops.group_norm_act_backward.default, args)
    if TRITON_PATH:
        assert FWD in launches and BWD in launches


@pytest.mark.parametrize("case", ["nchw", "nhwc", "n1_nchw", "hw1_nhwc", "c1_nchw"])
def test_opcheck_over_layouts(case):
    x, w, b, r, groups = _op_args(case, requires_grad=True)
    torch.library.opcheck(ops.group_norm_act.default, (x, w, b, r, groups, 1e-5, "gelu"))
    _, mean, rstd = ops.group_norm_act.default(x, w, b, r, groups, 1e-5, "gelu")
    d = lambda t: t.detach()  # noqa: E731
    args = (probe_for(x), d(x), d(w), d(b), d(r), mean, rstd, groups, "relu", [True, True, True, True])
    torch.library.opcheck(ops.group_norm_act_backward.default, args)
    if case == "nhwc":  # weight without bias, dx only
        args = (probe_for(x), d(x), d(w), None, None, mean, rstd, groups, "relu", [True, False, False, False])
        torch.library.opcheck(ops.group_norm_act_backward.default, args)


# ---------------------------------------------------------------------------------------------------------
# The module


def test_from_module_shares_state_and_keeps_state_dict_keys():
    gn = nn.GroupNorm(3, 6).to(DEVICE)
    with torch.no_grad():
        for p in gn.parameters():
            p.uniform_(-1, 1)
    fused = FusedGroupNormAct.from_module(gn, nn.SiLU())
    assert fused.weight is gn.weight and fused.bias is gn.bias
    assert list(fused.state_dict()) == list(gn.state_dict())
    assert "activation=silu" in repr(fused)
    x, residual = (
        make((2, 6, 4, 5), "nhwc", requires_grad=False),
        make((2, 6, 4, 5), "nhwc", requires_grad=False),
    )
    assert_close(fused(x, residual), F.silu(gn(x) + residual), "norm")
    assert_close(group_norm_act_forward(gn, x, "relu", residual), F.relu(gn(x) + residual), "norm")


def test_module_forward_keeps_eager_type_promotion_for_a_residual_of_another_dtype():
    """The op needs residual.dtype == x.dtype; the module forward then adds the residual after, as eager
    does."""
    gn = nn.GroupNorm(2, 4).to(DEVICE)
    fused = FusedGroupNormAct.from_module(gn)
    x = make((2, 4, 3, 5), requires_grad=False)
    residual = make((2, 4, 3, 5), requires_grad=False).half()
    y, e = fused(x, residual), gn(x) + residual
    assert y.dtype == e.dtype == torch.float32
    assert_close(y, e, "norm")
    # modules take any strides, like their torch counterparts
    x_strided = make((2, 4, 3, 10), requires_grad=False)[..., ::2]
    assert_close(group_norm_act_forward(gn, x_strided, "gelu"), F.gelu(gn(x_strided)), "norm")


@pytest.mark.parametrize(
    ("module", "act", "error", "match"),
    [
        (nn.BatchNorm2d(4), None, TypeError, "expects nn.GroupNorm"),
        (nn.GroupNorm(2, 4), nn.GELU(approximate="tanh"), ValueError, "cannot be fused"),
        (nn.GroupNorm(2, 4), nn.Tanh(), ValueError, "Tanh cannot be fused"),
    ],
)
def test_from_module_rejects_what_it_cannot_fuse(module, act, error, match):
    with pytest.raises(error, match=match):
        FusedGroupNormAct.from_module(module, act)


# ---------------------------------------------------------------------------------------------------------
# torch.compile, dispatch, dtypes


def test_functional_and_module_in_torch_compile_fullgraph_forward_and_backward(launches):
    x, w, b, r = make((2, 6, 3, 5), "nhwc"), make((6,)), make((6,)), make((2, 6, 3, 5), "nhwc")

    def block(x, w, b, r):
        return group_norm_act(x, 3, w, b, activation="silu", residual=r).square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    loss = compiled(x, w, b, r)
    grads = torch.autograd.grad(loss, (x, w, b, r))
    if TRITON_PATH:
        assert launches == [FWD, BWD], "the compiled graph runs the Triton op"
    e_loss = block(x, w, b, r)
    e_grads = torch.autograd.grad(e_loss, (x, w, b, r))
    assert_close(loss, e_loss, "norm")
    for g, e in zip(grads, e_grads, strict=True):
        assert_close(g, e, "norm", scale=4.0)
    gn = nn.GroupNorm(2, 6).to(DEVICE)
    module = torch.compile(FusedGroupNormAct.from_module(gn, nn.GELU()), backend="aot_eager", fullgraph=True)
    assert_close(module(x.detach()), F.gelu(gn(x.detach())), "norm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch test")
def test_cpu_without_interpreter_runs_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def boom(*args, **kwargs):
        raise AssertionError("a Triton launcher ran on CPU without TRITON_INTERPRET=1")

    for name in LAUNCHERS:
        monkeypatch.setattr(GN, name, boom)
    x = make((2, 4, 3, 3))
    assert not use_triton(x)
    check_group_norm(x, 2, make((4,)), make((4,)), make((2, 4, 3, 3)), activation="relu")


def test_bf16_on_the_reference_path_and_autocast_dtypes(monkeypatch):
    """The interpreter has no bf16, so bf16 runs the reference path here (Triton bf16 is a GPU test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = make((2, 4, 5, 3), "nhwc", dtype=torch.bfloat16)
    w, b = make((4,)), make((4,))
    y = group_norm_act(x, 2, w, b, activation="gelu")
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    x6, w6, b6 = leaves64(x, w, b)
    e = F.gelu(F.group_norm(x6, 2, w6, b6))
    assert_close(y, e, "norm", torch.bfloat16)
    probe = probe_for(x)
    for name, g, e_g in zip("xwb", grads_of(y, [x, w, b], probe), grads_of(e, [x6, w6, b6], probe.double())):
        assert_close(g, e_g, "norm", torch.bfloat16, scale=30**0.5 if name in "wb" else 1.0, msg=f"d{name}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the output dtype under autocast is eager's (CUDA autocast: fp32 for group norm; CPU: the input's)
        xd, wd, bd = x.detach(), w.detach(), b.detach()
        y = group_norm_act(xd, 2, wd, bd)
        e = F.group_norm(xd, 2, wd, bd)
        assert y.dtype == e.dtype
        assert_close(y, e.double(), "norm", torch.bfloat16)


def test_gradcheck_backward_formulas_float64_reference_path(monkeypatch):
    """Hand-written backward reference vs numerical derivatives (float64 needs the reference path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(
        "lcv_kernels._common.SUPPORTED_DTYPES", (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    )
    kw = {"dtype": torch.float64, "requires_grad": True}
    x, r = torch.randn(2, 4, 3, 2, **kw), torch.randn(2, 4, 3, 2, **kw)
    w, b = torch.randn(4, **kw), torch.randn(4, **kw)
    assert torch.autograd.gradcheck(
        lambda *t: group_norm_act(t[0], 2, t[1], t[2], activation="gelu", residual=t[3]), (x, w, b, r)
    )


# ---------------------------------------------------------------------------------------------------------
# Bad inputs (the ones F.group_norm accepts or checks differently: ours)

BAD_INPUTS = {
    "3d": (lambda: group_norm_act(torch.randn(2, 4, 3), 2), ValueError, "4-D"),
    "strided": (lambda: group_norm_act(torch.randn(2, 4, 4, 6)[..., ::2], 2), ValueError, "dense in NCHW"),
    "float64": (lambda: group_norm_act(torch.randn(2, 4, 3, 3).double(), 2), TypeError, "supported dtypes"),
    "groups_zero": (lambda: group_norm_act(torch.randn(2, 4, 3, 3), 0), RuntimeError, "positive int"),
    "weight_len": (
        lambda: group_norm_act(torch.randn(2, 6, 3, 3), 3, weight=torch.ones(4)),
        ValueError,
        "weight must be a 1-D tensor of 6",
    ),
    "bias_int": (
        lambda: group_norm_act(torch.randn(2, 6, 3, 3), 3, bias=torch.ones(6, dtype=torch.int64)),
        TypeError,
        "floating-point",
    ),
    "residual_shape": (
        lambda: group_norm_act(torch.randn(2, 4, 3, 3), 2, residual=torch.randn(2, 4, 3, 2)),
        ValueError,
        "residual must have",
    ),
    "residual_dtype": (
        lambda: group_norm_act(torch.randn(2, 4, 3, 3), 2, residual=torch.randn(2, 4, 3, 3).half()),
        TypeError,
        "residual dtype",
    ),
    "activation": (
        lambda: group_norm_act(torch.randn(2, 4, 3, 3), 2, activation="tanh"),
        ValueError,
        "unknown activation 'tanh'",
    ),
    "module_3d": (lambda: FusedGroupNormAct(2, 4)(torch.randn(2, 4, 3)), ValueError, "4-D"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(name):
    call, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------------------
# Property test (hypothesis): random small cases under the interpreter vs float64 eager and the references

PROPERTY_SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def gn_cases(draw):
    n = draw(st.integers(1, 2))
    h, w = draw(st.sampled_from([(1, 1), (1, 6), (5, 1), (3, 4), (13, 11)]))
    c = draw(st.sampled_from([1, 3, 5, 24, 40]))
    # at most 8 groups: the interpreter runs each (sample, group) program in Python (one group a channel is in
    # the parametrized cases)
    groups = draw(st.sampled_from([g for g in (1, 2, 3, 4, 5, 8) if c % g == 0]))
    if n * (c // groups) * h * w == 1:  # one value per group over the batch: PyTorch refuses it
        n = 2
    return {
        "shape": (n, c, h, w),
        "groups": groups,
        "layout": draw(st.sampled_from(["nchw", "nhwc"])),
        "probe_layout": draw(st.sampled_from([None, "nchw", "nhwc"])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float16])),
        "vector_dtype": draw(st.sampled_from(["fp32", "x"])),
        "activation": draw(st.sampled_from(ACTIVATIONS)),
        "residual": draw(st.booleans()),
        "weight": draw(st.sampled_from([None, "contiguous", "strided", "expanded"])),
        "bias": draw(st.sampled_from([None, "contiguous", "strided", "expanded"])),
        "offset": draw(st.sampled_from([0.0, -3.0, 50.0])),
        "spread": draw(st.sampled_from([0.5, 1.0, 3.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


@requires_triton_path
@MASKED_LANE_OVERFLOW
@PROPERTY_SETTINGS
@given(case=gn_cases())
def test_property_matches_float64_eager_and_the_references(case):
    note_case(case)
    g = torch.Generator().manual_seed(case["seed"])
    c = case["shape"][1]
    dtype = case["dtype"]
    vdtype = torch.float32 if case["vector_dtype"] == "fp32" else dtype

    def vector(kind, positive=False):
        """fp32 parameters (mixed precision) or x's dtype (``model.half()``), in the drawn variant"""
        if kind is None:
            return None
        values = torch.rand(c, generator=g) + 0.5 if positive else torch.randn(c, generator=g)
        return vector_variants(values.to(DEVICE, vdtype))[kind]

    x = make(case["shape"], case["layout"], case["offset"], case["spread"], dtype=dtype, generator=g)
    weight, bias = as_leaf(vector(case["weight"], positive=True)), as_leaf(vector(case["bias"]))
    residual = make(case["shape"], case["layout"], dtype=dtype, generator=g) if case["residual"] else None
    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp, GN, *LAUNCHERS)
        check_group_norm(
            x,
            case["groups"],
            weight,
            bias,
            residual,
            activation=case["activation"],
            grad_family="norm_grad",
            probe_layout=case["probe_layout"],
        )
    assert calls == [FWD, BWD], calls


# ---------------------------------------------------------------------------------------------------------
# GPU-only build check without a GPU, and GPU tests

_SM90_COMPILE_SCRIPT = """
import importlib
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from offline_compile import pointer_offset_widths
gn = importlib.import_module("lcv_kernels.group_norm_act")

IO = ("x_ptr", "y_ptr", "g_ptr", "res_ptr", "dx_ptr", "dres_ptr")
FLOATS = ("inv_count", "inv_c", "eps")

def build(kernel, warps=4, **consts):
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name in IO else "*fp32"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "ld.global" in compiled.asm["ptx"], kernel.__name__
    # "offsets are int64": every pointer-tensor offset in the Triton IR is i64
    widths = pointer_offset_widths(compiled.asm["ttir"])
    assert widths and set(widths) == {"i64"}, f"{kernel.__name__}: pointer offsets {widths}"

act = dict(HAS_WEIGHT=True, HAS_BIAS=True, HAS_RESIDUAL=True, ACTIVATION=2)
build(gn._gn_fwd_kernel, BLOCK_HW=128, BLOCK_C=16, **act)
build(gn._gn_bwd_kernel, BLOCK_HW=128, BLOCK_C=16, WRITE_DX=True, WRITE_DRES=True, **act)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never compiles; catch GPU-only compile errors by compiling offline for Hopper."""
    run_offline_compile(_SM90_COMPILE_SCRIPT)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_types_resnet_like_shapes(dtype, launches):
    x = make((8, 64, 28, 28), "nhwc", dtype=dtype)
    w, b = as_leaf(torch.rand(64, device="cuda") + 0.5), as_leaf(torch.randn(64, device="cuda"))
    check_group_norm(x, 32, w, b, make((8, 64, 28, 28), "nhwc", dtype=dtype), activation="silu")
    assert launches == [FWD, BWD]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_gpu_bf16_strided_vectors(kind, launches):
    c = 48
    w = as_leaf(vector_variants(torch.rand(c, device="cuda") + 0.5)[kind])
    b = as_leaf(vector_variants(torch.randn(c, device="cuda"))[kind])
    check_group_norm(make((4, c, 9, 7), "nhwc", dtype=torch.bfloat16), 6, w, b, None, activation="gelu")
    assert launches == [FWD, BWD]
