"""``lcv::layer_norm2d_act`` (``kernels/lcv_kernels/layer_norm2d_act.py``): op, backward op, functional, module forward,
module.

LayerNorm over the channels of an NCHW tensor (ConvNeXt's ``LayerNorm2d``). On CPU the Triton kernels run in
the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py), so shapes stay tiny and odd; tests that
claim to test Triton count the launcher calls. Two oracles everywhere: the op references
(``kernels/lcv_kernels/layer_norm2d_act_reference.py``) and ``F.layer_norm`` over the permuted tensor, autograd in
float64.
"""

from __future__ import annotations

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
from lcv_kernels.layer_norm2d_act import (
    MAX_LAYERNORM_CHANNELS,
    FusedLayerNorm2dAct,
    layer_norm2d_act,
    layer_norm2d_act_forward,
)
from lcv_kernels.layer_norm2d_act_reference import (
    layer_norm2d_act_backward_reference,
    layer_norm2d_act_forward_reference,
)
from offline_compile import run_offline_compile

# ``lcv_kernels.layer_norm2d_act`` is the function re-exported by ``lcv_kernels/__init__.py``; the module is this one.
LN = importlib.import_module("lcv_kernels.layer_norm2d_act")
# Masked lanes load x = 0, which a mean of 1000 normalises to about -1000: numpy warns that exp() overflows
# there (the lane is never stored; on a GPU exp gives inf and the activation 0, as for real inputs that
# negative).
MASKED_LANE_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
LAUNCHERS = ("layer_norm2d_act_forward_triton", "layer_norm2d_act_backward_triton")
FWD, BWD = LAUNCHERS
ops = torch.ops.lcv


@pytest.fixture
def launches(monkeypatch):
    """The Triton launchers called so far (each still runs)."""
    return count_calls(monkeypatch, LN, *LAUNCHERS)


def _d(t):
    return None if t is None else t.detach()


def eager_layer_norm2d(x, weight, bias, eps):
    """LayerNorm over the channels as ConvNeXt's LayerNorm2d computes it: permute, ``F.layer_norm``,
    permute."""
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), weight, bias, eps).permute(0, 3, 1, 2)


def check_layer_norm2d(
    x, weight, bias, residual, *, activation, eps=1e-6, grad_family="norm", probe_layout=None
):
    """``layer_norm2d_act`` vs float64 eager (permuted ``F.layer_norm`` → + residual → activation) and vs the
    op
    references: output (dtype, canonical strides of x's layout) and every gradient. Leaves that are not None
    must require grad."""
    dtype, c = x.dtype, x.shape[1]
    y = layer_norm2d_act(x, weight, bias, eps, activation=activation, residual=residual)
    assert y.dtype == dtype
    assert y.stride() == canonical_strides(x.shape, dense_layout(x)), (y.stride(), x.stride())

    x6, w6, b6, r6 = leaves64(x, weight, bias, residual)
    e = eager_layer_norm2d(x6, w6, b6, eps)
    e = EAGER_ACTIVATIONS[activation](e if r6 is None else e + r6)
    ref_y, mean, rstd = layer_norm2d_act_forward_reference(
        _d(x), _d(weight), _d(bias), _d(residual), eps, activation
    )
    assert_close(y, e, "norm", dtype, msg="y vs float64 eager")
    assert_close(y, ref_y, "norm", dtype, msg="y vs op reference")

    probe = probe_for(x, probe_layout)
    inputs = [x, weight, bias, residual]
    grads = grads_of(y, inputs, probe)
    grads64 = grads_of(e, [x6, w6, b6, r6], probe.double())
    ref_grads = layer_norm2d_act_backward_reference(
        probe,
        _d(x),
        _d(weight),
        _d(bias),
        _d(residual),
        mean,
        rstd,
        activation,
        [t is not None for t in inputs],
    )
    assert_grads_close(grads, grads64, ref_grads, dtype=dtype, count=x.numel() // c, grad_family=grad_family)


# ---------------------------------------------------------------------------------------------------------
# Forward and backward vs the references and float64 eager

# one channel (N=1); 70 channels (a 128-wide tile, 1x2 pixels); 13x11 pixels over several row chunks
SHAPES = [(2, 5, 3, 7), (1, 1, 4, 3), (3, 70, 1, 2), (2, 3, 13, 11)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_backward_vs_reference_and_torch(shape, activation, launches):
    layout = "nhwc" if SHAPES.index(shape) % 2 else "nchw"
    c = shape[1]
    x = make(shape, layout, offset=-1.5, scale=2.0)
    r = make(shape, layout) if activation in ("relu", "gelu") else None
    check_layer_norm2d(x, make((c,)), make((c,)), r, activation=activation)
    if TRITON_PATH:
        assert launches == [FWD, BWD]


def test_without_affine_parameters():
    check_layer_norm2d(make((2, 4, 3, 5)), None, None, None, activation="relu")


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
    check_layer_norm2d(x, weight, bias, make((2, c, 4, 3), layout), activation="silu")
    assert launches == [FWD, BWD]


# ---------------------------------------------------------------------------------------------------------
# Issue: fake vs real strides (NCHW, channels_last, N=1, H=W=1, C=1; size-1 dims re-strided); opcheck


def _op_args(case, requires_grad=False):
    shape, layout = STRIDE_CASES[case]
    c = shape[1]
    x = make(shape, layout, requires_grad=requires_grad)
    w, b = make((c,), requires_grad=requires_grad), make((c,), requires_grad=requires_grad)
    return x, w, b, make(shape, layout, requires_grad=requires_grad)


@pytest.mark.parametrize("case", STRIDE_CASES)
def test_fake_strides_match_real_forward_and_backward(case, launches):
    x, w, b, r = _op_args(case)
    check_fake_vs_real(ops.layer_norm2d_act.default, (x, w, b, r, 1e-6, "silu"))
    _, mean, rstd = ops.layer_norm2d_act.default(x, w, b, r, 1e-6, "silu")
    g = probe_for(x)
    check_fake_vs_real(ops.layer_norm2d_act_backward.default, (g, x, w, b, r, mean, rstd, "silu", [True] * 4))
    args = (g, x, None, b, None, mean, rstd, "gelu", [False, False, True, False])
    check_fake_vs_real(ops.layer_norm2d_act_backward.default, args)
    if TRITON_PATH:
        assert FWD in launches and BWD in launches


@pytest.mark.parametrize("case", ["nchw", "nhwc", "n1_nhwc", "hw1_nhwc", "c1_nchw"])
def test_opcheck_over_layouts(case):
    x, w, b, r = _op_args(case, requires_grad=True)
    torch.library.opcheck(
        ops.layer_norm2d_act.default, (x, w, b, r if case != "nhwc" else None, 1e-6, "silu")
    )
    _, mean, rstd = ops.layer_norm2d_act.default(x, w, b, r, 1e-6, "silu")
    d = lambda t: t.detach()  # noqa: E731
    mask = [True] * 4 if case != "nhwc" else [False, True, True, True]
    args = (probe_for(x), d(x), d(w), d(b), d(r), mean, rstd, "gelu", mask)
    torch.library.opcheck(ops.layer_norm2d_act_backward.default, args)


# ---------------------------------------------------------------------------------------------------------
# The module


def test_from_module_shares_state_and_keeps_state_dict_keys():
    import torchvision

    ln = torchvision.models.convnext.LayerNorm2d(6, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        for p in ln.parameters():
            p.uniform_(-1, 1)
    fused = FusedLayerNorm2dAct.from_module(ln, nn.GELU())
    assert fused.weight is ln.weight and fused.bias is ln.bias
    assert list(fused.state_dict()) == list(ln.state_dict())
    assert "activation=gelu" in repr(fused)
    x, residual = (
        make((2, 6, 4, 5), "nhwc", requires_grad=False),
        make((2, 6, 4, 5), "nhwc", requires_grad=False),
    )
    assert_close(fused(x), F.gelu(ln(x)), "norm")
    assert_close(fused(x, residual), F.gelu(ln(x) + residual), "norm")
    plain = nn.LayerNorm(6, eps=1e-6).to(DEVICE)  # a plain LayerNorm applied over the channels
    e = F.silu(eager_layer_norm2d(x, plain.weight, plain.bias, 1e-6) + residual)
    assert_close(layer_norm2d_act_forward(plain, x, "silu", residual), e, "norm")


def test_module_forward_keeps_eager_type_promotion_for_a_residual_of_another_dtype():
    """The op needs residual.dtype == x.dtype; the module forward then adds the residual after, as eager
    does."""
    ln = nn.LayerNorm(4).to(DEVICE)
    fused = FusedLayerNorm2dAct.from_module(ln, nn.ReLU())
    x = make((2, 4, 3, 5), requires_grad=False)
    residual = make((2, 4, 3, 5), requires_grad=False).half()
    y, e = fused(x, residual), F.relu(eager_layer_norm2d(x, ln.weight, ln.bias, ln.eps) + residual)
    assert y.dtype == e.dtype == torch.float32
    assert_close(y, e, "norm")
    # modules take any strides, like their torch counterparts
    x_strided = make((2, 4, 3, 10), requires_grad=False)[..., ::2]
    assert_close(fused(x_strided), F.relu(eager_layer_norm2d(x_strided, ln.weight, ln.bias, ln.eps)), "norm")


@pytest.mark.parametrize(
    ("module", "act", "error", "match"),
    [
        (nn.LayerNorm((4, 3)), None, ValueError, "one \\(channel\\) dimension"),
        (nn.BatchNorm2d(4), None, TypeError, "expects an nn.LayerNorm"),
        (nn.LayerNorm(4), nn.GELU(approximate="tanh"), ValueError, "cannot be fused"),
    ],
)
def test_from_module_rejects_what_it_cannot_fuse(module, act, error, match):
    with pytest.raises(error, match=match):
        FusedLayerNorm2dAct.from_module(module, act)


# ---------------------------------------------------------------------------------------------------------
# torch.compile, dispatch, dtypes


def test_functional_and_module_in_torch_compile_fullgraph_forward_and_backward(launches):
    x, w, b, r = make((2, 6, 3, 5), "nhwc"), make((6,)), make((6,)), make((2, 6, 3, 5), "nhwc")

    def block(x, w, b, r):
        return layer_norm2d_act(x, w, b, activation="gelu", residual=r).square().sum()

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
    ln = nn.LayerNorm(6).to(DEVICE)
    module = torch.compile(
        FusedLayerNorm2dAct.from_module(ln, nn.SiLU()), backend="aot_eager", fullgraph=True
    )
    assert_close(
        module(x.detach()), F.silu(eager_layer_norm2d(x.detach(), ln.weight, ln.bias, ln.eps)), "norm"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch test")
def test_cpu_without_interpreter_runs_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def boom(*args, **kwargs):
        raise AssertionError("a Triton launcher ran on CPU without TRITON_INTERPRET=1")

    for name in LAUNCHERS:
        monkeypatch.setattr(LN, name, boom)
    x = make((2, 4, 3, 3))
    assert not use_triton(x)
    check_layer_norm2d(x, make((4,)), make((4,)), make((2, 4, 3, 3)), activation="gelu")


def test_bf16_on_the_reference_path_and_autocast_dtypes(monkeypatch):
    """The interpreter has no bf16, so bf16 runs the reference path here (Triton bf16 is a GPU test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = make((2, 4, 5, 3), "nhwc", dtype=torch.bfloat16)
    w, b = make((4,)), make((4,))
    y = layer_norm2d_act(x, w, b, activation="silu")
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    x6, w6, b6 = leaves64(x, w, b)
    e = F.silu(eager_layer_norm2d(x6, w6, b6, 1e-5))
    assert_close(y, e, "norm", torch.bfloat16)
    probe = probe_for(x)
    for name, g, e_g in zip("xwb", grads_of(y, [x, w, b], probe), grads_of(e, [x6, w6, b6], probe.double())):
        assert_close(g, e_g, "norm", torch.bfloat16, scale=30**0.5 if name in "wb" else 1.0, msg=f"d{name}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the output dtype under autocast is eager's (CUDA autocast: fp32 for layer norm; CPU: the input's)
        xd, wd, bd = x.detach(), w.detach(), b.detach()
        e = eager_layer_norm2d(xd, wd, bd, 1e-5)
        y = layer_norm2d_act(xd, wd, bd)
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
        lambda *t: layer_norm2d_act(t[0], t[1], t[2], activation="silu", residual=t[3]), (x, w, b, r)
    )


# ---------------------------------------------------------------------------------------------------------
# Bad inputs

BAD_INPUTS = {
    "3d": (lambda: layer_norm2d_act(torch.randn(2, 4, 3)), ValueError, "4-D"),
    "strided": (lambda: layer_norm2d_act(torch.randn(2, 4, 4, 6)[..., ::2]), ValueError, "dense in NCHW"),
    "float64": (lambda: layer_norm2d_act(torch.randn(2, 4, 3, 3).double()), TypeError, "supported dtypes"),
    "empty": (lambda: layer_norm2d_act(torch.randn(0, 6, 3, 3)), ValueError, "empty"),
    "weight_len": (
        lambda: layer_norm2d_act(torch.randn(2, 6, 3, 3), weight=torch.ones(4)),
        ValueError,
        "weight must be a 1-D tensor of 6",
    ),
    "bias_int": (
        lambda: layer_norm2d_act(torch.randn(2, 6, 3, 3), bias=torch.ones(6, dtype=torch.int64)),
        TypeError,
        "floating-point",
    ),
    "residual_shape": (
        lambda: layer_norm2d_act(torch.randn(2, 4, 3, 3), residual=torch.randn(2, 4, 3, 2)),
        ValueError,
        "residual must have",
    ),
    "residual_dtype": (
        lambda: layer_norm2d_act(torch.randn(2, 4, 3, 3), residual=torch.randn(2, 4, 3, 3).half()),
        TypeError,
        "residual dtype",
    ),
    "activation": (
        lambda: layer_norm2d_act(torch.randn(2, 4, 3, 3), activation="tanh"),
        ValueError,
        "unknown activation 'tanh'",
    ),
    "module_3d": (lambda: FusedLayerNorm2dAct(4)(torch.randn(2, 4, 3)), ValueError, "4-D"),
    "normalized_shape": (
        lambda: layer_norm2d_act_forward(nn.LayerNorm(5), torch.randn(2, 4, 3, 3)),
        ValueError,
        "normalized_shape",
    ),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(name):
    call, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        call()


@requires_triton_path
def test_kernel_rejects_too_many_channels():
    x = torch.randn(1, MAX_LAYERNORM_CHANNELS + 1, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {MAX_LAYERNORM_CHANNELS}"):
        layer_norm2d_act(x)


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
def ln_cases(draw):
    n = draw(st.integers(1, 2))
    h, w = draw(st.sampled_from([(1, 1), (1, 6), (5, 1), (3, 4), (13, 11)]))
    return {
        "shape": (n, draw(st.sampled_from([1, 3, 5, 24, 40])), h, w),
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
@given(case=ln_cases())
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
        calls = count_calls(mp, LN, *LAUNCHERS)
        check_layer_norm2d(
            x,
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
ln = importlib.import_module("lcv_kernels.layer_norm2d_act")

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
build(ln._ln2d_fwd_kernel, 8, BLOCK_M=4, BLOCK_C=1024, **act)
build(ln._ln2d_bwd_kernel, 8, BLOCK_M=4, BLOCK_C=1024, WRITE_DX=True, WRITE_DRES=True, **act)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never compiles; catch GPU-only compile errors by compiling offline for Hopper."""
    run_offline_compile(_SM90_COMPILE_SCRIPT)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_types_convnext_like_shapes(dtype, launches):
    x = make((8, 96, 28, 28), "nhwc", dtype=dtype)
    w, b = as_leaf(torch.rand(96, device="cuda") + 0.5), as_leaf(torch.randn(96, device="cuda"))
    check_layer_norm2d(x, w, b, make((8, 96, 28, 28), "nhwc", dtype=dtype), activation="gelu")
    assert launches == [FWD, BWD]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_gpu_bf16_strided_vectors(kind, launches):
    c = 48
    w = as_leaf(vector_variants(torch.rand(c, device="cuda") + 0.5)[kind])
    b = as_leaf(vector_variants(torch.randn(c, device="cuda"))[kind])
    check_layer_norm2d(make((4, c, 9, 7), "nchw", dtype=torch.bfloat16), w, b, None, activation="silu")
    assert launches == [FWD, BWD]
