"""``compile_step=True``: a training step traced as one graph (forward, backward, clipping, optimizer update).

The truth is Lightning's own step on the eager model (its default strategy) with the same seeds, data,
optimizer, LR schedule, gradient clipping, accumulation and ``on_before_optimizer_step`` hook. The graphs are
read from a recording backend (a silent fallback to the compiled forward would hand it a forward-only graph),
and the steps run through the graph are counted by the strategy's stats.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_plugin
from boring import TRAINER_KWARGS
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from lightning_plugin.compile import decision as compile_decision
from lightning_plugin.compile.decision import SAMPLES, WARMUP_STEPS
from lightning_plugin.kernel_choice.cache import CACHE_DIR_ENV

pytestmark = pytest.mark.xdist_group("test_whole_step")

BATCH = 2


class StepNet(L.LightningModule):
    """Conv (no bias: it would feed a BatchNorm) + BatchNorm + ReLU + Linear; logs its loss and accuracy each
    step and, when ``grad_hook``, the gradient norm from ``on_before_optimizer_step``."""

    def __init__(self, optimizer: str = "sgd", grad_hook: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 5, 3, bias=False),
            nn.BatchNorm2d(5),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(5 * 6 * 6, 3),
        )
        self.optimizer_name = optimizer
        self.grad_hook = grad_hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(dim=1) == y).float().mean(), on_step=False, on_epoch=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.grad_hook:
            grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
            self.log("grad_norm", torch.linalg.vector_norm(torch.stack(grads)))

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
        elif self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.05)
        else:
            opt = torch.optim.RMSprop(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class GraphRecorder:
    """A backend that keeps each graph dynamo hands over, then compiles it with ``inner``."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs)
        else:
            compiled = torch._dynamo.backends.registry.lookup_backend(self.inner)(gm, example_inputs)
        self.graphs.append(
            gm
        )  # after: dynamo may restart a trace (tensorifying a float) and hand it over again
        return compiled


def _loader(batches: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = BATCH * batches
    data = TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=BATCH)


def _fit(module: L.LightningModule, strategy, steps: int, **trainer_kwargs) -> L.Trainer:
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    trainer = L.Trainer(**{**TRAINER_KWARGS, "max_steps": steps, **trainer_kwargs}, strategy=strategy)
    trainer.fit(module, _loader(steps * accumulate))
    return trainer


def _written_parameters(gm: torch.fx.GraphModule) -> set[str]:
    """Parameters (graph inputs; not their ``.grad``) an in-place method (``add_``, ...) writes to: the update."""
    return {
        node.args[0].name
        for node in gm.graph.nodes
        if node.op == "call_method"
        and node.target.endswith("_")
        and node.args[0].op == "placeholder"
        and "_parameters_" in node.args[0].name
        and not node.args[0].name.endswith("_grad")
    }


def _targets(gm: torch.fx.GraphModule) -> set[object]:
    return {node.target for node in gm.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize(
    ("optimizer", "inner", "clip"),
    [("sgd", "inductor", ("norm", 0.5)), ("adamw", "aot_eager", ("value", 0.05))],
)
def test_one_graph_step_trains_as_lightnings_eager_step(optimizer, inner, clip):
    steps, accumulate = 20, 2
    settings = dict(
        accumulate_grad_batches=accumulate, gradient_clip_algorithm=clip[0], gradient_clip_val=clip[1]
    )
    torch.manual_seed(0)
    eager = StepNet(optimizer)
    eager_trainer = _fit(eager, "auto", steps, **settings)
    torch.manual_seed(0)
    compiled = StepNet(optimizer)
    recorder = GraphRecorder(inner)
    strategy = lightning_plugin.CompiledStrategy(backend=recorder, compile="always", compile_step=True)
    trainer = _fit(compiled, strategy, steps, **settings)

    stats = strategy.compile_stats
    assert stats.one_graph_fallback is None
    assert stats.one_graph_steps == steps * accumulate  # every batch went through a graph
    assert stats.graphs == 2 and stats.graph_breaks == 0  # one accumulating step, one updating step
    accumulating, updating = recorder.graphs
    params = len(list(compiled.parameters()))
    for gm in recorder.graphs:  # the forward and the backward are in both
        assert torch.conv2d in _targets(gm) and torch.autograd.grad in _targets(gm)
    assert not _written_parameters(accumulating)
    assert (
        len(_written_parameters(updating)) == params
    )  # the update writes every parameter, in the same graph

    assert trainer.global_step == eager_trainer.global_step == steps
    optimizer_progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer
    assert optimizer_progress.step.total.ready == optimizer_progress.step.total.completed == steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == eager_trainer.optimizers[0].param_groups[0]["lr"]
    tol = trajectory_tolerance(torch.float32, network_length(eager, (BATCH, 3, 8, 8)), steps)
    for (name, reference), value in zip(
        eager.state_dict().items(), compiled.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, reference, atol=bound(tol, reference), rtol=0, msg=name)
    assert set(trainer.callback_metrics) == {"train/loss", "train/acc", "grad_norm"}
    for key, reference in eager_trainer.callback_metrics.items():  # what checkpoint callbacks monitor
        value = trainer.callback_metrics[key]
        torch.testing.assert_close(value, reference, atol=bound(tol, reference), rtol=0, msg=key)
    assert trainer.progress_bar_metrics.keys() == eager_trainer.progress_bar_metrics.keys()


class RMSpropNet(StepNet):
    def __init__(self) -> None:
        super().__init__("rmsprop")


class BreakingNet(StepNet):
    """A ``training_step`` dynamo cannot keep in one graph."""

    def training_step(self, batch, batch_idx):
        torch._dynamo.graph_break()
        return super().training_step(batch, batch_idx)


class RecompilingNet(StepNet):
    """A Python counter read by ``training_step``: its value is a guard, so every step recompiles."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx) * (1.0 + 0.0 * self.calls)


@pytest.mark.parametrize(
    ("module_class", "reason", "graph_steps"),
    [
        (RMSpropNet, "RMSprop is not one of SGD, Adam, AdamW", 0),
        (BreakingNet, "graph_break", 0),
        (RecompilingNet, "recompiled at every step", 3),
    ],
)
def test_a_step_that_cannot_be_one_graph_falls_back_with_one_line(module_class, reason, graph_steps, recwarn):
    steps = 6
    torch.manual_seed(0)
    eager = module_class()
    _fit(eager, "auto", steps)
    torch.manual_seed(0)
    module = module_class()
    strategy = lightning_plugin.CompiledStrategy(backend="eager", compile="always", compile_step=True)
    trainer = _fit(module, strategy, steps)

    lines = [str(w.message) for w in recwarn if "compile_step" in str(w.message)]
    assert len(lines) == 1 and reason in lines[0] and "Compiling the forward alone" in lines[0], lines
    stats = strategy.compile_stats
    assert reason in (stats.one_graph_fallback or "") and stats.one_graph_steps == graph_steps
    assert trainer.global_step == steps
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer
    assert progress.step.total.ready == progress.step.total.completed == steps
    zero_grad = progress.zero_grad.total
    assert zero_grad.ready == zero_grad.started == zero_grad.completed == steps
    tol = trajectory_tolerance(torch.float32, network_length(eager, (BATCH, 3, 8, 8)), steps)
    for (name, reference), value in zip(
        eager.state_dict().items(), module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, reference, atol=bound(tol, reference), rtol=0, msg=name)


def test_unsupported_settings_are_named_before_the_first_step(recwarn):
    class ManualNet(StepNet):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    strategy = lightning_plugin.CompiledStrategy(backend="eager", compile="always", compile_step=True)
    _fit(ManualNet(), strategy, 2)
    assert strategy.compile_stats.one_graph_fallback == "the LightningModule uses manual optimization"
    strategy = lightning_plugin.CompiledStrategy(backend="eager", compile="always", compile_step=True)
    _fit(StepNet(), strategy, 2, precision="64-true")
    assert "precision '64-true'" in (strategy.compile_stats.one_graph_fallback or "")


# ---------------------------------------------------------------------- compile="auto" decides by measurement
_clock = [0.0]


def _virtual_clock() -> float:
    """Every read advances a millisecond; a slowed side adds a second per call (no real time enters)."""
    _clock[0] += 1e-3
    return _clock[0]


def _slow_graph_backend(gm: torch.fx.GraphModule, example_inputs):
    def run(*args):
        _clock[0] += 1.0
        return gm.forward(*args)

    return run


def _plain_backend(gm: torch.fx.GraphModule, example_inputs):
    return gm.forward


class SlowEagerNet(StepNet):
    """Its eager forward costs a virtual second; the traced one does not (dynamo drops the branch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            _clock[0] += 1.0
        return self.net(x)


@pytest.mark.parametrize(
    ("module_class", "backend", "choice"),
    [(StepNet, _slow_graph_backend, "eager"), (SlowEagerNet, _plain_backend, "compiled")],
)
def test_auto_times_the_one_graph_step_against_the_eager_step(
    module_class, backend, choice, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "decisions"))
    monkeypatch.setattr(compile_decision, "step_clock", _virtual_clock)
    caplog.set_level(logging.INFO)
    steps = WARMUP_STEPS + 1 + 2 * SAMPLES + 4
    strategy = lightning_plugin.CompiledStrategy(backend=backend, compile="auto", compile_step=True)
    trainer = _fit(module_class(grad_hook=False), strategy, steps)
    decision = trainer.strategy.compile_decision
    assert decision is not None and decision.choice == choice and decision.source == "measured"
    stats = strategy.compile_stats
    assert stats.one_graph_fallback is None
    measured_graph_steps = WARMUP_STEPS + SAMPLES
    after_decision = steps - (WARMUP_STEPS + 1 + 2 * SAMPLES)
    expected = measured_graph_steps + (after_decision if choice == "compiled" else 0)
    assert stats.one_graph_steps == expected


def test_the_recipes_module_trains_as_one_graph():
    """``ClassificationModule`` (the recipes' module): its step, epoch accuracy included, is one graph."""
    from lcv_vision.module import ClassificationModule

    def module() -> ClassificationModule:
        torch.manual_seed(
            0
        )  # lr 0.01: at the recipe's 0.1 batches of 2 blow this net up and amplify rounding
        return ClassificationModule(
            "resnet18", num_classes=3, model_kwargs={"width": 4}, channels_last=False, lr=0.01
        )

    steps = 4
    eager = module()
    eager_trainer = _fit(eager, "auto", steps)
    compiled = module()
    strategy = lightning_plugin.CompiledStrategy(backend="aot_eager", compile="always", compile_step=True)
    trainer = _fit(compiled, strategy, steps)
    stats = strategy.compile_stats
    assert stats.one_graph_fallback is None and stats.one_graph_steps == steps and stats.graphs == 1
    assert set(trainer.callback_metrics) == set(eager_trainer.callback_metrics) == {"train/loss", "train/acc"}
    tol = trajectory_tolerance(torch.float32, network_length(eager, (BATCH, 3, 8, 8)), steps)
    for key, reference in eager_trainer.callback_metrics.items():
        torch.testing.assert_close(
            trainer.callback_metrics[key], reference, atol=bound(tol, reference), rtol=0
        )
    for (name, reference), value in zip(
        eager.state_dict().items(), compiled.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, reference, atol=bound(tol, reference), rtol=0, msg=name)


def test_a_second_fit_reuses_the_graphs_and_a_resume_keeps_the_optimizer_state(tmp_path):
    """Two fits with the same settings in one process, then a resume in a new Trainer from the first's checkpoint:
    every step one graph, nothing compiled twice, and the resumed run equals an uninterrupted eager one."""
    steps = 3
    strategy = lightning_plugin.CompiledStrategy(backend="aot_eager", compile="always", compile_step=True)
    torch.manual_seed(0)
    module = StepNet("adamw", grad_hook=False)
    trainer = _fit(module, strategy, steps, enable_checkpointing=True, default_root_dir=tmp_path)
    assert strategy.compile_stats.graphs == 1 and strategy.compile_stats.one_graph_steps == steps
    checkpoint = trainer.checkpoint_callback.best_model_path
    again = lightning_plugin.CompiledStrategy(backend="aot_eager", compile="always", compile_step=True)
    _fit(module, again, steps)  # the same module and settings: dynamo's cached graph serves it
    assert again.compile_stats.graphs == 0 and again.compile_stats.one_graph_steps == steps

    torch.manual_seed(0)
    eager = StepNet("adamw", grad_hook=False)  # two epochs of the same 3 batches, uninterrupted
    L.Trainer(**{**TRAINER_KWARGS, "max_epochs": 2}, strategy="auto").fit(eager, _loader(steps))
    resumed = StepNet("adamw", grad_hook=False)
    resumed_strategy = lightning_plugin.CompiledStrategy(
        backend="aot_eager", compile="always", compile_step=True
    )
    resumed_trainer = L.Trainer(**{**TRAINER_KWARGS, "max_epochs": 2}, strategy=resumed_strategy)
    resumed_trainer.fit(resumed, _loader(steps), ckpt_path=checkpoint)  # the second epoch, in a new Trainer
    assert (
        resumed_strategy.compile_stats.one_graph_steps == steps and resumed_trainer.global_step == 2 * steps
    )
    tol = trajectory_tolerance(torch.float32, network_length(eager, (BATCH, 3, 8, 8)), 2 * steps)
    for (name, reference), value in zip(
        eager.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(value, reference, atol=bound(tol, reference), rtol=0, msg=name)


class StridedPointwiseNet(L.LightningModule):
    """A strided 1x1 convolution with 3 input channels: the case of oneDNN#6035 on AVX2 CPUs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1, stride=2)
        self.head = nn.Linear(4 * 4 * 4, 3)
        self.conv_class_seen: list[type] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.conv(x).flatten(1)), y)

    def on_train_batch_start(self, batch, batch_idx):
        self.conv_class_seen.append(type(self.conv))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_one_graph_step_runs_strided_pointwise_convs_subsampled_on_a_cpu():
    """As the compiled forward does on a CPU: the conv runs as a stride-1 conv of the subsampled input for the
    fit (its class swapped, parameters kept) and is itself again afterwards."""
    from lightning_plugin.cpu.strided_pointwise_conv import SubsampledPointwiseConv2d

    module = StridedPointwiseNet()
    strategy = lightning_plugin.CompiledStrategy(backend="aot_eager", compile="always", compile_step=True)
    _fit(module, strategy, 2)
    assert strategy.compile_stats.one_graph_steps == 2 and strategy.compile_stats.one_graph_fallback is None
    assert module.conv_class_seen == [SubsampledPointwiseConv2d] * 2
    assert type(module.conv) is nn.Conv2d
