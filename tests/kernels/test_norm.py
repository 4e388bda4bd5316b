"""Fused normalization ops (``lcv::batch_norm_act``, ``group_norm_act``, ``layer_norm2d_act``) and modules.

On CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py), so
shapes stay tiny and odd. Two oracles everywhere: the op references (``kernels/norm_reference.py``) and
``torch.nn`` / ``torch.nn.functional`` autograd in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offline_compile import run_offline_compile

from kernels._common import interpreter_enabled, use_triton
from kernels.fused_norm import (
    FusedBatchNormAct,
    FusedGroupNormAct,
    FusedLayerNorm2dAct,
    conv_bn_act,
    why_conv_bn_not_fusable,
)
from kernels.norm_ops import batch_norm_act, group_norm_act, layer_norm2d_act
from kernels.norm_reference import (
    batch_norm_act_backward_reference,
    batch_norm_act_forward_reference,
    group_norm_act_backward_reference,
    group_norm_act_forward_reference,
    layer_norm2d_act_backward_reference,
    layer_norm2d_act_forward_reference,
)
from kernels.tolerances import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_PATH = torch.cuda.is_available() or interpreter_enabled()
ACT = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}
ACT_MODULE = {"none": nn.Identity, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}
LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}


def assert_close(actual, expected, dtype=torch.float32, scale=1.0, msg=""):
    atol, rtol = tolerance("norm", dtype)
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale, msg=lambda m: f"{msg}: {m}"
    )


def make(shape, layout="nchw", offset=0.0, scale=1.0, requires_grad=True):
    t = (torch.randn(shape, device=DEVICE) * scale + offset).contiguous(memory_format=LAYOUTS[layout])
    return t.requires_grad_(requires_grad)


def leaves64(*tensors):
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def grads_of(out, inputs, probe):
    present = [t for t in inputs if t is not None]
    got = torch.autograd.grad(out, present, probe)
    it = iter(got)
    return [None if t is None else next(it) for t in inputs]


@pytest.fixture(autouse=True)
def _triton_path_is_taken(monkeypatch):
    """Count kernel launches so each test can check it did not silently use the reference."""
    if not TRITON_PATH:
        return
    import kernels.norm as norm

    calls: list[str] = []
    for name in (
        "batch_norm_act_forward_triton",
        "group_norm_act_forward_triton",
        "layer_norm2d_act_forward_triton",
    ):
        real = getattr(norm, name)
        monkeypatch.setattr(norm, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    return calls


# ---------------------------------------------------------------------------------------------------------
# BatchNorm

# (N, C, H, W): odd sizes; C=70 spans two channel blocks; 2x3x17x17 = 578 rows spans two row chunks.
BN_SHAPES = [(2, 5, 7, 3), (3, 7, 1, 1), (2, 70, 3, 3), (2, 3, 17, 17)]


@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "silu"])
def test_batch_norm_train_forward_backward_vs_reference_and_torch(shape, activation, _triton_path_is_taken):
    index = BN_SHAPES.index(shape)
    layout = "nhwc" if index % 2 else "nchw"
    with_residual = activation in ("relu", "silu")
    c = shape[1]
    x = make(shape, layout, offset=3.0, scale=2.0)  # offset: the mean must not cancel the variance
    w, b = make((c,)), make((c,))
    r = make(shape, layout) if with_residual else None
    rm, rv = torch.randn(c, device=DEVICE), torch.rand(c, device=DEVICE) + 0.5
    rm_e, rv_e = rm.double().clone(), rv.double().clone()

    y = batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, activation=activation, residual=r)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=LAYOUTS[layout])
    if TRITON_PATH:
        assert _triton_path_is_taken == ["batch_norm_act_forward_triton"]

    x6, w6, b6, r6 = leaves64(x, w, b, r)
    e = F.batch_norm(x6, rm_e, rv_e, w6, b6, True, 0.1, 1e-5)
    e = ACT[activation](e if r6 is None else e + r6)
    assert_close(y, e, msg="y vs torch")
    assert_close(rm, rm_e, msg="running_mean")
    assert_close(rv, rv_e, msg="running_var")

    ref_y, ref_mean, ref_var = batch_norm_act_forward_reference(
        x.detach(),
        w.detach(),
        b.detach(),
        None if r is None else r.detach(),
        None,
        None,
        None,
        None,
        True,
        1e-5,
        activation,
    )
    assert_close(y, ref_y, msg="y vs op reference")

    probe = torch.randn_like(e)
    got = grads_of(y, [x, w, b, r], probe.float())
    want = grads_of(e, [x6, w6, b6, r6], probe)
    ref = batch_norm_act_backward_reference(
        probe.float().contiguous(memory_format=LAYOUTS[layout]),
        x.detach(),
        w.detach(),
        b.detach(),
        None if r is None else r.detach(),
        ref_mean,
        ref_var,
        True,
        1e-5,
        activation,
        [True, True, True, r is not None],
    )
    count = x.numel() // c
    for name, g, e_g, r_g in zip(("x", "weight", "bias", "residual"), got, want, ref, strict=True):
        if g is None:
            continue
        sums = name in ("weight", "bias")  # reductions over N·H·W: tolerance grows with the count
        assert_close(g, e_g, scale=count**0.5 if sums else 1.0, msg=f"d{name} vs torch")
        assert_close(g, r_g, scale=count**0.5 if sums else 1.0, msg=f"d{name} vs op reference")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_batch_norm_eval_folds_running_stats(layout):
    c = 6
    x = make((2, c, 5, 3), layout)
    w, b = make((c,)), make((c,))
    rm, rv = torch.randn(c, device=DEVICE), torch.rand(c, device=DEVICE) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    r = make((2, c, 5, 3), "nchw")  # a residual in the other layout is fine
    y = batch_norm_act(x, rm, rv, w, b, False, 0.1, 1e-5, activation="gelu", residual=r)
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0), "eval must not touch the running statistics"
    x6, w6, b6, r6 = leaves64(x, w, b, r)
    e = F.gelu(F.batch_norm(x6, rm.double(), rv.double(), w6, b6, False, 0.1, 1e-5) + r6)
    assert_close(y, e)
    probe = torch.randn_like(e)
    for name, g, e_g in zip(
        "xwbr", grads_of(y, [x, w, b, r], probe.float()), grads_of(e, [x6, w6, b6, r6], probe), strict=True
    ):
        assert_close(g, e_g, scale=4.0 if name in "wb" else 1.0, msg=f"d{name}")


@pytest.mark.parametrize(
    ("momentum", "affine", "track"),
    [(0.1, True, True), (None, True, True), (0.4, False, True), (0.1, True, False)],
)
def test_running_stats_after_several_steps_match_batchnorm2d(momentum, affine, track):
    bn = nn.BatchNorm2d(5, momentum=momentum, affine=affine, track_running_stats=track).to(DEVICE)
    fused = FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.ReLU())
    for step in range(4):
        x = make(
            (2, 5, 4, 3), "nhwc" if step % 2 else "nchw", offset=step, scale=1 + step, requires_grad=False
        )
        assert_close(fused(x), F.relu(bn(x)), msg=f"train output, step {step}")
    if track:
        assert_close(fused.running_mean, bn.running_mean, msg="running_mean")
        assert_close(fused.running_var, bn.running_var, msg="running_var")
        assert int(fused.num_batches_tracked) == int(bn.num_batches_tracked) == 4
    fused.eval(), bn.eval()
    x = make((2, 5, 4, 3), requires_grad=False)
    assert_close(fused(x), F.relu(bn(x)), msg="eval output")


def test_sums_from_the_conv_epilogue_give_the_same_result_as_one_pass_statistics():
    from kernels.conv_ops import conv2d_fused

    x = make((2, 3, 6, 5), "nhwc", requires_grad=False)
    weight = torch.randn(4, 3, 3, 3, device=DEVICE)
    z, sums, sumsq = conv2d_fused(x, weight, padding=1, stats=True)
    w, b = torch.randn(4, device=DEVICE), torch.randn(4, device=DEVICE)
    rm1, rv1, rm2, rv2 = torch.zeros(4), torch.ones(4), torch.zeros(4), torch.ones(4)
    from_sums = batch_norm_act(z, rm1, rv1, w, b, True, 0.1, 1e-5, activation="relu", sums=sums, sumsq=sumsq)
    one_pass = batch_norm_act(z, rm2, rv2, w, b, True, 0.1, 1e-5, activation="relu")
    assert_close(from_sums, one_pass)
    assert_close(rm1, rm2), assert_close(rv1, rv2)


@pytest.mark.parametrize("training", [True, False])
def test_conv_bn_act_matches_eager_chain_and_backward_does_not_recompute_the_conv(monkeypatch, training):
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False).to(DEVICE)
    bn = nn.BatchNorm2d(4).to(DEVICE)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.2, 0.2), bn.running_var.uniform_(0.5, 1.5)
    eager_conv, eager_bn = copy.deepcopy(conv), copy.deepcopy(bn)
    conv.train(training), bn.train(training), eager_conv.train(training), eager_bn.train(training)
    x = make((2, 3, 7, 5), "nhwc")
    residual = make((2, 4, 4, 3), "nhwc")
    launches = []
    if TRITON_PATH:
        import kernels.conv as conv_mod

        real = conv_mod.conv2d_fused_triton
        monkeypatch.setattr(conv_mod, "conv2d_fused_triton", lambda *a: launches.append(1) or real(*a))
    y = conv_bn_act(x, conv, bn, "relu", residual)
    x_e = x.detach().clone().requires_grad_()
    r_e = residual.detach().clone().requires_grad_()
    e = F.relu(eager_bn(eager_conv(x_e)) + r_e)
    assert_close(y, e)
    probe = torch.randn_like(e)
    (y * probe).sum().backward()
    (e * probe).sum().backward()
    if TRITON_PATH and training:
        # (eval folds BN into the conv epilogue; d scale then needs z, which conv_ops recomputes by design)
        assert launches == [1], "backward must not re-run the conv (the sums need no gradient)"
    assert_close(x.grad, x_e.grad, msg="dx")
    assert_close(residual.grad, r_e.grad, msg="d residual")
    assert_close(conv.weight.grad, eager_conv.weight.grad, scale=4.0, msg="d conv weight")
    assert_close(bn.weight.grad, eager_bn.weight.grad, scale=4.0, msg="d bn weight")
    assert_close(bn.running_var, eager_bn.running_var, msg="running_var")
    assert int(bn.num_batches_tracked) == int(eager_bn.num_batches_tracked)


def test_modules_keep_eager_type_promotion_for_a_residual_of_another_dtype():
    """The ops need residual.dtype == x.dtype; the modules then add the residual after, as eager does."""
    bn, gn = nn.BatchNorm2d(4).to(DEVICE), nn.GroupNorm(2, 4).to(DEVICE)
    fused_bn, fused_gn = (
        FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.ReLU()),
        FusedGroupNormAct.from_module(gn),
    )
    x = make((2, 4, 3, 5), requires_grad=False)
    residual = make((2, 4, 3, 5), requires_grad=False).half()
    y, e = fused_bn(x, residual), F.relu(bn(x) + residual)
    assert y.dtype == e.dtype == torch.float32
    assert_close(y, e)
    assert_close(fused_gn(x, residual), gn(x) + residual)
    conv = nn.Conv2d(3, 4, 1).to(DEVICE)
    bn.eval()
    z_in = make((2, 3, 3, 5), "nhwc", requires_grad=False)
    assert_close(conv_bn_act(z_in, conv, bn, "silu", residual), F.silu(bn(conv(z_in)) + residual))


def test_why_conv_bn_not_fusable_names_the_reason():
    bn = nn.BatchNorm2d(4)
    assert why_conv_bn_not_fusable(nn.Conv2d(3, 4, 3, padding="same"), bn) is None
    assert "asymmetric" in why_conv_bn_not_fusable(nn.Conv2d(3, 4, 2, padding="same"), bn)
    assert "groups" in why_conv_bn_not_fusable(nn.Conv2d(4, 4, 3, groups=2), bn)
    assert "padding_mode" in why_conv_bn_not_fusable(nn.Conv2d(3, 4, 3, padding_mode="reflect"), bn)
    assert "5 features" in why_conv_bn_not_fusable(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5))
    with pytest.raises(ValueError, match="cannot fuse"):
        conv_bn_act(torch.randn(1, 3, 4, 4), nn.Conv2d(3, 4, 3, groups=1, padding_mode="circular"), bn)


# ---------------------------------------------------------------------------------------------------------
# GroupNorm and LayerNorm2d

# (N, C, H, W, groups): one group; one channel a group; 70 channels a group (two channel blocks); odd HW.
GN_CASES = [(2, 6, 5, 3, 3), (1, 5, 3, 7, 5), (2, 4, 1, 1, 1), (1, 140, 2, 3, 2), (2, 6, 9, 11, 2)]


@pytest.mark.parametrize("case", GN_CASES, ids=lambda c: "N{}C{}H{}W{}G{}".format(*c))
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "silu"])
def test_group_norm_forward_backward_vs_reference_and_torch(case, activation, _triton_path_is_taken):
    n, c, h, w, groups = case
    layout = "nhwc" if GN_CASES.index(case) % 2 else "nchw"
    x = make((n, c, h, w), layout, offset=2.0, scale=3.0)
    wt, bs = make((c,)), make((c,))
    r = make((n, c, h, w), layout) if activation != "none" else None
    y = group_norm_act(x, groups, wt, bs, 1e-5, activation=activation, residual=r)
    assert y.is_contiguous(memory_format=LAYOUTS[layout])
    if TRITON_PATH:
        assert _triton_path_is_taken == ["group_norm_act_forward_triton"]
    x6, w6, b6, r6 = leaves64(x, wt, bs, r)
    e = F.group_norm(x6, groups, w6, b6, 1e-5)
    e = ACT[activation](e if r6 is None else e + r6)
    assert_close(y, e)
    ref_y, ref_mean, ref_rstd = group_norm_act_forward_reference(
        x.detach(), wt.detach(), bs.detach(), None if r is None else r.detach(), groups, 1e-5, activation
    )
    assert_close(y, ref_y, msg="y vs op reference")
    probe = torch.randn_like(e)
    got = grads_of(y, [x, wt, bs, r], probe.float())
    want = grads_of(e, [x6, w6, b6, r6], probe)
    ref = group_norm_act_backward_reference(
        probe.float(),
        x.detach(),
        wt.detach(),
        bs.detach(),
        None if r is None else r.detach(),
        ref_mean,
        ref_rstd,
        groups,
        activation,
        [True, True, True, r is not None],
    )
    count = n * h * w
    for name, g, e_g, r_g in zip(("x", "weight", "bias", "residual"), got, want, ref, strict=True):
        if g is None:
            continue
        scale = count**0.5 if name in ("weight", "bias") else 1.0
        assert_close(g, e_g, scale=scale, msg=f"d{name} vs torch")
        assert_close(g, r_g, scale=scale, msg=f"d{name} vs op reference")


LN_SHAPES = [(2, 5, 3, 7), (1, 1, 4, 3), (3, 70, 1, 2), (2, 3, 13, 11)]


@pytest.mark.parametrize("shape", LN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "silu"])
def test_layer_norm2d_forward_backward_vs_reference_and_torch(shape, activation, _triton_path_is_taken):
    layout = "nhwc" if LN_SHAPES.index(shape) % 2 else "nchw"
    c = shape[1]
    x = make(shape, layout, offset=-1.5, scale=2.0)
    wt, bs = make((c,)), make((c,))
    r = make(shape, layout) if activation in ("relu", "gelu") else None
    y = layer_norm2d_act(x, wt, bs, 1e-6, activation=activation, residual=r)
    assert y.is_contiguous(memory_format=LAYOUTS[layout])
    if TRITON_PATH:
        assert _triton_path_is_taken == ["layer_norm2d_act_forward_triton"]
    x6, w6, b6, r6 = leaves64(x, wt, bs, r)
    e = F.layer_norm(x6.permute(0, 2, 3, 1), (c,), w6, b6, 1e-6).permute(0, 3, 1, 2)
    e = ACT[activation](e if r6 is None else e + r6)
    assert_close(y, e)
    ref_y, ref_mean, ref_rstd = layer_norm2d_act_forward_reference(
        x.detach(), wt.detach(), bs.detach(), None if r is None else r.detach(), 1e-6, activation
    )
    assert_close(y, ref_y, msg="y vs op reference")
    probe = torch.randn_like(e)
    got = grads_of(y, [x, wt, bs, r], probe.float())
    want = grads_of(e, [x6, w6, b6, r6], probe)
    ref = layer_norm2d_act_backward_reference(
        probe.float(),
        x.detach(),
        wt.detach(),
        bs.detach(),
        None if r is None else r.detach(),
        ref_mean,
        ref_rstd,
        activation,
        [True, True, True, r is not None],
    )
    count = x.numel() // c
    for name, g, e_g, r_g in zip(("x", "weight", "bias", "residual"), got, want, ref, strict=True):
        if g is None:
            continue
        scale = count**0.5 if name in ("weight", "bias") else 1.0
        assert_close(g, e_g, scale=scale, msg=f"d{name} vs torch")
        assert_close(g, r_g, scale=scale, msg=f"d{name} vs op reference")


def test_norms_without_affine_parameters():
    x = make((2, 4, 3, 5))
    y_gn = group_norm_act(x, 2, activation="silu")
    y_ln = layer_norm2d_act(x, activation="relu")
    y_bn = batch_norm_act(x, None, None, None, None, True, activation="gelu")
    x6 = x.detach().double()
    assert_close(y_gn, F.silu(F.group_norm(x6, 2)))
    assert_close(y_ln, F.relu(F.layer_norm(x6.permute(0, 2, 3, 1), (4,)).permute(0, 3, 1, 2)))
    assert_close(y_bn, F.gelu(F.batch_norm(x6, None, None, training=True)))
    (y_gn.sum() + y_ln.sum() + y_bn.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_group_norm_and_layer_norm2d_modules_match_eager_and_share_state():
    import torchvision

    gn, ln = nn.GroupNorm(3, 6), torchvision.models.convnext.LayerNorm2d(6, eps=1e-6)
    with torch.no_grad():
        for p in (*gn.parameters(), *ln.parameters()):
            p.uniform_(-1, 1)
    fused_gn, fused_ln = (
        FusedGroupNormAct.from_module(gn, nn.SiLU()),
        FusedLayerNorm2dAct.from_module(ln, nn.GELU()),
    )
    assert fused_gn.weight is gn.weight and fused_ln.bias is ln.bias
    assert list(fused_gn.state_dict()) == list(gn.state_dict())
    assert list(fused_ln.state_dict()) == list(ln.state_dict())
    x = make((2, 6, 4, 5), "nhwc", requires_grad=False)
    residual = make((2, 6, 4, 5), "nhwc", requires_grad=False)
    assert_close(fused_gn(x, residual), F.silu(gn(x) + residual))
    assert_close(fused_ln(x), F.gelu(ln(x)))
    assert "activation=silu" in repr(fused_gn)


@pytest.mark.parametrize(
    ("cls", "module", "act", "error", "match"),
    [
        (FusedBatchNormAct, nn.GroupNorm(2, 4), None, TypeError, "expects nn.BatchNorm2d"),
        (FusedGroupNormAct, nn.BatchNorm2d(4), None, TypeError, "expects nn.GroupNorm"),
        (FusedLayerNorm2dAct, nn.LayerNorm((4, 3)), None, ValueError, "one \\(channel\\) dimension"),
        (FusedBatchNormAct, nn.BatchNorm2d(4), nn.Tanh(), ValueError, "Tanh cannot be fused"),
        (FusedGroupNormAct, nn.GroupNorm(2, 4), nn.GELU(approximate="tanh"), ValueError, "cannot be fused"),
    ],
)
def test_from_module_rejects_what_it_cannot_fuse(cls, module, act, error, match):
    with pytest.raises(error, match=match):
        cls.from_module(module, act)


# ---------------------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile, dispatch


def _op_cases():
    x = make((2, 4, 3, 5), "nhwc")
    w, b = make((4,)), make((4,))
    r = make((2, 4, 3, 5), "nhwc")
    rm, rv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    g = torch.randn(2, 4, 3, 5, device=DEVICE).contiguous(memory_format=torch.channels_last)
    d = lambda t: t.detach()  # noqa: E731
    mean4, var4 = torch.randn(4, device=DEVICE), torch.rand(4, device=DEVICE) + 0.5
    gmean, grstd = torch.randn(4, device=DEVICE), torch.rand(4, device=DEVICE) + 0.5
    lmean, lrstd = torch.randn(30, device=DEVICE), torch.rand(30, device=DEVICE) + 0.5
    sums, sumsq = torch.randn(4, device=DEVICE), torch.rand(4, device=DEVICE) * 30 + 30
    ops = torch.ops.lcv
    return [
        (ops.batch_norm_act.default, (x, w, b, r, rm, rv, None, None, True, 1e-5, "relu")),
        (ops.batch_norm_act.default, (x, w, None, None, rm, rv, None, None, False, 1e-5, "gelu")),
        (ops.batch_norm_act.default, (x, None, b, r, None, None, sums, sumsq, True, 1e-5, "silu")),
        (
            ops.batch_norm_act_backward.default,
            (g, d(x), d(w), d(b), d(r), mean4, var4, True, 1e-5, "silu", [True, True, True, True]),
        ),
        (ops.group_norm_act.default, (x, w, b, r, 2, 1e-5, "gelu")),
        (
            ops.group_norm_act_backward.default,
            (g, d(x), d(w), None, None, gmean, grstd, 2, "relu", [True, False, False, False]),
        ),
        (ops.layer_norm2d_act.default, (x, w, b, None, 1e-6, "silu")),
        (
            ops.layer_norm2d_act_backward.default,
            (g, d(x), d(w), d(b), d(r), lmean, lrstd, "gelu", [False, True, True, True]),
        ),
    ]


@pytest.mark.parametrize("index", range(8))
def test_opcheck(index):
    op, args = _op_cases()[index]
    torch.library.opcheck(op, args)


def test_functionals_in_torch_compile_fullgraph_forward_and_backward():
    x = make((2, 6, 3, 5), "nhwc")
    w, b = make((6,)), make((6,))
    r = make((2, 6, 3, 5), "nhwc")
    rm, rv = torch.zeros(6, device=DEVICE), torch.ones(6, device=DEVICE)

    def block(x, w, b, r, rm, rv):
        y = batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, activation="relu", residual=r)
        y = group_norm_act(y, 3, w, b, activation="silu")
        return layer_norm2d_act(y, w, b, activation="gelu").square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    rm_c, rv_c = rm.clone(), rv.clone()
    loss = compiled(x, w, b, r, rm_c, rv_c)
    grads = torch.autograd.grad(loss, (x, w, b, r))
    e_loss = block(x, w, b, r, rm, rv)
    e_grads = torch.autograd.grad(e_loss, (x, w, b, r))
    assert_close(loss, e_loss)
    assert_close(rm_c, rm), assert_close(rv_c, rv)
    for g, e in zip(grads, e_grads, strict=True):
        assert_close(g, e, scale=4.0)


def test_module_in_torch_compile_fullgraph_train_then_eval():
    bn = nn.BatchNorm2d(4, momentum=None).to(DEVICE)
    fused = FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.SiLU())
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    for step in range(2):
        x = make((2, 4, 3, 3), requires_grad=False, offset=step)
        assert_close(compiled(x), F.silu(bn(x)))
    assert_close(fused.running_var, bn.running_var)
    assert int(fused.num_batches_tracked) == 2
    fused.eval(), bn.eval()
    x = make((2, 4, 3, 3), requires_grad=False)
    assert_close(compiled(x), F.silu(bn(x)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dispatch test")
def test_cpu_without_interpreter_runs_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import kernels.norm as norm

    def boom(*args, **kwargs):
        raise AssertionError("a Triton launcher ran on CPU without TRITON_INTERPRET=1")

    for name in (
        "batch_norm_act_forward_triton",
        "batch_norm_act_backward_triton",
        "group_norm_act_forward_triton",
        "layer_norm2d_act_forward_triton",
    ):
        monkeypatch.setattr(norm, name, boom)
    x = make((2, 4, 3, 3))
    assert not use_triton(x)
    y = batch_norm_act(x, None, None, training=True, activation="relu")
    y.sum().backward()
    assert_close(y, F.relu(F.batch_norm(x.detach().double(), None, None, training=True)))
    assert_close(group_norm_act(x, 2), F.group_norm(x.detach().double(), 2))
    assert_close(
        layer_norm2d_act(x), F.layer_norm(x.detach().double().permute(0, 2, 3, 1), (4,)).permute(0, 3, 1, 2)
    )


def test_bf16_on_the_reference_path_and_autocast_dtypes(monkeypatch):
    """The interpreter has no bf16, so bf16 runs the reference path here (Triton bf16 is a GPU test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = make((2, 4, 5, 3), "nhwc", requires_grad=False).bfloat16()
    w, b = torch.randn(4), torch.randn(4)
    y = batch_norm_act(x, None, None, w, b, True, activation="relu")
    assert y.dtype == torch.bfloat16
    assert_close(
        y, F.relu(F.batch_norm(x.double(), None, None, w.double(), b.double(), True)), torch.bfloat16
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the output dtype under autocast is eager's (CUDA autocast: fp32 for group/layer norm; CPU: input's)
        assert group_norm_act(x, 2, w, b).dtype == F.group_norm(x, 2, w, b).dtype
        e = F.layer_norm(x.permute(0, 2, 3, 1), (4,), w, b).permute(0, 3, 1, 2)
        y = layer_norm2d_act(x, w, b)
        assert y.dtype == e.dtype
        assert_close(y, e.double(), torch.bfloat16)


def test_gradcheck_backward_formulas_float64_reference_path(monkeypatch):
    """Hand-written backward references vs numerical derivatives (float64 needs the reference path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(
        "kernels._common.SUPPORTED_DTYPES", (torch.float32, torch.float16, torch.bfloat16, torch.float64)
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
    assert torch.autograd.gradcheck(
        lambda *t: group_norm_act(t[0], 2, t[1], t[2], activation="gelu", residual=t[3]), (x, w, b, r)
    )
    assert torch.autograd.gradcheck(
        lambda *t: layer_norm2d_act(t[0], t[1], t[2], activation="silu", residual=t[3]), (x, w, b, r)
    )


# ---------------------------------------------------------------------------------------------------------
# Bad inputs


def _bn(x, **kw):
    c = x.shape[1] if x.dim() > 1 else 1
    args = {"running_mean": torch.zeros(c), "running_var": torch.ones(c), "training": True, **kw}
    return batch_norm_act(x, args.pop("running_mean"), args.pop("running_var"), **args)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: _bn(torch.randn(2, 3, 4)), ValueError, "4-D"),
        (lambda: _bn(torch.randn(2, 3, 4, 6)[..., ::2]), ValueError, "dense in NCHW or channels_last"),
        (lambda: _bn(torch.randn(2, 3, 4, 4).double()), TypeError, "supported dtypes"),
        (
            lambda: _bn(torch.randn(2, 3, 4, 4), weight=torch.ones(4)),
            ValueError,
            "weight must be a 1-D tensor of 3",
        ),
        (
            lambda: _bn(torch.randn(2, 3, 4, 4), residual=torch.randn(2, 3, 4, 5)),
            ValueError,
            "residual must have",
        ),
        (
            lambda: _bn(torch.randn(2, 3, 4, 4), residual=torch.randn(2, 3, 4, 4).half()),
            TypeError,
            "residual dtype",
        ),
        (lambda: _bn(torch.randn(2, 3, 4, 4), activation="tanh"), ValueError, "unknown activation 'tanh'"),
        (lambda: _bn(torch.randn(1, 3, 1, 1)), ValueError, "more than 1 value per channel"),
        (
            lambda: _bn(torch.randn(2, 3, 4, 4), running_mean=None, running_var=None, training=False),
            ValueError,
            "required when not using batch statistics",
        ),
        (lambda: _bn(torch.randn(2, 3, 4, 4), sums=torch.zeros(3)), ValueError, "both sums and sumsq"),
        (
            lambda: _bn(torch.randn(2, 3, 4, 4), sums=torch.zeros(3).half(), sumsq=torch.zeros(3).half()),
            TypeError,
            "must be float32",
        ),
        (lambda: group_norm_act(torch.randn(2, 6, 3, 3), 4), ValueError, "divisible by num_groups"),
        (
            lambda: group_norm_act(torch.randn(2, 6, 3, 3), 3, bias=torch.ones(6, dtype=torch.int64)),
            TypeError,
            "floating-point",
        ),
        (lambda: layer_norm2d_act(torch.randn(0, 6, 3, 3)), ValueError, "empty"),
        (lambda: FusedGroupNormAct(2, 4)(torch.randn(2, 4, 3)), ValueError, "4-D"),
    ],
    ids=[
        "3d",
        "strided",
        "float64",
        "weight_len",
        "residual_shape",
        "residual_dtype",
        "activation",
        "one_value",
        "eval_without_stats",
        "sums_alone",
        "sums_dtype",
        "groups",
        "bias_int",
        "empty",
        "module_3d",
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(not TRITON_PATH, reason="needs the Triton path (CUDA or TRITON_INTERPRET=1)")
def test_layer_norm2d_kernel_rejects_too_many_channels():
    from kernels.norm import MAX_LAYERNORM_CHANNELS

    x = torch.randn(1, MAX_LAYERNORM_CHANNELS + 1, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {MAX_LAYERNORM_CHANNELS}"):
        layer_norm2d_act(x)


# ---------------------------------------------------------------------------------------------------------
# GPU-only build check without a GPU, and GPU tests

_SM90_COMPILE_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from offline_compile import pointer_offset_widths
import kernels.norm as norm

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
    # "offsets are int64": every pointer-tensor offset in the Triton IR is i64. (Scalar offsets into the
    # small per-chunk partial-sum buffers, p * C with p < NUM_PARTS, may stay i32.)
    widths = pointer_offset_widths(compiled.asm["ttir"])
    assert widths and set(widths) == {"i64"}, f"{kernel.__name__}: pointer offsets {widths}"

act = dict(HAS_BIAS=True, HAS_RESIDUAL=True, ACTIVATION=2)
build(norm._bn_partial_stats_kernel, BLOCK_M=64, BLOCK_C=64)
build(norm._bn_finalize_kernel, USE_BATCH=True, PIVOTED=True, HAS_WEIGHT=True, BLOCK_C=128)
build(norm._bn_apply_kernel, BLOCK_M=64, BLOCK_C=64, **act)
build(norm._bn_bwd_reduce_kernel, BLOCK_M=64, BLOCK_C=64, **act)
build(norm._bn_bwd_finalize_kernel, USE_BATCH=True, BLOCK_C=128)
writes = dict(WRITE_DX=True, WRITE_DRES=True)
build(norm._bn_bwd_apply_kernel, USE_BATCH=True, BLOCK_M=64, BLOCK_C=64, **writes, **act)
build(norm._gn_fwd_kernel, HAS_WEIGHT=True, BLOCK_HW=128, BLOCK_C=16, **act)
build(norm._gn_bwd_kernel, HAS_WEIGHT=True, BLOCK_HW=128, BLOCK_C=16, **writes, **act)
build(norm._ln2d_fwd_kernel, 8, HAS_WEIGHT=True, BLOCK_M=4, BLOCK_C=1024, **act)
build(norm._ln2d_bwd_kernel, 8, HAS_WEIGHT=True, BLOCK_M=4, BLOCK_C=1024, **writes, **act)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never compiles; catch GPU-only compile errors by compiling offline for Hopper."""
    run_offline_compile(_SM90_COMPILE_SCRIPT)


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine"
)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_types_resnet_like_shapes(dtype):
    x = torch.randn(8, 64, 28, 28, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(64, device="cuda") + 0.5, torch.randn(64, device="cuda")
    residual = torch.randn_like(x)
    y = batch_norm_act(x, None, None, w, b, True, activation="relu", residual=residual)
    e = F.relu(F.batch_norm(x.double(), None, None, w.double(), b.double(), True) + residual.double())
    assert_close(y, e, dtype)
    y = group_norm_act(x, 32, w, b, activation="silu")
    assert_close(y, F.silu(F.group_norm(x.double(), 32, w.double(), b.double())), dtype)
    y = layer_norm2d_act(x, w, b, activation="gelu")
    e = F.gelu(
        F.layer_norm(x.double().permute(0, 2, 3, 1), (64,), w.double(), b.double()).permute(0, 3, 1, 2)
    )
    assert_close(y, e, dtype)
