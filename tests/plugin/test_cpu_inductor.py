"""The CPU training tuning of Inductor (``lightning_plugin.cpu.inductor``): when it applies, that it is
active while the strategy compiles (Inductor no longer picks channels_last, and writes a C++ wrapper), and
that compiled training with it matches eager in float64 (train and eval, gradients, BN running stats)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torchvision
from torch import nn
from torch._inductor.graph import GraphLowering

import lightning_plugin
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from lightning_plugin import CompileConfig
from lightning_plugin.compile.compiler import ModuleCompiler
from lightning_plugin.compile.stats import CompileStats, make_backend
from lightning_plugin.cpu import inductor as cpu_inductor

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _compile_for_real():
    """Compile each graph here (no FX/AOT cache hits), so the layout spy sees Inductor decide."""
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield
    torch._dynamo.reset()


class _Decisions(list):
    """``decide_layout_opt`` answers, and ``cpp_wrapper`` as Inductor saw it at each."""

    def __init__(self) -> None:
        super().__init__()
        self.cpp_wrappers: list[bool] = []


@pytest.fixture
def layout_decisions(monkeypatch):
    """Every ``decide_layout_opt`` answer Inductor gives while compiling (True: it picks channels_last)."""
    decisions = _Decisions()
    original = GraphLowering.decide_layout_opt

    def spy(gm, *, is_inference):
        decision = original(gm, is_inference=is_inference)
        decisions.append(decision)
        decisions.cpp_wrappers.append(torch._inductor.config.cpp_wrapper)
        return decision

    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(spy))
    return decisions


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 6, 3, stride=2, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
        )
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def resnet18_fragment() -> nn.Module:
    """torchvision's ResNet-18 stem and first stage (conv, BN, ReLU, max-pool, two BasicBlocks)."""
    net = torchvision.models.resnet18(num_classes=3)
    return nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1)


# -------------------------------------------------------------------------------------------- when it applies
@pytest.mark.parametrize(
    ("backend", "mode", "options", "device", "expected"),
    [
        ("inductor", None, None, CPU, True),
        ("inductor", "default", {}, CPU, True),
        ("inductor", None, None, torch.device("cuda"), False),
        ("inductor", None, None, None, False),
        ("inductor", None, {"layout_optimization": True}, CPU, False),
        ("inductor", "max-autotune", None, CPU, False),
        ("aot_eager", None, None, CPU, False),
    ],
)
def test_applies_only_to_plain_inductor_on_cpu(backend, mode, options, device, expected):
    tuned = cpu_inductor.training_options(backend, mode, options, device)
    assert tuned == (cpu_inductor.CPU_TRAINING_OPTIONS if expected else None)
    assert cpu_inductor.training_options(backend, mode, options, device, tune_cpu=False) is None


def test_make_backend_tunes_inductor_on_cpu_and_keeps_user_options():
    stats = CompileStats()
    assert make_backend("inductor", None, None, None, stats, CPU).inner.config == {
        "layout_optimization": False,
        "cpp_wrapper": True,
    }
    assert make_backend("inductor", None, None, None, stats, CPU, tune_cpu=False).inner.config == {}
    assert make_backend("inductor", None, None, None, stats, torch.device("cuda")).inner.config == {}
    user = make_backend("inductor", None, {"shape_padding": True}, None, stats, CPU).inner
    assert user.config == {"shape_padding": True}
    assert (
        "layout_optimization"
        not in make_backend("inductor", "max-autotune", None, None, stats, CPU).inner.config
    )


# -------------------------------------------------------------------------------------------- active in a fit
class _Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = SmallCNN()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(6, 3, 9, 7, generator=g), torch.randint(0, 3, (6,), generator=g)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Classifier(), torch.utils.data.DataLoader(data, batch_size=3))


def test_a_compiled_fit_on_cpu_leaves_the_layout_alone_and_writes_a_cpp_wrapper(
    layout_decisions, monkeypatch
):
    # SmallCNN's graphs are smaller than the default: its fit checks the C++ wrapper with the threshold at 1
    monkeypatch.setattr(cpu_inductor, "CPP_WRAPPER_MIN_OPS", 1)
    _fit("compiled")
    # stock Inductor answers True for mkldnn convs on CPU, and writes a Python wrapper
    assert layout_decisions and not any(layout_decisions)
    assert all(layout_decisions.cpp_wrappers)


def _mlp(depth: int) -> torch.fx.GraphModule:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    return torch.fx.symbolic_trace(nn.Sequential(*layers, nn.Linear(4, 2)))


@pytest.mark.parametrize(
    ("depth", "asked", "expected"),
    [
        (0, None, False),
        (11, None, False),
        (12, None, True),
        (40, None, True),
        (0, True, True),
        (40, False, False),
    ],
)
def test_the_cpp_wrapper_is_written_for_graphs_of_many_ops(monkeypatch, depth, asked, expected):
    """A graph of 1 or 23 ops keeps the Python wrapper (a call into the C++ one costs more), one of 25 or 81
    gets the C++ wrapper; a caller's own ``cpp_wrapper`` stands either way."""
    from torch._inductor import compile_fx

    seen = []
    monkeypatch.setattr(
        compile_fx, "compile_fx", lambda gm, inputs, config_patches, **kw: seen.append(config_patches)
    )
    graph = _mlp(depth)
    assert cpu_inductor.graph_op_count(graph) == 2 * depth + 1
    backend = cpu_inductor.CPUTrainingInductor(None, dict(cpu_inductor.CPU_TRAINING_OPTIONS), None)
    backend(graph, [torch.randn(2, 4)], config_patches=None if asked is None else {"cpp_wrapper": asked})
    assert seen[0]["cpp_wrapper"] is expected
    assert seen[0]["layout_optimization"] is False


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: lightning_plugin.CompiledStrategy(options={"shape_padding": True}),
        lambda: lightning_plugin.CompiledStrategy(tune_cpu=False),
    ],
    ids=["user_options", "tune_cpu_false"],
)
def test_user_options_or_tune_cpu_false_switch_the_tuning_off(layout_decisions, strategy):
    _fit(strategy())
    assert any(layout_decisions)
    assert not any(layout_decisions.cpp_wrappers)


# ---------------------------------------------------------------------------------------------- matches eager
#: (model, input shape, channels_last), trained side by side in one compiled module (one training graph and
#: one eval graph, not one of each per case)
TUNED_CASES = [
    (resnet18_fragment, (1, 3, 19, 13), False),  # N=1, odd sizes: BN statistics over H*W only
    (SmallCNN, (3, 3, 11, 1), False),  # a size-1 dimension
    (SmallCNN, (2, 3, 7, 9), True),
]


class _SideBySide(nn.Module):
    """Independent models, each on its own input: their losses add, so each one's gradients are its own."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(model(x) for model, x in zip(self.models, xs))


def _train_steps(model: nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outputs = []
    for xs in batches:
        outs = model(*xs)
        outputs.append(tuple(out.detach() for out in outs))
        optimizer.zero_grad()
        sum(out.square().mean() for out in outs).backward()
        optimizer.step()
    return outputs


def test_compiled_training_with_the_tuning_matches_eager_in_float64(unoptimised_cpp_builds):
    """Its subject is Inductor's tuned graph, one large one: built at ``-O0`` (39 s -> 30 s alone)."""
    torch.manual_seed(0)
    models = [build().double() for build, _, _ in TUNED_CASES]
    for model, (_, _, channels_last) in zip(models, TUNED_CASES):
        if channels_last:
            model.to(memory_format=torch.channels_last)
    eager = _SideBySide(models)
    compiled = copy.deepcopy(eager)
    compiler = ModuleCompiler(CompileConfig(fallback="raise"))
    assert compiler.compile(compiled, CPU)
    assert compiler._backend.inner.config == cpu_inductor.CPU_TRAINING_OPTIONS
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        xs = [torch.randn(*shape, generator=g, dtype=torch.float64) for _, shape, _ in TUNED_CASES]
        layouts = [torch.channels_last if last else torch.contiguous_format for _, _, last in TUNED_CASES]
        batches.append(tuple(x.contiguous(memory_format=layout) for x, layout in zip(xs, layouts)))

    # float64, the sums of forward and backward in another order, carried through the two steps
    tols = [
        trajectory_tolerance(torch.float64, network_length(model, shape), len(batches))
        for model, (_, shape, _) in zip(eager.models, TUNED_CASES)
    ]

    def close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float], msg: str) -> None:
        torch.testing.assert_close(got, want, atol=bound(tol, want), rtol=0, msg=msg)

    for step, (wants, gots) in enumerate(zip(_train_steps(eager, batches), _train_steps(compiled, batches))):
        for i, (want, got) in enumerate(zip(wants, gots, strict=True)):
            close(got, want, tols[i], f"output of case {i} at step {step}")
    for i, (want_model, got_model) in enumerate(zip(eager.models, compiled.models)):
        for (name, p_eager), p_compiled in zip(want_model.named_parameters(), got_model.parameters()):
            close(p_compiled.grad, p_eager.grad, tols[i], f"grad of {name} in case {i}")
            close(p_compiled, p_eager, tols[i], f"{name} in case {i}")
        for (name, b_eager), b_compiled in zip(want_model.named_buffers(), got_model.buffers()):
            close(b_compiled, b_eager, tols[i], f"{name} in case {i}")  # running stats, counts

    eager.eval()
    compiled.eval()
    for i, (want, got) in enumerate(zip(eager(*batches[0]), compiled(*batches[0]), strict=True)):
        close(got, want, tols[i], f"eval output of case {i}")
    assert compiler.stats.graphs >= 2 and not compiler.stats.fell_back
    compiler.restore(compiled)
