"""Fused Triton conv (``lcv::conv2d_fused``) and ``FusedConvBNAct`` against eager PyTorch.

On CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py), so
shapes stay tiny. The independent reference everywhere is ``F.conv2d`` / ``nn.BatchNorm2d`` in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import conv_ops
from offline_compile import run_offline_compile

from kernels._common import interpreter_enabled
from kernels.conv_ops import conv2d_fused
from kernels.conv_reference import conv2d_fused_reference
from kernels.fused_conv import FusedConvBNAct
from kernels.tolerances import tolerance

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_PATH = torch.cuda.is_available() or interpreter_enabled()
EAGER_ACT = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def eager_fused64(
    x, w, bias=None, stride=1, padding=0, dilation=1, scale=None, shift=None, residual=None, activation="none"
):
    """The epilogue written out with F.conv2d in float64: the independent oracle."""
    z = F.conv2d(x.double(), w.double(), None if bias is None else bias.double(), stride, padding, dilation)
    u = z
    if scale is not None:
        u = u * scale.double().view(1, -1, 1, 1)
    if shift is not None:
        u = u + shift.double().view(1, -1, 1, 1)
    if residual is not None:
        u = u + residual.double()
    return EAGER_ACT[activation](u), z.sum((0, 2, 3)), (z * z).sum((0, 2, 3))


def assert_close(actual, expected, dtype=torch.float32):
    atol, rtol = tolerance("conv", dtype)
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def assert_sums_close(actual, expected, count, dtype=torch.float32):
    """Sums over ``count`` elements: the per-element tolerance scaled by the count."""
    atol, rtol = tolerance("conv", dtype)
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * count, rtol=rtol)


# (N, C, H, W, K, kernel, stride, padding, dilation): odd sizes, C=3, 1x1/3x3/7x7, stride 2, pad 0/1.
SHAPES = [
    (2, 3, 5, 7, 4, 3, 2, 1, 1),
    (1, 3, 7, 5, 5, 3, 1, 0, 1),
    (2, 8, 5, 7, 6, 1, 1, 0, 1),
    (1, 5, 7, 7, 3, 1, 2, 0, 1),
    (1, 3, 9, 9, 4, 7, 2, 3, 1),
    (1, 4, 9, 7, 3, 3, 1, 2, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}C{}H{}W{}K{}k{}s{}p{}d{}".format(*s))
def test_forward_matches_conv2d_bn_act(shape):
    n, c, h, w, k, r, stride, pad, dil = shape
    x = nhwc(torch.randn(n, c, h, w, device=DEVICE))
    weight = torch.randn(k, c, r, r, device=DEVICE)
    bias, scale, shift = (torch.randn(k, device=DEVICE) for _ in range(3))
    y, sums, sumsq = conv2d_fused(
        x,
        weight,
        bias,
        stride=stride,
        padding=pad,
        dilation=dil,
        scale=scale,
        shift=shift,
        activation="relu",
        stats=True,
    )
    expected, e_sum, e_sumsq = eager_fused64(
        x, weight, bias, stride, pad, dil, scale, shift, activation="relu"
    )
    assert y.shape == expected.shape and y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, expected)
    count = expected.numel() // k
    assert_sums_close(sums, e_sum, count)
    assert_sums_close(sumsq, e_sumsq, count)
    ref_y, ref_sum, _ = conv2d_fused_reference(
        x,
        weight,
        bias,
        stride=stride,
        padding=pad,
        dilation=dil,
        scale=scale,
        shift=shift,
        activation="relu",
        stats=True,
    )
    assert_close(y, ref_y)
    assert_sums_close(sums, ref_sum, count)


EPILOGUES = {
    "plain": {},
    "bias": {"bias": True},
    "scale_shift": {"scale": True, "shift": True},
    "relu": {"activation": "relu"},
    "gelu": {"activation": "gelu", "bias": True},
    "silu": {"activation": "silu", "bias": True},
    "residual": {"residual": True, "activation": "relu"},
    "stats": {"stats": True, "bias": True},
    "everything": {
        "bias": True,
        "scale": True,
        "shift": True,
        "residual": True,
        "activation": "silu",
        "stats": True,
    },
}


def _epilogue_inputs(flags, k, out_shape):
    return {
        "bias": torch.randn(k, device=DEVICE) if flags.get("bias") else None,
        "scale": torch.randn(k, device=DEVICE) if flags.get("scale") else None,
        "shift": torch.randn(k, device=DEVICE) if flags.get("shift") else None,
        "residual": nhwc(torch.randn(out_shape, device=DEVICE)) if flags.get("residual") else None,
    }


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_each_epilogue_flag_forward_and_backward(name):
    flags = EPILOGUES[name]
    activation, stats = flags.get("activation", "none"), flags.get("stats", False)
    x = nhwc(torch.randn(2, 3, 7, 5, device=DEVICE)).requires_grad_()
    weight = torch.randn(4, 3, 3, 3, device=DEVICE, requires_grad=True)
    ops = {
        key: (None if t is None else t.requires_grad_())
        for key, t in _epilogue_inputs(flags, 4, (2, 4, 4, 3)).items()
    }
    out = conv2d_fused(x, weight, stride=2, padding=1, activation=activation, stats=stats, **ops)
    y, sums, sumsq = out if stats else (out, None, None)
    expected, e_sum, e_sumsq = eager_fused64(
        x, weight, ops["bias"], 2, 1, 1, ops["scale"], ops["shift"], ops["residual"], activation
    )
    assert_close(y, expected)
    leaves = [x, weight] + [t for t in ops.values() if t is not None]
    # A loss that weighs every output, including the statistics, so their gradients are exercised too.
    probe = torch.randn_like(expected)
    loss, e_loss = (y * probe).sum(), (expected * probe).sum()
    if stats:
        assert_sums_close(sums, e_sum, 24)
        assert_sums_close(sumsq, e_sumsq, 24)
        loss = loss + 0.3 * sums.sum() - 0.05 * sumsq.sum()
        e_loss = e_loss + 0.3 * e_sum.sum() - 0.05 * e_sumsq.sum()
    grads = torch.autograd.grad(loss, leaves)
    e_grads = torch.autograd.grad(e_loss, leaves)
    for g, e in zip(grads, e_grads):
        assert_close(g, e)


def test_gradcheck_fused_epilogue_float64_reference_path(monkeypatch):
    """The hand-written backward, with numerical derivatives, on the reference path (float64 needs no Triton)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = nhwc(torch.randn(1, 2, 5, 4, dtype=torch.float64)).requires_grad_()
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    b, sc, sh = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    res = nhwc(torch.randn(1, 3, 3, 2, dtype=torch.float64)).requires_grad_()

    def fn(x, w, b, sc, sh, res):
        return conv2d_fused(
            x, w, b, stride=1, padding=0, scale=sc, shift=sh, residual=res, activation="silu", stats=True
        )

    # float64 is not a kernel dtype, so go through the op with the checks relaxed for this one call.
    monkeypatch.setattr(
        "kernels._common.SUPPORTED_DTYPES", (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    )
    assert torch.autograd.gradcheck(fn, (x, w, b, sc, sh, res))


@pytest.mark.skipif(not TRITON_PATH, reason="needs the Triton path (CUDA or TRITON_INTERPRET=1)")
def test_fp16_forward_uses_fp32_accumulation():
    x = nhwc(torch.randn(1, 8, 6, 5, device=DEVICE)).half()
    weight = torch.randn(5, 8, 3, 3, device=DEVICE).half()
    y = conv2d_fused(x, weight, padding=1, activation="gelu")
    assert y.dtype == torch.float16
    expected, _, _ = eager_fused64(x, weight, padding=1, activation="gelu")
    assert_close(y, expected, torch.float16)


def test_bf16_on_reference_path(monkeypatch):
    """The interpreter has no bf16, so bf16 runs the reference path here (Triton bf16 is a GPU test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = nhwc(torch.randn(2, 3, 6, 5)).bfloat16()
    weight = torch.randn(4, 3, 3, 3).bfloat16()
    y, sums, _ = conv2d_fused(x, weight, padding=1, activation="relu", stats=True)
    expected, e_sum, _ = eager_fused64(x, weight, padding=1, activation="relu")
    assert y.dtype == torch.bfloat16
    assert_close(y, expected, torch.bfloat16)
    assert_sums_close(sums, e_sum, 60, torch.bfloat16)


def test_cpu_without_interpreter_runs_the_reference_not_triton(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU dispatch test")
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def boom(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run on CPU without TRITON_INTERPRET=1")

    monkeypatch.setattr("kernels.conv.conv2d_fused_triton", boom)
    x = nhwc(torch.randn(1, 3, 5, 5))
    weight = torch.randn(2, 3, 3, 3)
    assert_close(conv2d_fused(x, weight), F.conv2d(x, weight))


@pytest.mark.skipif(torch.cuda.is_available() or not interpreter_enabled(), reason="interpreter-only check")
def test_interpreter_runs_triton_with_a_single_small_config(monkeypatch):
    import kernels.conv as conv_mod

    assert len(conv_mod._conv2d_nhwc_fwd_kernel.configs) == 1
    calls = []
    real = conv_mod.conv2d_fused_triton
    monkeypatch.setattr(conv_mod, "conv2d_fused_triton", lambda *a: calls.append(1) or real(*a))
    conv2d_fused(nhwc(torch.randn(1, 3, 4, 4)), torch.randn(2, 3, 1, 1))
    assert calls == [1]


def test_grouped_conv_falls_back_to_pytorch():
    x = nhwc(torch.randn(1, 4, 5, 5, device=DEVICE))
    weight = torch.randn(4, 1, 3, 3, device=DEVICE)  # depthwise
    y = conv2d_fused(x, weight, padding=1, groups=4, activation="relu")
    assert_close(y, F.relu(F.conv2d(x.double(), weight.double(), padding=1, groups=4)))


def test_opcheck():
    x = nhwc(torch.randn(1, 3, 5, 4, device=DEVICE)).requires_grad_()
    weight = torch.randn(4, 3, 3, 3, device=DEVICE, requires_grad=True)
    bias, scale, shift = (torch.randn(4, device=DEVICE, requires_grad=True) for _ in range(3))
    residual = nhwc(torch.randn(1, 4, 3, 2, device=DEVICE)).requires_grad_()
    for args in (
        (x, weight, bias, scale, shift, residual, [2, 2], [1, 1], [1, 1], "gelu", True),
        (x, weight, None, None, None, None, [1, 1], [0, 0], [1, 1], "none", False),
    ):
        torch.library.opcheck(torch.ops.lcv.conv2d_fused.default, args)


def test_inside_torch_compile_fullgraph_forward_and_backward():
    x = nhwc(torch.randn(2, 3, 5, 7, device=DEVICE)).requires_grad_()
    weight = torch.randn(4, 3, 3, 3, device=DEVICE, requires_grad=True)
    shift = torch.randn(4, device=DEVICE, requires_grad=True)

    def block(x, weight, shift):
        y, s, ss = conv2d_fused(x, weight, stride=2, padding=1, shift=shift, activation="relu", stats=True)
        return y.sum() + s.sum() * 0.1 + ss.sum() * 0.01

    compiled = torch.compile(block, fullgraph=True)
    loss = compiled(x, weight, shift)
    grads = torch.autograd.grad(loss, (x, weight, shift))
    e_loss = block(x, weight, shift)
    e_grads = torch.autograd.grad(e_loss, (x, weight, shift))
    assert_close(loss, e_loss)
    for g, e in zip(grads, e_grads):
        assert_close(g, e)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: (torch.randn(1, 3, 5, 5), torch.randn(2, 3, 3, 3), {}), ValueError, "channels_last"),
        (
            lambda: (nhwc(torch.randn(1, 3, 5, 5)), torch.randn(2, 4, 3, 3), {}),
            ValueError,
            "mismatched channels",
        ),
        (
            lambda: (nhwc(torch.randn(1, 3, 5, 5)).double(), torch.randn(2, 3, 3, 3).double(), {}),
            TypeError,
            "supported dtypes",
        ),
        (
            lambda: (nhwc(torch.randn(1, 3, 5, 5)).half(), torch.randn(2, 3, 3, 3), {}),
            TypeError,
            "does not match",
        ),
        (
            lambda: (nhwc(torch.randn(1, 3, 5, 5)), torch.randn(2, 3, 3, 3), {"activation": "tanh"}),
            ValueError,
            "unknown activation",
        ),
        (
            lambda: (nhwc(torch.randn(1, 3, 5, 5)), torch.randn(2, 3, 3, 3), {"bias": torch.randn(3)}),
            ValueError,
            "one entry per output channel",
        ),
        (
            lambda: (
                nhwc(torch.randn(1, 3, 5, 5)),
                torch.randn(2, 3, 3, 3),
                {"residual": torch.randn(1, 2, 5, 5)},
            ),
            ValueError,
            "residual must have the output's shape",
        ),
        (
            lambda: (nhwc(torch.randn(1, 3, 2, 2)), torch.randn(2, 3, 3, 3), {}),
            ValueError,
            "output would be empty",
        ),
        (lambda: (torch.randn(3, 5, 5), torch.randn(2, 3, 3, 3), {}), ValueError, "4-D"),
        (
            lambda: (nhwc(torch.randn(1, 3, 5, 5)), torch.randn(2, 3, 3, 3), {"padding": "same"}),
            ValueError,
            "string padding",
        ),
    ],
    ids=[
        "nchw",
        "channels",
        "float64",
        "weight_dtype",
        "activation",
        "bias_len",
        "residual_shape",
        "empty",
        "3d",
        "same",
    ],
)
def test_bad_inputs_raise_clear_errors(make, error, match):
    x, weight, kwargs = make()
    with pytest.raises(error, match=match):
        conv2d_fused(x, weight, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# FusedConvBNAct


def _eager_and_fused(activation, momentum=0.1, bias=False, affine=True, stride=1):
    conv = nn.Conv2d(3, 4, 3, stride=stride, padding=1, bias=bias)
    bn = nn.BatchNorm2d(4, momentum=momentum, affine=affine)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    act = {"none": nn.Identity(), "relu": nn.ReLU(), "gelu": nn.GELU(), "silu": nn.SiLU()}[activation]
    eager = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn), copy.deepcopy(act)).to(DEVICE)
    fused = FusedConvBNAct.from_modules(conv, bn, act).to(DEVICE)
    return eager, fused


def _assert_bn_state_equal(bn, ref):
    assert_close(bn.running_mean, ref.running_mean)
    assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked)


@pytest.mark.parametrize(
    ("activation", "momentum", "bias", "stride"),
    [("relu", 0.1, False, 1), ("silu", None, True, 2), ("gelu", 0.3, False, 1)],
)
def test_module_train_mode_matches_eager_and_updates_running_stats(activation, momentum, bias, stride):
    eager, fused = _eager_and_fused(activation, momentum, bias, stride=stride)
    for _ in range(2):
        x = nhwc(torch.randn(2, 3, 5, 7, device=DEVICE) * 2 + 1)
        y, e_y = fused(x), eager(x)
        assert_close(y, e_y)
        probe = torch.randn_like(e_y)
        (y * probe).sum().backward()
        (e_y * probe).sum().backward()
        _assert_bn_state_equal(fused.bn, eager[1])
    assert_close(fused.conv.weight.grad, eager[0].weight.grad)
    assert_close(fused.bn.weight.grad, eager[1].weight.grad)
    assert_close(fused.bn.bias.grad, eager[1].bias.grad)
    if bias:
        assert_close(fused.conv.bias.grad, eager[0].bias.grad)


def test_module_eval_mode_folds_bn_and_matches_eager_with_residual():
    eager, fused = _eager_and_fused("relu", bias=True)
    x = nhwc(torch.randn(2, 3, 5, 7, device=DEVICE))
    fused(x), eager(x)  # one training step so the running stats are not the initial 0/1
    fused.eval(), eager.eval()
    residual = nhwc(torch.randn(2, 4, 5, 7, device=DEVICE))
    y = fused(x, residual)
    e_y = eager[2](eager[1](eager[0](x)) + residual)
    assert_close(y, e_y)
    assert int(fused.bn.num_batches_tracked) == 1  # eval does not touch the running stats


def test_module_train_with_residual_and_no_affine():
    eager, fused = _eager_and_fused("relu", affine=False)
    x = nhwc(torch.randn(1, 3, 6, 5, device=DEVICE))
    residual = nhwc(torch.randn(1, 4, 6, 5, device=DEVICE))
    assert_close(fused(x, residual), eager[2](eager[1](eager[0](x)) + residual))
    _assert_bn_state_equal(fused.bn, eager[1])


def test_module_shares_parameters_and_keeps_state_dict_keys():
    conv, bn = nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)
    fused = FusedConvBNAct.from_modules(conv, bn, nn.ReLU())
    assert fused.conv is conv and fused.bn is bn
    assert fused.conv.weight.data_ptr() == conv.weight.data_ptr()
    assert set(fused.state_dict()) == {f"conv.{k}" for k in conv.state_dict()} | {
        f"bn.{k}" for k in bn.state_dict()
    }


def test_module_without_bn_and_nchw_input():
    conv = nn.Conv2d(3, 4, 1, bias=True).to(DEVICE)
    fused = FusedConvBNAct.from_modules(conv, None, nn.SiLU())
    x = torch.randn(1, 3, 4, 5, device=DEVICE)  # NCHW: the module converts it
    assert_close(fused(x), F.silu(conv(x)))


def test_module_inside_torch_compile_fullgraph_train_and_eval():
    eager, fused = _eager_and_fused("relu")
    compiled = torch.compile(fused, fullgraph=True)
    x = nhwc(torch.randn(2, 3, 5, 5, device=DEVICE))
    assert_close(compiled(x), eager(x))
    _assert_bn_state_equal(fused.bn, eager[1])
    fused.eval(), eager.eval()
    assert_close(compiled(x), eager(x))


@pytest.mark.parametrize(
    ("act", "match"), [(nn.Tanh(), "unsupported activation"), (nn.GELU(approximate="tanh"), "exact erf")]
)
def test_from_modules_rejects_unsupported_activations(act, match):
    with pytest.raises(ValueError, match=match):
        FusedConvBNAct.from_modules(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), act)


def test_from_modules_rejects_mismatched_bn():
    with pytest.raises(ValueError, match="bn has 5 features"):
        FusedConvBNAct.from_modules(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5), None)


# ---------------------------------------------------------------------------------------------------------
# GPU only


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_types_resnet_like_shape(dtype):
    x = nhwc(torch.randn(4, 64, 28, 28, device="cuda", dtype=dtype))
    weight = torch.randn(128, 64, 3, 3, device="cuda", dtype=dtype) * 0.05
    y, sums, _ = conv2d_fused(x, weight, stride=2, padding=1, activation="relu", stats=True)
    expected, e_sum, _ = eager_fused64(x, weight, stride=2, padding=1, activation="relu")
    assert_close(y, expected, dtype)
    assert_sums_close(sums, e_sum, expected.numel() // 128, dtype)


@requires_cuda
@pytest.mark.gpu
def test_gpu_uses_triton_kernel():
    assert conv_ops.use_triton(torch.empty(1, device="cuda"))


@pytest.mark.skipif(not TRITON_PATH, reason="needs the Triton path (CUDA or TRITON_INTERPRET=1)")
@pytest.mark.parametrize(("kernel", "padding", "dilation"), [(3, 1, 1), (1, 0, 1), (3, 2, 2), (3, 0, 1)])
def test_triton_input_gradient_matches_eager(monkeypatch, kernel, padding, dilation):
    monkeypatch.setenv(conv_ops.DGRAD_ENV, "triton")
    calls = []
    real = conv_ops.triton_conv2d_input_grad
    monkeypatch.setattr(conv_ops, "triton_conv2d_input_grad", lambda *a: calls.append(1) or real(*a))
    x = nhwc(torch.randn(2, 3, 5, 7, device=DEVICE)).requires_grad_()
    weight = torch.randn(4, 3, kernel, kernel, device=DEVICE, requires_grad=True)
    y = conv2d_fused(x, weight, padding=padding, dilation=dilation, activation="relu")
    expected, _, _ = eager_fused64(x, weight, padding=padding, dilation=dilation, activation="relu")
    probe = torch.randn_like(expected)
    grads = torch.autograd.grad((y * probe).sum(), (x, weight))
    e_grads = torch.autograd.grad((expected * probe).sum(), (x, weight))
    assert calls == [1]
    for g, e in zip(grads, e_grads):
        assert_close(g, e)


def test_dgrad_switch_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(conv_ops.DGRAD_ENV, "cudnn")
    with pytest.raises(ValueError, match="LCV_CONV_DGRAD"):
        conv_ops.dgrad_impl()


def test_gpu_config_pruning_keeps_blocks_near_the_problem_size():
    import triton

    import kernels.conv as conv_mod

    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=st, num_warps=nw)
        for bm, bn, bk, st, nw in conv_mod._GPU_CONFIGS
    ]
    kept = conv_mod._prune_configs(configs, {"C": 3, "K": 64})
    assert kept and all(c.kwargs["BLOCK_K"] <= 16 and c.kwargs["BLOCK_N"] <= 64 for c in kept)
    assert conv_mod._prune_configs(configs, {"C": 256, "K": 256}) == configs
    assert all(c.num_warps <= 4 for c in configs)  # the flattened-tap loop miscompiles with 8 warps


_SM90_COMPILE_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from offline_compile import pointer_offset_widths
import kernels.conv as conv_mod

fn = conv_mod._conv2d_nhwc_fwd_kernel.fn
bm, bn, bk, stages, warps = conv_mod._GPU_CONFIGS[0]
consts = dict(R=3, S=3, HAS_BIAS=True, HAS_SCALE=True, HAS_SHIFT=True, HAS_RESIDUAL=True, ACTIVATION=2,
              STATS=True, DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
sig = {}
for name in fn.arg_names:
    if name in consts:
        sig[name] = "constexpr"
    elif name in ("sum_ptr", "sumsq_ptr", "bias_ptr", "scale_ptr", "shift_ptr"):
        sig[name] = "*fp32"
    elif name.endswith("_ptr"):
        sig[name] = "*bf16"
    else:
        sig[name] = "i64" if name == "M" else "i32"
kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
assert "mma" in kernel.asm["ptx"], "expected tensor-core MMA instructions in the PTX"
# The module promises int64 offsets (tensors over 2**31 elements): every pointer-tensor offset in the
# Triton IR must be i64 (an i32 offset there would wrap past 2**31 elements).
widths = pointer_offset_widths(kernel.asm["ttir"])
assert len(widths) >= 8 and set(widths) == {"i64"}, f"pointer offsets: {widths}"
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernel itself")
def test_kernel_compiles_for_sm90_without_a_gpu():
    """Catch GPU-only compile errors (the interpreter never compiles) by compiling offline for Hopper."""
    run_offline_compile(_SM90_COMPILE_SCRIPT)


def test_autocast_casts_activation_and_weight_like_conv2d(monkeypatch):
    """bf16 autocast on the reference path (the interpreter has no bf16)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = nhwc(torch.randn(2, 3, 5, 6))
    weight = torch.randn(4, 3, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv2d_fused(x, weight, padding=1, activation="relu")
        expected = F.relu(F.conv2d(x, weight, padding=1))
    assert y.dtype == expected.dtype == torch.bfloat16
    assert_close(y, expected, torch.bfloat16)


@pytest.mark.skipif(not TRITON_PATH, reason="needs the Triton path (CUDA or TRITON_INTERPRET=1)")
def test_module_under_fp16_autocast_trains():
    eager, fused = _eager_and_fused("relu")
    x = nhwc(torch.randn(2, 3, 5, 5, device=DEVICE))
    with torch.autocast(DEVICE, dtype=torch.float16):
        y = fused(x)
        expected = eager(x)
    assert y.dtype == torch.float16
    assert_close(y, expected, torch.float16)
    y.float().sum().backward()
    assert fused.conv.weight.grad is not None and fused.conv.weight.grad.dtype == torch.float32


def test_why_not_fusable_reports_the_reason():
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    assert FusedConvBNAct.why_not_fusable(conv, bn, nn.ReLU()) is None
    assert "Tanh" in FusedConvBNAct.why_not_fusable(conv, bn, nn.Tanh())
    assert "padding_mode" in FusedConvBNAct.why_not_fusable(nn.Conv2d(3, 4, 3, padding_mode="reflect"), bn)


def test_relu_backward_needs_no_recompute(monkeypatch):
    """With a ReLU (or no) activation and no stats, backward derives relu' from y: no second conv."""
    x = nhwc(torch.randn(1, 3, 5, 5, device=DEVICE)).requires_grad_()
    weight = torch.randn(4, 3, 3, 3, device=DEVICE, requires_grad=True)
    shift = torch.randn(4, device=DEVICE, requires_grad=True)
    y = conv2d_fused(x, weight, padding=1, shift=shift, activation="relu")
    calls = []
    real = conv_ops._conv2d_fused_op
    monkeypatch.setattr(conv_ops, "_conv2d_fused_op", lambda *a: calls.append(1) or real(*a))
    grads = torch.autograd.grad(y.sum(), (x, weight, shift))
    assert calls == []
    expected, _, _ = eager_fused64(x, weight, padding=1, shift=shift, activation="relu")
    e_grads = torch.autograd.grad(expected.sum(), (x, weight, shift))
    for g, e in zip(grads, e_grads):
        assert_close(g, e)
