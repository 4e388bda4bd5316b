"""``lcv::batch_norm_act`` (``kernels/lcv_kernels/batch_norm_act.py``): op, backward op, functional, module forward,
module.

On CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py), so shapes
stay tiny and odd; tests that claim to test Triton count the launcher calls. Two oracles everywhere: the op
references (``kernels/lcv_kernels/batch_norm_act_reference.py``) and ``torch.nn.functional`` autograd in float64.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

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
from lcv_kernels.batch_norm_act import (
    FusedBatchNormAct,
    batch_norm_act,
    batch_norm_act_forward,
    batch_norm_scale_shift,
)
from lcv_kernels.batch_norm_act_reference import (
    batch_norm_act_backward_reference,
    batch_norm_act_forward_reference,
)
from offline_compile import run_offline_compile

BN = importlib.import_module("lcv_kernels.batch_norm_act")
# Masked lanes load x = 0, which a mean of 1000 normalises to about -1000: numpy warns that exp() overflows
# there (the lane is never stored; on a GPU exp gives inf and the activation 0, as for real inputs that
# negative).
MASKED_LANE_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
LAUNCHERS = ("batch_norm_act_forward_triton", "batch_norm_act_backward_triton", "batch_stats_triton")
FWD, BWD, STATS = LAUNCHERS
ops = torch.ops.lcv


@pytest.fixture
def launches(monkeypatch):
    """The Triton launchers called so far (each still runs)."""
    return count_calls(monkeypatch, BN, *LAUNCHERS)


def _d(t):
    return None if t is None else t.detach()


def check_batch_norm(
    x,
    weight,
    bias,
    residual,
    *,
    training,
    activation,
    running=None,
    momentum=0.1,
    eps=1e-5,
    grad_family="norm",
    probe_layout=None,
    ref_scale=1.0,
):
    """``batch_norm_act`` vs float64 eager (``F.batch_norm`` → + residual → activation) and vs the op
    references: output (dtype, canonical strides of x's layout), running statistics (updated in training,
    untouched in eval) and every gradient. Leaves that are not None must require grad. ``ref_scale`` widens
    the output comparison with the (fp32) op reference: two fp32 results each within the tolerance of float64
    can be twice that apart."""
    dtype, c = x.dtype, x.shape[1]
    rm, rv = running if running is not None else (None, None)
    rm0, rv0 = (None, None) if rm is None else (rm.detach().clone(), rv.detach().clone())
    rm_e, rv_e = (None, None) if rm is None else (rm.detach().double(), rv.detach().double())

    y = batch_norm_act(
        x, rm, rv, weight, bias, training, momentum, eps, activation=activation, residual=residual
    )
    assert y.dtype == dtype
    assert y.stride() == canonical_strides(x.shape, dense_layout(x)), (y.stride(), x.stride())

    x6, w6, b6, r6 = leaves64(x, weight, bias, residual)
    e = F.batch_norm(x6, rm_e, rv_e, w6, b6, training, momentum, eps)
    e = EAGER_ACTIVATIONS[activation](e if r6 is None else e + r6)
    ref_y, mean, var = batch_norm_act_forward_reference(
        _d(x), _d(weight), _d(bias), _d(residual), rm0, rv0, None, None, training, eps, activation
    )
    assert_close(y, e, "norm", dtype, msg="y vs float64 eager")
    assert_close(y, ref_y, "norm", dtype, scale=ref_scale, msg="y vs op reference")
    if rm is not None and training:
        assert_close(rm, rm_e, "norm", rm.dtype, msg="running_mean")
        assert_close(rv, rv_e, "norm", rv.dtype, msg="running_var")
    elif rm is not None:
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0), "eval must not touch the running statistics"

    probe = probe_for(x, probe_layout)
    inputs = [x, weight, bias, residual]
    grads = grads_of(y, inputs, probe)
    grads64 = grads_of(e, [x6, w6, b6, r6], probe.double())
    ref_grads = batch_norm_act_backward_reference(
        probe,
        _d(x),
        _d(weight),
        _d(bias),
        _d(residual),
        mean,
        var,
        training,
        eps,
        activation,
        [t is not None for t in inputs],
    )
    assert_grads_close(grads, grads64, ref_grads, dtype=dtype, count=x.numel() // c, grad_family=grad_family)


# ---------------------------------------------------------------------------------------------------------
# Forward and backward vs the references and float64 eager

# (N, C, H, W): odd sizes; C=70 spans two channel blocks; 2x3x17x17 = 578 rows; 2x40x8x9 = 144 rows: in the
# interpreter two row chunks (128 + 16 rows) of 64-row tiles, the last one partly masked (the statistics merge
# across tiles and chunks).
SHAPES = [(2, 5, 7, 3), (3, 7, 1, 1), (2, 70, 3, 3), (2, 3, 17, 17), (2, 40, 8, 9)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_train_forward_backward_vs_reference_and_torch(shape, activation, launches):
    layout = "nhwc" if SHAPES.index(shape) % 2 else "nchw"
    c = shape[1]
    x = make(shape, layout, offset=3.0, scale=2.0)  # offset: the mean must not cancel the variance
    r = make(shape, layout) if activation in ("relu", "silu") else None
    running = (torch.randn(c, device=DEVICE), torch.rand(c, device=DEVICE) + 0.5)
    check_batch_norm(x, make((c,)), make((c,)), r, training=True, activation=activation, running=running)
    if TRITON_PATH:
        assert sorted(launches) == sorted([FWD, STATS, BWD])


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_eval_uses_running_stats_and_leaves_them_alone(layout, launches):
    c = 6
    running = (torch.randn(c, device=DEVICE), torch.rand(c, device=DEVICE) + 0.5)
    x = make((2, c, 5, 3), layout)
    r = make((2, c, 5, 3), "nhwc" if layout == "nchw" else "nchw")  # a residual in the other layout is fine
    check_batch_norm(x, make((c,)), make((c,)), r, training=False, activation="gelu", running=running)
    if TRITON_PATH:
        assert sorted(launches) == sorted([FWD, BWD]), "eval needs no statistics pass"


def test_without_affine_parameters_or_running_stats():
    x = make((2, 4, 3, 5))
    check_batch_norm(x, None, None, None, training=True, activation="gelu")


def test_batch_norm_scale_shift_is_eval_batch_norm():
    c = 5
    rm, rv = torch.randn(c, device=DEVICE), torch.rand(c, device=DEVICE) + 0.5
    w, b = torch.randn(c, device=DEVICE), torch.randn(c, device=DEVICE)
    x = make((2, c, 3, 4), requires_grad=False)
    for weight, bias in ((w, b), (None, None)):
        scale, shift = batch_norm_scale_shift(rm, rv, weight, bias, 1e-5)
        expected = F.batch_norm(
            x.double(), rm.double(), rv.double(), *leaves64(weight, bias), False, 0.0, 1e-5
        )
        assert_close(x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1), expected, "norm")


# ---------------------------------------------------------------------------------------------------------
# Running statistics and the modules


@pytest.mark.parametrize(
    ("momentum", "affine", "track"),
    [(0.1, True, True), (None, True, True), (0.4, False, True), (0.1, True, False)],
)
def test_running_stats_after_several_steps_match_batchnorm2d(momentum, affine, track):
    bn = nn.BatchNorm2d(5, momentum=momentum, affine=affine, track_running_stats=track).to(DEVICE)
    fused = FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.ReLU())
    for step in range(4):
        layout = "nhwc" if step % 2 else "nchw"
        x = make((2, 5, 4, 3), layout, offset=step, scale=1 + step, requires_grad=False)
        assert_close(fused(x), F.relu(bn(x)), "norm", msg=f"train output, step {step}")
    if track:
        assert_close(fused.running_mean, bn.running_mean, "norm", msg="running_mean")
        assert_close(fused.running_var, bn.running_var, "norm", msg="running_var")
        assert int(fused.num_batches_tracked) == int(bn.num_batches_tracked) == 4
    fused.eval(), bn.eval()
    x = make((2, 5, 4, 3), requires_grad=False)
    assert_close(fused(x), F.relu(bn(x)), "norm", msg="eval output")


def test_from_module_shares_state_and_keeps_state_dict_keys():
    bn = nn.BatchNorm2d(6).to(DEVICE)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
    fused = FusedBatchNormAct.from_module(bn, nn.SiLU())
    assert fused.weight is bn.weight and fused.running_var is bn.running_var
    assert list(fused.state_dict()) == list(bn.state_dict())
    assert "activation=silu" in repr(fused)
    reference = copy.deepcopy(bn)
    x, residual = (
        make((2, 6, 4, 5), "nhwc", requires_grad=False),
        make((2, 6, 4, 5), "nhwc", requires_grad=False),
    )
    assert_close(fused(x, residual), F.silu(reference(x) + residual), "norm")
    assert_close(bn.running_mean, reference.running_mean, "norm", msg="the update reached the shared buffer")
    assert int(bn.num_batches_tracked) == 1


def test_module_forward_keeps_eager_type_promotion_for_a_residual_of_another_dtype():
    """The op needs residual.dtype == x.dtype; the module forward then adds the residual after, as eager
    does."""
    bn = nn.BatchNorm2d(4).to(DEVICE)
    fused = FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.ReLU())
    x = make((2, 4, 3, 5), requires_grad=False)
    residual = make((2, 4, 3, 5), requires_grad=False).half()
    y, e = fused(x, residual), F.relu(bn(x) + residual)
    assert y.dtype == e.dtype == torch.float32
    assert_close(y, e, "norm")
    # the plain-module forward the model rewrite calls, on a non-dense input (modules take any strides)
    x_strided = make((2, 4, 3, 10), requires_grad=False)[..., ::2]
    assert_close(batch_norm_act_forward(bn.eval(), x_strided, "gelu"), F.gelu(bn(x_strided)), "norm")


@pytest.mark.parametrize(
    ("module", "act", "error", "match"),
    [
        (nn.GroupNorm(2, 4), None, TypeError, "expects nn.BatchNorm2d"),
        (nn.BatchNorm2d(4), nn.Tanh(), ValueError, "Tanh cannot be fused"),
        (nn.BatchNorm2d(4), nn.GELU(approximate="tanh"), ValueError, "cannot be fused"),
    ],
)
def test_from_module_rejects_what_it_cannot_fuse(module, act, error, match):
    with pytest.raises(error, match=match):
        FusedBatchNormAct.from_module(module, act)


# ---------------------------------------------------------------------------------------------------------
# Issue: per-channel vectors that are not contiguous (``t[::2]``, a stride-0 expand) on the Triton path


@requires_triton_path
@pytest.mark.parametrize("kind", ["strided", "expanded"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_strided_and_expanded_vectors_on_the_triton_path(kind, training, layout, launches):
    """weight, bias (and, in eval, running_mean/running_var) as ``t[::2]`` with NaN in the gaps, or as a
    stride-0 expand of a longer tensor: forward and backward must match the references (a kernel indexing them
    as ``ptr + c`` reads the NaNs or the wrong entries)."""
    c = 5
    g = torch.Generator().manual_seed(3)
    weight = as_leaf(vector_variants((torch.rand(c, generator=g) + 0.5).to(DEVICE))[kind])
    bias = as_leaf(vector_variants(torch.randn(c, generator=g).to(DEVICE))[kind])
    # running statistics are updated in place in training: a stride-0 buffer cannot be (nor can PyTorch's)
    stats_kind = kind if not training else "strided"
    running = (
        vector_variants(torch.randn(c, generator=g).to(DEVICE))[stats_kind],
        vector_variants((torch.rand(c, generator=g) + 0.5).to(DEVICE))[stats_kind],
    )
    x = make((2, c, 4, 3), layout, offset=1.0, scale=2.0)
    r = make((2, c, 4, 3), layout)
    check_batch_norm(x, weight, bias, r, training=training, activation="silu", running=running)
    assert launches.count(FWD) == 1 and launches.count(BWD) == 1, launches


# ---------------------------------------------------------------------------------------------------------
# Issue: batch statistics at large means; batch_mean/batch_var given vs computed


@MASKED_LANE_OVERFLOW
@pytest.mark.parametrize("offset", [0.0, 30.0, 300.0, 1000.0])
def test_batch_statistics_at_large_means(offset, launches):
    """std ~1 around a mean of up to 1000: output, running statistics and gradients within the BatchNorm
    tolerance of float64 eager (2x40x8x9: the statistics merge 64-row tiles over two row chunks)."""
    shape = (2, 40, 8, 9)
    c = shape[1]
    x = make(shape, "nhwc", offset=offset)
    with torch.no_grad():
        x += torch.linspace(-1, 1, c, device=DEVICE).view(1, c, 1, 1)  # a different mean per channel
    running = (torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE))
    # at a mean of 1000 one fp32 rounding of the mean (3e-5) times |γ| ~ 2 is most of the tolerance: the
    # kernel and the fp32 reference are each compared with float64 at 1x, with each other at 2x
    check_batch_norm(
        x, make((c,)), make((c,)), None, training=True, activation="relu", running=running, ref_scale=2.0
    )
    if TRITON_PATH:
        assert STATS in launches


@MASKED_LANE_OVERFLOW
@pytest.mark.parametrize("offset", [0.0, 1000.0])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_given_batch_mean_and_var_match_computed_statistics(offset, layout, launches):
    """A conv epilogue's batch_mean/batch_var (here: float64 statistics rounded to fp32) replace the
    statistics pass and give the same output, running statistics and gradients as the computed ones."""
    shape = (2, 6, 5, 7)
    c = shape[1]
    x = make(shape, layout, offset=offset)
    w, b, r = make((c,)), make((c,)), make(shape, layout)
    var, mean = torch.var_mean(x.detach().double(), dim=(0, 2, 3), unbiased=False)
    results = []
    for hints in ({}, {"batch_mean": mean.float(), "batch_var": var.float()}):
        launches.clear()
        rm, rv = torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)
        y = batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, activation="silu", residual=r, **hints)
        results.append((y, rm, rv, *torch.autograd.grad(y, (x, w, b, r), probe_for(x))))
        if TRITON_PATH:
            assert (STATS in launches) == (not hints), launches
    # two fp32 statistics, each within the tolerance of float64, may be twice that apart; dγ, dβ sum over
    # N·H·W
    for name, got, want in zip(("y", "running_mean", "running_var", "dx", "dw", "db", "dr"), *results):
        scale = (shape[0] * shape[2] * shape[3]) ** 0.5 if name in ("dw", "db") else 2.0
        assert_close(got, want, "norm", scale=scale, msg=name)


# ---------------------------------------------------------------------------------------------------------
# Issue: fake vs real strides (NCHW, channels_last, N=1, H=W=1, C=1; size-1 dims re-strided); opcheck


def _op_args(case, requires_grad=False):
    shape, layout = STRIDE_CASES[case]
    c = shape[1]
    x = make(shape, layout, requires_grad=requires_grad)
    w, b = make((c,), requires_grad=requires_grad), make((c,), requires_grad=requires_grad)
    r = make(shape, layout, requires_grad=requires_grad)
    rm, rv = torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)
    return x, w, b, r, rm, rv


@pytest.mark.parametrize("case", STRIDE_CASES)
def test_fake_strides_match_real_forward_and_backward(case, launches):
    x, w, b, r, rm, rv = _op_args(case)
    for training in (True, False):
        args = (x, w, b, r, rm, rv, None, None, training, 1e-5, "silu")
        check_fake_vs_real(ops.batch_norm_act.default, args)
    _, mean, var = ops.batch_norm_act.default(x, w, b, r, rm, rv, None, None, True, 1e-5, "silu")
    g = probe_for(x)
    args = (g, x, w, b, r, mean, var, True, 1e-5, "silu", [True, True, True, True])
    check_fake_vs_real(ops.batch_norm_act_backward.default, args)
    args = (g, x, w, None, None, mean, var, False, 1e-5, "gelu", [True, True, False, False])
    check_fake_vs_real(ops.batch_norm_act_backward.default, args)
    if TRITON_PATH:
        assert FWD in launches and BWD in launches


@pytest.mark.parametrize("case", ["nchw", "nhwc", "n1_nchw", "hw1_nhwc", "c1_nchw"])
def test_opcheck_over_layouts(case):
    x, w, b, r, rm, rv = _op_args(case, requires_grad=True)
    torch.library.opcheck(ops.batch_norm_act.default, (x, w, b, r, rm, rv, None, None, True, 1e-5, "relu"))
    _, mean, var = ops.batch_norm_act.default(x, w, b, r, rm, rv, None, None, True, 1e-5, "relu")
    g = probe_for(x)
    args = (g, x.detach(), w.detach(), b.detach(), r.detach(), mean, var, True, 1e-5, "silu", [True] * 4)
    torch.library.opcheck(ops.batch_norm_act_backward.default, args)


def _opcheck_cases():
    x, w, b, r, rm, rv = _op_args("nhwc", requires_grad=True)
    mean, var = torch.randn(4, device=DEVICE), torch.rand(4, device=DEVICE) + 0.5
    g = probe_for(x)
    d = lambda t: t.detach()  # noqa: E731
    return {
        "eval_no_bias": (
            ops.batch_norm_act.default,
            (x, w, None, None, rm, rv, None, None, False, 1e-5, "gelu"),
        ),
        "batch_stats_given": (
            ops.batch_norm_act.default,
            (x, None, b, r, None, None, mean, var, True, 1e-5, "silu"),
        ),
        "backward_eval_dx_only": (
            ops.batch_norm_act_backward.default,
            (g, d(x), d(w), d(b), None, mean, var, False, 1e-5, "relu", [True, False, False, False]),
        ),
    }


@pytest.mark.parametrize("name", ["eval_no_bias", "batch_stats_given", "backward_eval_dx_only"])
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------------------------
# torch.compile, dispatch, dtypes


def test_functional_in_torch_compile_fullgraph_forward_and_backward(launches):
    x, w, b, r = make((2, 6, 3, 5), "nhwc"), make((6,)), make((6,)), make((2, 6, 3, 5), "nhwc")
    rm, rv = torch.zeros(6, device=DEVICE), torch.ones(6, device=DEVICE)

    def block(x, w, b, r, rm, rv):
        return batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, activation="relu", residual=r).square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    rm_c, rv_c = rm.clone(), rv.clone()
    loss = compiled(x, w, b, r, rm_c, rv_c)
    grads = torch.autograd.grad(loss, (x, w, b, r))
    if TRITON_PATH:
        assert sorted(launches) == sorted([FWD, STATS, BWD]), "the compiled graph runs the Triton op"
    e_loss = block(x, w, b, r, rm, rv)
    e_grads = torch.autograd.grad(e_loss, (x, w, b, r))
    assert_close(loss, e_loss, "norm")
    assert_close(rm_c, rm, "norm"), assert_close(rv_c, rv, "norm")
    for g, e in zip(grads, e_grads, strict=True):
        assert_close(g, e, "norm", scale=4.0)


def test_module_in_torch_compile_fullgraph_train_then_eval():
    bn = nn.BatchNorm2d(4, momentum=None).to(DEVICE)
    fused = FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.SiLU())
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    for step in range(2):
        x = make((2, 4, 3, 3), requires_grad=False, offset=step)
        assert_close(compiled(x), F.silu(bn(x)), "norm")
    assert_close(fused.running_var, bn.running_var, "norm")
    assert int(fused.num_batches_tracked) == 2
    fused.eval(), bn.eval()
    x = make((2, 4, 3, 3), requires_grad=False)
    assert_close(compiled(x), F.silu(bn(x)), "norm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch test")
def test_cpu_without_interpreter_runs_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def boom(*args, **kwargs):
        raise AssertionError("a Triton launcher ran on CPU without TRITON_INTERPRET=1")

    for name in LAUNCHERS:
        monkeypatch.setattr(BN, name, boom)
    x = make((2, 4, 3, 3))
    assert not use_triton(x)
    check_batch_norm(x, make((4,)), make((4,)), make((2, 4, 3, 3)), training=True, activation="relu")
    running = (torch.randn(4), torch.rand(4) + 0.5)
    check_batch_norm(x, make((4,)), None, None, training=False, activation="silu", running=running)


def test_bf16_on_the_reference_path(monkeypatch):
    """The interpreter has no bf16, so bf16 runs the reference path here (Triton bf16 is a GPU test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = make((2, 4, 5, 3), "nhwc", dtype=torch.bfloat16)
    w, b = make((4,)), make((4,))
    y = batch_norm_act(x, None, None, w, b, True, activation="relu")
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    x6, w6, b6 = leaves64(x, w, b)
    e = F.relu(F.batch_norm(x6, None, None, w6, b6, True))
    assert_close(y, e, "norm", torch.bfloat16)
    probe = probe_for(x)
    for name, g, e_g in zip("xwb", grads_of(y, [x, w, b], probe), grads_of(e, [x6, w6, b6], probe.double())):
        assert_close(g, e_g, "norm", torch.bfloat16, scale=30**0.5 if name in "wb" else 1.0, msg=f"d{name}")


def test_gradcheck_backward_formulas_float64_reference_path(monkeypatch):
    """Hand-written backward reference vs numerical derivatives (float64 needs the reference path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(
        "lcv_kernels._common.SUPPORTED_DTYPES", (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    )
    kw = {"dtype": torch.float64, "requires_grad": True}
    x, r = torch.randn(2, 4, 3, 2, **kw), torch.randn(2, 4, 3, 2, **kw)
    w, b = torch.randn(4, **kw), torch.randn(4, **kw)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    assert torch.autograd.gradcheck(
        lambda *t: batch_norm_act(t[0], None, None, t[1], t[2], True, activation="silu", residual=t[3]),
        (x, w, b, r),
    )
    assert torch.autograd.gradcheck(
        lambda *t: batch_norm_act(t[0], rm, rv, t[1], t[2], False, activation="gelu", residual=t[3]),
        (x, w, b, r),
    )


# ---------------------------------------------------------------------------------------------------------
# Bad inputs


def _bn(x, **kw):
    c = x.shape[1] if x.dim() > 1 else 1
    args = {"running_mean": torch.zeros(c), "running_var": torch.ones(c), "training": True, **kw}
    return batch_norm_act(x, args.pop("running_mean"), args.pop("running_var"), **args)


BAD_INPUTS = {
    "3d": (lambda: _bn(torch.randn(2, 3, 4)), ValueError, "4-D"),
    "strided": (lambda: _bn(torch.randn(2, 3, 4, 6)[..., ::2]), ValueError, "dense in NCHW or channels_last"),
    "float64": (lambda: _bn(torch.randn(2, 3, 4, 4).double()), TypeError, "supported dtypes"),
    "weight_len": (
        lambda: _bn(torch.randn(2, 3, 4, 4), weight=torch.ones(4)),
        ValueError,
        "weight must be a 1-D tensor of 3",
    ),
    "running_var_int": (
        lambda: _bn(torch.randn(2, 3, 4, 4), running_var=torch.ones(3, dtype=torch.int64)),
        TypeError,
        "running_var must be a floating-point",
    ),
    "residual_shape": (
        lambda: _bn(torch.randn(2, 3, 4, 4), residual=torch.randn(2, 3, 4, 5)),
        ValueError,
        "residual must have",
    ),
    "residual_dtype": (
        lambda: _bn(torch.randn(2, 3, 4, 4), residual=torch.randn(2, 3, 4, 4).half()),
        TypeError,
        "residual dtype",
    ),
    "activation": (
        lambda: _bn(torch.randn(2, 3, 4, 4), activation="tanh"),
        ValueError,
        "unknown activation 'tanh'",
    ),
    "one_value": (lambda: _bn(torch.randn(1, 3, 1, 1)), ValueError, "more than 1 value per channel"),
    "eval_without_stats": (
        lambda: _bn(torch.randn(2, 3, 4, 4), running_mean=None, running_var=None, training=False),
        ValueError,
        "required when not using batch statistics",
    ),
    "batch_mean_alone": (
        lambda: _bn(torch.randn(2, 3, 4, 4), batch_mean=torch.zeros(3)),
        ValueError,
        "both batch_mean and batch_var",
    ),
    "batch_stats_in_eval": (
        lambda: _bn(
            torch.randn(2, 3, 4, 4), training=False, batch_mean=torch.zeros(3), batch_var=torch.ones(3)
        ),
        ValueError,
        "need use_batch_stats=True",
    ),
    "batch_var_len": (
        lambda: _bn(torch.randn(2, 3, 4, 4), batch_mean=torch.zeros(3), batch_var=torch.ones(2)),
        ValueError,
        "batch_var must be a 1-D tensor of 3",
    ),
    "empty": (lambda: _bn(torch.randn(0, 3, 4, 4)), ValueError, "empty"),
    "module_3d": (lambda: FusedBatchNormAct(3)(torch.randn(2, 3, 4)), ValueError, "expected 4D input"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(name):
    call, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------------------
# Property test (hypothesis): random small cases under the interpreter vs float64 eager and the references

PROPERTY_SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def bn_cases(draw):
    training = draw(st.booleans())
    n = draw(st.integers(1, 2))
    h, w = draw(st.sampled_from([(1, 1), (1, 6), (5, 1), (3, 4), (13, 11)]))
    if training and n * h * w < 2:  # batch statistics need two values per channel
        n = 2
    stats_kinds = [None, "contiguous", "strided"] if training else ["contiguous", "strided", "expanded"]
    return {
        "shape": (n, draw(st.sampled_from([1, 3, 5, 24, 40])), h, w),
        "layout": draw(st.sampled_from(["nchw", "nhwc"])),
        "probe_layout": draw(st.sampled_from([None, "nchw", "nhwc"])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float16])),
        "vector_dtype": draw(st.sampled_from(["fp32", "x"])),
        "activation": draw(st.sampled_from(ACTIVATIONS)),
        "residual": draw(st.booleans()),
        "training": training,
        "weight": draw(st.sampled_from([None, "contiguous", "strided", "expanded"])),
        "bias": draw(st.sampled_from([None, "contiguous", "strided", "expanded"])),
        "running": draw(st.sampled_from(stats_kinds)),
        "offset": draw(st.sampled_from([0.0, -3.0, 50.0])),
        "spread": draw(st.sampled_from([0.5, 1.0, 3.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


@requires_triton_path
@MASKED_LANE_OVERFLOW
@PROPERTY_SETTINGS
@given(case=bn_cases())
def test_property_matches_float64_eager_and_the_references(case):
    note_case(case)
    g = torch.Generator().manual_seed(case["seed"])
    n, c, h, w = case["shape"]
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
    kind = case["running"]
    running = None if kind is None else (vector(kind), vector(kind, positive=True))
    with pytest.MonkeyPatch.context() as mp:
        calls = count_calls(mp, BN, *LAUNCHERS)
        check_batch_norm(
            x,
            weight,
            bias,
            residual,
            training=case["training"],
            activation=case["activation"],
            running=running,
            grad_family="norm_grad",
            probe_layout=case["probe_layout"],
        )
    assert calls.count(FWD) == 1 and calls.count(BWD) == 1, calls


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
bn = importlib.import_module("lcv_kernels.batch_norm_act")
shared = importlib.import_module("lcv_kernels._triton")

IO = ("x_ptr", "y_ptr", "g_ptr", "res_ptr", "dx_ptr", "dres_ptr")
FLOATS = ("inv_count", "inv_c", "eps")

def build(kernel, warps=4, int64=True, **consts):
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
    if int64:
        # "offsets are int64": every pointer-tensor offset into an activation-sized tensor is i64 in the IR.
        widths = pointer_offset_widths(compiled.asm["ttir"])
        assert widths and set(widths) == {"i64"}, f"{kernel.__name__}: pointer offsets {widths}"

act = dict(HAS_BIAS=True, HAS_RESIDUAL=True, ACTIVATION=2)
build(bn._bn_partial_stats_kernel, BLOCK_M=64, BLOCK_C=64)
# the merge reads the small [parts, C] summaries only: i32 offsets are fine there
build(shared._merge_channel_stats_kernel, int64=False, BLOCK_P=64, BLOCK_C=64)
build(bn._bn_apply_kernel, HAS_WEIGHT=True, BLOCK_M=64, BLOCK_C=64, **act)
build(bn._bn_bwd_reduce_kernel, BLOCK_M=64, BLOCK_C=64, **act)
build(bn._bn_bwd_finalize_kernel, USE_BATCH=True, BLOCK_C=128)
build(bn._bn_bwd_apply_kernel, USE_BATCH=True, WRITE_DX=True, WRITE_DRES=True, BLOCK_M=64, BLOCK_C=64, **act)
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
    residual = make((8, 64, 28, 28), "nhwc", dtype=dtype)
    check_batch_norm(x, w, b, residual, training=True, activation="relu")
    assert launches.count(FWD) == 1 and launches.count(BWD) == 1


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_gpu_bf16_strided_vectors_eval(kind, launches):
    c = 48
    w = as_leaf(vector_variants(torch.rand(c, device="cuda") + 0.5)[kind])
    b = as_leaf(vector_variants(torch.randn(c, device="cuda"))[kind])
    running = (
        vector_variants(torch.randn(c, device="cuda"))[kind],
        vector_variants(torch.rand(c, device="cuda") + 0.5)[kind],
    )
    x = make((4, c, 9, 7), "nhwc", dtype=torch.bfloat16)
    check_batch_norm(x, w, b, None, training=False, activation="gelu", running=running)
    assert launches.count(FWD) == 1 and launches.count(BWD) == 1
