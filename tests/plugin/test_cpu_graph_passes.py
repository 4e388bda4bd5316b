"""What the strategy changes in Inductor's graphs for CPU training (``lightning_plugin.cpu.graph_passes``):
the gather backward of non-overlapping max-pools in channels_last, the bias-only conv backward as a sum,
GELU's erf saved for the backward, and the cache key that keeps those graphs apart from plain Inductor's.

References: eager PyTorch (bitwise for the pool, float64 for whole training steps) and the generated code
(what a change must remove: the scatter, the extern conv backward, the erf in the backward)."""

from __future__ import annotations

import copy
import json
import operator
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import fresh_cache, run_and_get_code

from lcv_kernels.tolerances import bound, network_length, reduction_tolerance, trajectory_tolerance
from lcv_vision.models.airbench import AirbenchNet
from lightning_plugin import CompileConfig
from lightning_plugin.compile.compiler import ModuleCompiler
from lightning_plugin.compile.stats import CompileStats, make_backend
from lightning_plugin.cpu import graph_passes as cpu_graph_passes
from lightning_plugin.cpu import inductor as cpu_inductor
from pool_gather_script import ConvPool

CPU = torch.device("cpu")


def cpu_backend():
    """The backend the strategy compiles with on a CPU (``tune_cpu=True``), with the Python wrapper, whose
    generated code the tests read."""
    return make_backend("inductor", None, None, None, CompileStats(), CPU)


@pytest.fixture(autouse=True)
def _compile_for_real():
    """Every graph compiled here (no FX/AOT cache hits), so the decompositions and the pass run."""
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False, cpp_wrapper=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield
    torch._dynamo.reset()


@pytest.fixture
def python_wrapper(monkeypatch):
    """The strategy's CPU options with Inductor's Python wrapper: the extern calls are then readable in the
    generated code (with the C++ wrapper they are shim calls)."""
    monkeypatch.setitem(cpu_inductor.CPU_TRAINING_OPTIONS, "cpp_wrapper", False)


def _with_ties(shape, generator, channels_last):
    """Values on a 0.5 grid: many windows hold their maximum twice (what a real image's flat background
    gives), where the scatter keeps the first index and so must the gather."""
    x = torch.round(torch.randn(*shape, generator=generator, dtype=torch.float64) * 2) / 2
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


# ------------------------------------------------------------------------------------------ max-pool backward
#: (shape, kernel, ceil_mode) of the pools compiled together in one graph: the gather sees each of them
TIED_POOLS = [
    ((2, 3, 31, 31), 2, False),  # airbench's odd map: the last row and column belong to no window
    ((2, 3, 31, 31), 2, True),  # ceil mode: the last window is cut off
    ((1, 17, 7, 9), 3, False),  # N=1, C not a multiple of 16, H != W, k=3
    ((3, 5, 9, 10), 3, True),
    ((2, 4, 1, 6), 1, False),  # H=1, a 1x1 "pool"
]


def test_pool_backward_gather_equals_eager_bitwise_with_ties():
    """Every case of TIED_POOLS in one compiled function (one compile, not five): each pool's output and
    input gradient bitwise equal to eager's, the gradient in channels_last."""
    g = torch.Generator().manual_seed(0)
    xs = [_with_ties(shape, g, channels_last=True) for shape, _, _ in TIED_POOLS]

    def pools(*ts):
        return tuple(
            F.max_pool2d(t, kernel, ceil_mode=ceil_mode) for t, (_, kernel, ceil_mode) in zip(ts, TIED_POOLS)
        )

    grads = [torch.randn(y.shape, generator=g, dtype=torch.float64) for y in pools(*xs)]

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        outs = fn(*leaves)
        torch.autograd.backward(outs, grads)
        return outs, [leaf.grad for leaf in leaves]

    want_y, want_dx = run(pools)
    got_y, got_dx = run(torch.compile(pools, backend=cpu_backend()))
    for case, gy, wy, gdx, wdx in zip(TIED_POOLS, got_y, want_y, got_dx, want_dx, strict=True):
        assert torch.equal(gy, wy), case
        assert torch.equal(gdx, wdx), case
        assert gdx.is_contiguous(memory_format=torch.channels_last), case


def test_pool_backward_of_an_expanded_gradient():
    """``out.sum().backward()`` hands the pool an expanded (all-zero-stride) gradient."""
    x = _with_ties((2, 3, 8, 8), torch.Generator().manual_seed(1), channels_last=True)
    leaf_e, leaf_c = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.max_pool2d(leaf_e, 2).sum().backward()
    torch.compile(lambda t: F.max_pool2d(t, 2).sum(), backend=cpu_backend())(leaf_c).backward()
    assert torch.equal(leaf_c.grad, leaf_e.grad)


def _backward_code(fn, *args):
    """The generated code of every graph ``fn`` compiles, the backward included (``fn`` runs it)."""
    _, codes = run_and_get_code(fn, *args)
    return "\n".join(codes)


#: (pool, layout, whether the backward should gather): tiles in NCHW keep torch's scatter, the faster one
#: there; overlapping windows are ResNet's stem.
POOL_CASES = {
    "tiles_channels_last": ("tiles", "channels_last", True),
    "tiles_nchw": ("tiles", "nchw", False),
    "overlapping": ("overlapping", "channels_last", False),
}


@pytest.fixture(scope="module")
def pool_reports() -> dict[str, dict]:
    """Every case in one fresh process, its graphs lowered afresh: in full CI runs, state left by some
    earlier test in the worker made torch's scatter decomposition step aside for one case or another (never
    alone)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_gather_script.py")
    cases = [f"{pool}:{layout}" for pool, layout, _ in POOL_CASES.values()]
    done = subprocess.run([sys.executable, script, *cases], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {report.pop("case"): report for report in reports}


@pytest.mark.xdist_group("pool_gather")  # one worker builds the module fixture (else each worker does)
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_which_pools_take_the_gather(case, pool_reports):
    pool, layout, gathers = POOL_CASES[case]
    report = pool_reports[f"{pool}:{layout}"]
    assert (not report["scatter"]) == gathers
    assert report["error"] <= report["bound"], report


# ------------------------------------------------------------------------------------ bias-only conv backward
@pytest.mark.parametrize("frozen", [True, False])
def test_bias_only_conv_backward_is_a_fused_sum(python_wrapper, frozen):
    """airbench's whitening layer: weight frozen, input without gradient, bias trained. Its bias gradient
    must not go to an extern convolution_backward; a conv whose weight trains still does."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 6, 2), nn.GELU()).to(memory_format=torch.channels_last)
    eager[0].weight.requires_grad_(not frozen)
    compiled = copy.deepcopy(eager)
    x = torch.randn(4, 3, 9, 11).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(4, 6, 8, 10)
    eager(x).backward(grad)
    code = _backward_code(lambda: torch.compile(compiled, backend=cpu_backend())(x).backward(grad))
    assert ("convolution_backward.default(" in code) == (not frozen)  # the extern call, not a kernel name
    # each gradient sums over batch and space (4 x 8 x 10), in an order that depends on the CPU's vector width
    atol, rtol = reduction_tolerance(torch.float32, 4 * 8 * 10)
    torch.testing.assert_close(compiled[0].bias.grad, eager[0].bias.grad, rtol=rtol, atol=atol)
    if not frozen:
        torch.testing.assert_close(compiled[0].weight.grad, eager[0].weight.grad, rtol=rtol, atol=atol)


def test_the_bias_only_rewrite_leaves_other_masks_and_dtypes_to_torch():
    args = (torch.ones(1, 2, 3, 3), torch.ones(1, 1, 5, 5), torch.ones(2, 1, 3, 3), [2], [1, 1], [0, 0])
    rest = ([1, 1], False, [0, 0], 1)
    bias_only = cpu_graph_passes.convolution_backward_bias_only
    assert bias_only(*args, *rest, [True, False, True]) is NotImplemented
    half = (args[0].half(), *args[1:])
    assert bias_only(*half, *rest, [False, False, True]) is NotImplemented
    _, _, db = bias_only(*args, *rest, [False, False, True])
    assert torch.equal(db, torch.full((2,), 9.0))


# ------------------------------------------------------------ a bias gradient without the input gradient
class _WhitenedConv(nn.Module):
    """airbench's first two layers: a frozen conv whose bias trains, GELU, then a conv that trains."""

    def __init__(self, c_in=3, c_mid=6, c_out=5, kernel=3, stride=1, padding=1, dilation=1) -> None:
        super().__init__()
        self.whiten = nn.Conv2d(c_in, c_mid, 2)
        self.whiten.weight.requires_grad_(False)
        self.conv = nn.Conv2d(c_mid, c_out, kernel, stride=stride, padding=padding, dilation=dilation)

    def forward(self, x):
        return self.conv(F.gelu(self.whiten(x)))


#: (input shape, conv options, channels_last) of the models compiled together in one graph: the rewrite sees
#: each of their patterns
WHITENED_CASES = [
    (shape, conv, channels_last)
    for channels_last in (True, False)
    for shape, conv in [
        ((2, 3, 12, 12), {}),  # airbench's pair: 3x3, same padding
        ((1, 3, 9, 14), {"kernel": 3, "stride": 2, "padding": 0}),  # N=1, odd H != W, stride 2
        (
            (3, 1, 10, 7),
            {"c_mid": 17, "c_out": 4, "kernel": 2, "dilation": 2, "padding": 1},
        ),  # odd C, dilation
        ((2, 3, 6, 6), {"kernel": 1, "padding": 0}),  # 1x1
    ]
]


class _Several(nn.Module):
    """Independent models run side by side: one graph (one compile) holding each one's pattern."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, *xs):
        return tuple(model(x) for model, x in zip(self.models, xs))


def _in_layout(model: nn.Module, x: torch.Tensor, channels_last: bool) -> tuple[nn.Module, torch.Tensor]:
    if not channels_last:
        return model, x
    return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


def test_bias_gradient_through_a_conv_matches_eager_in_float64():
    torch.manual_seed(0)
    models, xs = [], []
    for shape, conv, channels_last in WHITENED_CASES:
        model = _WhitenedConv(c_in=shape[1], **conv).double()
        model, x = _in_layout(model, torch.randn(*shape, dtype=torch.float64), channels_last)
        models.append(model)
        xs.append(x)
    eager = _Several(models)
    compiled = copy.deepcopy(eager)
    grads = [torch.randn(y.shape, dtype=torch.float64) for y in eager(*xs)]
    torch.autograd.backward(eager(*xs), grads)
    torch.autograd.backward(torch.compile(compiled, backend=cpu_backend())(*xs), grads)
    for case, want_model, got_model in zip(WHITENED_CASES, eager.models, compiled.models, strict=True):
        tol = reduction_tolerance(torch.float64, network_length(want_model, case[0]))
        for (name, want), got in zip(want_model.named_parameters(), got_model.parameters()):
            if want.requires_grad:
                msg = f"{name} of {case}"
                torch.testing.assert_close(got.grad, want.grad, atol=bound(tol, want.grad), rtol=0, msg=msg)


def test_the_conv_after_a_trained_bias_computes_no_input_gradient(python_wrapper):
    """What the rewrite removes: the second conv's input gradient (``output_mask`` starting with True)
    and with it the extern call's most expensive half on narrow inputs; its weight gradient stays."""
    model = _WhitenedConv().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    code = _backward_code(lambda: torch.compile(model, backend=cpu_backend())(x).sum().backward())
    calls = code.count("convolution_backward.default(")
    assert calls == 2  # the weight gradient of conv with GELU's output, and with GELU's derivative
    assert "[False, True, True])" in code and "[False, True, False])" in code and "[True, " not in code
    model.whiten.weight.requires_grad_(True)  # now the input gradient feeds the whitening's weight gradient
    torch._dynamo.reset()
    code = _backward_code(lambda: torch.compile(model, backend=cpu_backend())(x).sum().backward())
    assert "[True, True, True]" in code


def _reduction_graph(
    dims=(0, 2, 3), keepdim=False, mask=(True, True, False), transposed=False, groups=1, dx_output=False
):
    """conv backward -> dx * t -> sum(dims): the joint graph's pattern, with fake values as AOT gives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    with mode:
        values = {
            "dy": torch.empty(2, 4, 6, 6),
            "x": torch.empty(2, 3, 6, 6),
            "w": torch.empty(4, 3, 3, 3) if not transposed else torch.empty(3, 4, 3, 3),
            "t": torch.empty(2, 3, 6, 6),
        }
    nodes = {}
    for name, value in values.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    args = (nodes["dy"], nodes["x"], nodes["w"], None, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)
    conv = graph.call_function(torch.ops.aten.convolution_backward.default, (*args, list(mask)))
    dx = graph.call_function(operator.getitem, (conv, 0))
    dw = graph.call_function(operator.getitem, (conv, 1))
    with mode:
        dx.meta["val"] = torch.empty(2, 3, 6, 6)
        dw.meta["val"] = torch.empty(4, 3, 3, 3)
    conv.meta["val"] = (dx.meta["val"], dw.meta["val"], None)
    product = graph.call_function(torch.ops.aten.mul.Tensor, (nodes["t"], dx))
    product.meta["val"] = dx.meta["val"]
    reduced = graph.call_function(torch.ops.aten.sum.dim_IntList, (product, list(dims), keepdim))
    graph.output((reduced, dw, dx) if dx_output else (reduced, dw))
    return graph


def test_the_input_gradient_rewrite_takes_only_its_pattern():
    rewrite = cpu_graph_passes.bias_gradient_without_input_gradient
    assert rewrite(_reduction_graph()) == 1
    assert rewrite(_reduction_graph(dims=(0, -2, -1))) == 1
    for other in (
        _reduction_graph(dims=(0, 2)),  # not a per-channel sum
        _reduction_graph(keepdim=True),
        _reduction_graph(transposed=True),
        _reduction_graph(groups=3),
        _reduction_graph(mask=(False, True, False)),
        _reduction_graph(dx_output=True),  # the input gradient used elsewhere too
    ):
        assert rewrite(other) == 0


def test_the_input_gradient_rewrite_drops_the_input_gradient_from_the_mask():
    graph = _reduction_graph()
    cpu_graph_passes.bias_gradient_without_input_gradient(graph)
    masks = [n.args[10] for n in graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert sorted(masks) == [[False, True, False], [False, True, False]]
    conv, added = [n for n in graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert conv.meta["val"][0] is None  # the input gradient is no longer computed
    assert all(n.meta.get("val") is not None for n in graph.nodes if n.op == "call_function")


# ------------------------------------------------------------- a wide conv's weight gradient on a tiny map
WIDE = cpu_graph_passes.MATMUL_WEIGHT_GRADIENT_MIN_TAPS  # input channels x taps from which it applies


#: (input channels, kernel, conv options, map size, channels_last, bias) of the convs compiled together in
#: one graph: the decomposition sees each of them
WIDE_CASES = [
    (*case, channels_last, bias)
    for case in [
        (-(-WIDE // 9), 3, {"padding": 1}, 2),  # ResNet's last stage: 3x3 on a 2x2 map
        (-(-WIDE // 9), 3, {"padding": 1, "stride": 2}, 4),  # its strided first conv: 4x4 -> 2x2
        (WIDE, 1, {}, 1),  # 1x1 on a 1x1 map
        (-(-WIDE // 4) + 3, 2, {"padding": 1, "dilation": 2}, 1),  # dilation, odd channels, padding only
    ]
    for channels_last in (False, True)
    for bias in (False, True)
]


def test_wide_conv_weight_gradient_on_a_tiny_map_matches_eager_in_float64(python_wrapper):
    """ResNet's last stage at 64 px: the weight gradient goes to ``unfold`` + ``mm`` (no oneDNN weight
    gradient left in the code); input and bias gradients as before; every gradient equal to eager's. Every
    case of WIDE_CASES in one graph (one compile, not sixteen)."""
    torch.manual_seed(0)
    convs, xs = [], []
    for c_in, kernel, conv, size, channels_last, bias in WIDE_CASES:
        model = nn.Conv2d(c_in, 5, kernel, bias=bias, **conv).double()
        model, x = _in_layout(model, torch.randn(3, c_in, size, size, dtype=torch.float64), channels_last)
        convs.append(model)
        xs.append(x)
    eager = _Several(convs)
    compiled = copy.deepcopy(eager)
    leaves_e = [x.clone().requires_grad_() for x in xs]
    leaves_c = [x.clone().requires_grad_() for x in xs]
    grads = [torch.randn(y.shape, dtype=torch.float64) for y in eager(*xs)]
    torch.autograd.backward(eager(*leaves_e), grads)
    code = _backward_code(
        lambda: torch.autograd.backward(torch.compile(compiled, backend=cpu_backend())(*leaves_c), grads)
    )
    # oneDNN: the input gradient only, once per conv
    assert code.count("[True, False, False])") == len(WIDE_CASES) and "[True, True" not in code
    for case, want_conv, got_conv, leaf_e, leaf_c in zip(
        WIDE_CASES, eager.models, compiled.models, leaves_e, leaves_c, strict=True
    ):
        tol = reduction_tolerance(torch.float64, network_length(want_conv, leaf_e.shape))
        torch.testing.assert_close(
            leaf_c.grad, leaf_e.grad, atol=bound(tol, leaf_e.grad), rtol=0, msg=str(case)
        )
        for (name, want), got in zip(want_conv.named_parameters(), got_conv.parameters()):
            msg = f"{name} of {case}"
            torch.testing.assert_close(got.grad, want.grad, atol=bound(tol, want.grad), rtol=0, msg=msg)
            layout = torch._prims_common.suggest_memory_format(want.grad)  # no copy when accumulated
            assert got.grad.is_contiguous(memory_format=layout), msg


def test_narrower_convs_and_larger_maps_keep_onednns_weight_gradient(python_wrapper):
    """Just under either threshold (fewer input channels x taps, or more than 4 output positions), where
    oneDNN measured faster. Both convs in one graph."""
    cases = [(-(-WIDE // 9) - 1, 2), (-(-WIDE // 9), 3)]
    model = _Several([nn.Conv2d(c_in, 4, 3, padding=1, bias=False) for c_in, _ in cases])
    xs = [torch.randn(2, c_in, size, size, requires_grad=True) for c_in, size in cases]
    code = _backward_code(
        lambda: sum(y.sum() for y in torch.compile(model, backend=cpu_backend())(*xs)).backward()
    )
    assert code.count("[True, True, False])") == len(cases)


# ---------------------------------------------------------------------------------------------- GELU's erf
def test_gelu_erf_is_computed_in_the_forward_only(python_wrapper):
    """The backward reads the saved erf: no erf left in its code (stock Inductor computes it there twice,
    to recompute GELU's output for the conv's weight gradient and for GELU's own derivative)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU(), nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 8, 8)

    def step(backend):
        torch._dynamo.reset()
        return run_and_get_code(lambda: torch.compile(model, backend=backend)(x).sum().backward())[1]

    def computes_erf(code):  # Inductor's vectorised and scalar C++ for erf
        return ".erf()" in code or "std::erf(" in code

    forward, backward = step(cpu_backend())
    assert computes_erf(forward) and not computes_erf(backward)
    _, stock_backward = step(torch._TorchCompileInductorWrapper(None, None, None))
    assert computes_erf(stock_backward)  # what the pass changes


def test_save_erf_merges_equal_erfs_and_marks_them():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    scaled = [graph.call_function(torch.ops.aten.mul.Tensor, (x, 0.7071067811865476)) for _ in range(2)]
    erfs = [graph.call_function(torch.ops.aten.erf.default, (s,)) for s in scaled]
    other = graph.call_function(torch.ops.aten.erf.default, (x,))
    graph.output((erfs[0], erfs[1], other))
    assert cpu_graph_passes.save_erf(graph) == 2
    kept = [n for n in graph.nodes if n.target is torch.ops.aten.erf.default]
    assert len(kept) == 2 and all(n.meta["recompute"].name == "MUST_SAVE" for n in kept)
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert outputs[0] is outputs[1] is kept[0] and outputs[2] is kept[1]


# ------------------------------------------------------------------------------ whole training steps, caches
def test_airbench_training_steps_match_eager_in_float64():
    """The three changes together (whitening bias, GELU, odd maps into MaxPool2d(2), channels_last): two
    SGD steps, then every parameter, gradient and BatchNorm buffer as eager."""
    torch.manual_seed(0)
    eager = AirbenchNet(widths=(4, 8, 8)).double().to(memory_format=torch.channels_last)
    compiled = copy.deepcopy(eager)
    compiler = ModuleCompiler(CompileConfig(fallback="raise"))
    assert compiler.compile(compiled, CPU)
    assert isinstance(compiler._backend.inner, cpu_inductor.CPUTrainingInductor)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64) for _ in range(2)]
    batches = [b.contiguous(memory_format=torch.channels_last) for b in batches]
    for model in (eager, compiled):
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        for x in batches:
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    tol = trajectory_tolerance(torch.float64, network_length(eager, batches[0].shape), len(batches))
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(got, want, atol=bound(tol, want), rtol=0, msg=name)
        if want.grad is not None:
            atol = bound(tol, want.grad)
            torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=0, msg=f"grad of {name}")
    for (name, want), got in zip(eager.named_buffers(), compiled.buffers()):
        torch.testing.assert_close(got, want, atol=bound(tol, want.double()), rtol=0, msg=name)
    compiler.restore(compiled)


def test_graphs_compiled_with_the_passes_are_cached_apart_from_plain_ones(monkeypatch):
    """Same Inductor options with and without the passes: the second compile must not be served the first
    one's cached graph (AOTAutograd's key leaves decompositions out; the pass's uuid puts them in). A third
    compile with the passes loads the second's: Inductor pickles the decomposition table it is given into its
    cache key, and a table that does not pickle (some of torch's entries are C++ functions) made it bypass the
    FX graph cache for every graph."""
    from torch._dynamo.utils import counters

    calls = []
    op = torch.ops.aten.max_pool2d_with_indices_backward.default

    def spy(*args):
        calls.append(1)
        return cpu_graph_passes.max_pool2d_backward_gather(*args)

    monkeypatch.setitem(cpu_graph_passes.REPLACEMENTS, op, spy)
    cpu_graph_passes.training_decompositions.cache_clear()
    model = ConvPool(nn.MaxPool2d(2)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    plain = torch._TorchCompileInductorWrapper(None, dict(cpu_inductor.CPU_TRAINING_OPTIONS), None)
    counters.clear()
    try:
        with (
            fresh_cache(),
            torch._inductor.config.patch(fx_graph_cache=True),
            torch._functorch.config.patch(enable_autograd_cache=True),
        ):
            for i, backend in enumerate((plain, cpu_backend(), cpu_backend())):
                torch._dynamo.reset()
                torch.compile(model, backend=backend)(x.clone().requires_grad_()).sum().backward()
                if i == 1:
                    assert calls, "the compile with the passes was served the plain graph from the cache"
                    hits = counters["aot_autograd"]["autograd_cache_hit"]
    finally:
        cpu_graph_passes.training_decompositions.cache_clear()
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] > hits  # the third compile loaded the second


def test_backends_with_the_passes_compare_equal_only_to_each_other():
    """Equal backends let a later fit reuse an earlier fit's compiled code (and never another's)."""
    ours = cpu_inductor.CPUTrainingInductor(None, dict(cpu_inductor.CPU_TRAINING_OPTIONS), None)
    assert ours == cpu_inductor.CPUTrainingInductor(None, dict(cpu_inductor.CPU_TRAINING_OPTIONS), None)
    assert ours != torch._TorchCompileInductorWrapper(None, dict(cpu_inductor.CPU_TRAINING_OPTIONS), None)
    assert make_backend("inductor", None, None, None, CompileStats(), CPU) == cpu_backend()
    for plain in (
        make_backend("inductor", None, None, None, CompileStats(), CPU, tune_cpu=False),
        make_backend("inductor", None, {"shape_padding": True}, None, CompileStats(), CPU),
        make_backend("inductor", None, None, None, CompileStats(), torch.device("cuda")),
    ):
        assert not isinstance(plain.inner, cpu_inductor.CPUTrainingInductor)


def test_save_erf_leaves_activation_checkpointing_policies_alone():
    from torch.utils.checkpoint import CheckpointPolicy

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    erf = graph.call_function(torch.ops.aten.erf.default, (x,))
    erf.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    graph.output(erf)
    assert cpu_graph_passes.save_erf(graph) == 0
    assert erf.meta["recompute"] is CheckpointPolicy.PREFER_RECOMPUTE


def test_a_joint_graph_pass_of_the_users_own_switches_the_passes_off(monkeypatch):
    """The slot the passes use is the user's when they filled it: their pass runs, ours do not."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class UsersPass(CustomGraphPass):
        def __call__(self, graph):
            seen.append(sum(n.target is torch.ops.aten.erf.default for n in graph.nodes))

        def uuid(self):
            return "users-pass"

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU())
    with torch._inductor.config.patch(joint_custom_pre_pass=UsersPass()):
        torch.compile(model, backend=cpu_backend())(torch.randn(2, 3, 6, 6)).sum().backward()
    assert seen == [2]  # their pass saw the graph as torch made it: forward and backward erf, not merged


def test_a_tiling_pool_is_computed_once_in_the_forward(python_wrapper, monkeypatch):
    """conv -> MaxPool2d(2) -> BatchNorm -> GELU in channels_last: the pool's max is evaluated once, not
    again in each of BatchNorm's passes (statistics, then normalisation). Counted in the generated code
    against the same compile without the forward change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.MaxPool2d(2), nn.BatchNorm2d(16), nn.GELU())
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 15, 15).contiguous(memory_format=torch.channels_last)

    def forward_code():
        torch._dynamo.reset()
        cpu_graph_passes.training_decompositions.cache_clear()
        return run_and_get_code(lambda: torch.compile(model, backend=cpu_backend())(x).sum().backward())[1][0]

    realised = forward_code().count("maximum(")
    monkeypatch.delitem(cpu_graph_passes.REPLACEMENTS, torch.ops.aten.max_pool2d_with_indices.default)
    inlined = forward_code().count("maximum(")
    cpu_graph_passes.training_decompositions.cache_clear()
    assert 0 < realised < inlined
