"""``kernels="auto"``: selection by measurement, with a fake clock (no GPU here) and the Triton interpreter.

The timer is injected, so the choices are checked against known timings; the numerics are real (the fused ops
run their Triton kernels in the interpreter unless a test is about structure only and uses the references).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kernels.conv_bn_act
from lightning_plugin import KNOWN_KERNELS, CompileConfig, CompiledStrategy
from lightning_plugin import kernel_selection
from lightning_plugin.callbacks import TrainingMonitor
from lightning_plugin.kernel_cache import CACHE_DIR_ENV, CACHE_FILE_NAME
from lightning_plugin.kernel_measurement import MedianTimer
from lightning_plugin.kernel_selection import MIN_SPEEDUP, select_kernels
from lightning_plugin.substitution import substituted_modules
from vision.models.resnet import BasicBlock, ResNet

HERE = os.path.dirname(__file__)
EAGER = CompileConfig(backend="eager")  # both sides compiled by dynamo with the eager backend: fast on CPU


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


def chain(*channels: int) -> nn.Sequential:
    """Blocks ``channels[i] -> channels[i+1]``; the outer Sequential holds no chain itself, so only the
    blocks are rewritten (paths "0", "1", ...)."""
    return nn.Sequential(*(conv_block(a, b) for a, b in zip(channels[:-1], channels[1:])))


class FakeClock:
    """Seconds per step by the block's input shape (``signature.inputs``); records every call."""

    def __init__(self, times: dict[str, tuple[float, float]]) -> None:
        self.times = times  # inputs -> (fused seconds, Inductor seconds)
        self.default: tuple[float, float] | None = None  # for inputs not in ``times``
        self.calls: list[tuple[str, str]] = []

    def __call__(self, step, *, arm, signature, device) -> float:
        self.calls.append((arm, signature.inputs))
        timing = self.times.get(signature.inputs, self.default)
        if timing is None:
            raise KeyError(f"FakeClock has no timing for inputs {signature.inputs}")
        fused, inductor = timing
        return fused if arm == "fused" else inductor


def select(model: nn.Module, x: torch.Tensor, timer, cache_dir: Path, **kwargs):
    """``select_kernels`` with both sides compiled by the eager backend (fast on CPU) and a private cache."""
    return select_kernels(model, x, timer=timer, cache_dir=str(cache_dir), **{"config": EAGER, **kwargs})


@pytest.fixture
def reference_ops(monkeypatch):
    """The fused ops on their PyTorch references, for tests about the selection's structure, not numerics."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_choices_follow_the_timings(tmp_path):
    model = chain(3, 4, 5, 6, 6, 6)
    model.train()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 6, 6)
    clock = FakeClock(
        {
            "2x3x6x6": (1.0, 1.5),  # 1.5x: kept
            "2x4x6x6": (1.0, 1.03),  # faster, but under 1.05x: eager
            "2x5x6x6": (1.0, 0.8),  # slower: eager
            "2x6x6x6": (1.0, MIN_SPEEDUP),  # exactly the threshold: kept (two blocks, one measurement)
        }
    )
    selection = select(model, x, clock, tmp_path)
    chosen = [d.chosen for d in selection.decisions]
    assert chosen == ["conv_bn_act", "eager", "eager", "conv_bn_act", "conv_bn_act"]
    assert [d.ratio for d in selection.decisions] == pytest.approx([1.5, 1.03, 0.8, MIN_SPEEDUP, MIN_SPEEDUP])
    assert all(d.correct for d in selection.decisions)
    assert substituted_modules(model) == ["0", "3", "4"]
    assert [r.path for r in selection.report.replacements] == ["0", "3", "4"]
    assert {p for p, _ in selection.report.skipped} >= {"1", "2"}
    assert len(clock.calls) == 8  # one fused and one Inductor timing per distinct signature, not per block
    assert {d.signature.mode for d in selection.decisions} == {"train"}
    # The recording forward ran in train mode without touching the BatchNorm running statistics.
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, buffers[key], rtol=0, atol=0, msg=key)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


@pytest.mark.parametrize("fault", ["output", "gradient", "running stats", "eval mode only"])
def test_wrong_numerics_are_never_chosen_even_when_faster(fault, monkeypatch, tmp_path):
    real = kernels.conv_bn_act.conv_bn_act_forward

    def faulty(conv, bn, x, activation="none", residual=None):
        out = real(conv, bn, x, activation, residual)
        if fault == "output" or (fault == "eval mode only" and not bn.training):
            return out + 0.5
        if fault == "gradient":
            return _ScaleGrad.apply(out)
        if fault == "running stats" and bn.training:
            bn.running_mean.add_(0.5)
        return out

    monkeypatch.setattr(kernels.conv_bn_act, "conv_bn_act_forward", faulty)
    monkeypatch.setattr("lightning_plugin.substitution.conv_bn_act_forward", faulty, raising=False)
    model = chain(3, 4)
    clock = FakeClock({"2x3x6x6": (0.1, 1.0)})  # the wrong kernel would be 10x faster
    (decision,) = select(model, torch.randn(2, 3, 6, 6), clock, tmp_path).decisions
    assert decision.chosen == "eager" and decision.correct is False
    expected = {
        "output": "output 0",
        "gradient": "gradient of",
        "running stats": "buffer 1.running_mean",
        "eval mode only": "eval mode: output 0",
    }[fault]
    assert expected in decision.reason, decision.reason
    assert clock.calls == []  # an incorrect block is not even timed
    assert substituted_modules(model) == []


def _cached_run(cache_dir: Path, model: nn.Module, clock: FakeClock):
    return select(copy.deepcopy(model), torch.randn(2, 3, 6, 6), clock, cache_dir)


def test_cache_is_reused_and_invalidated_by_a_version_change(tmp_path, monkeypatch):
    model = chain(3, 4, 4)
    times = {"2x3x6x6": (1.0, 1.2), "2x4x6x6": (1.0, 0.9)}
    first_clock = FakeClock(times)
    first = _cached_run(tmp_path, model, first_clock)
    assert len(first_clock.calls) == 4 and (tmp_path / CACHE_FILE_NAME).exists()

    second_clock = FakeClock(times)
    second = _cached_run(tmp_path, model, second_clock)
    assert second_clock.calls == []  # nothing measured again
    assert [(d.chosen, d.ratio) for d in second.decisions] == [(d.chosen, d.ratio) for d in first.decisions]
    assert all(d.cached for d in second.decisions) and not any(d.cached for d in first.decisions)

    monkeypatch.setattr(torch, "__version__", "99.0.0")  # a new torch: Inductor's side may have changed
    third_clock = FakeClock(times)
    third = _cached_run(tmp_path, model, third_clock)
    assert len(third_clock.calls) == 4 and not any(d.cached for d in third.decisions)


def test_corrupt_cache_warns_once_and_measures_again(tmp_path):
    (tmp_path / CACHE_FILE_NAME).write_text("{ not json")
    model = chain(3, 4)
    clock = FakeClock({"2x3x6x6": (1.0, 1.2)})
    with pytest.warns(UserWarning, match="unreadable decision cache") as record:
        selection = _cached_run(tmp_path, model, clock)
    assert len([w for w in record if "decision cache" in str(w.message)]) == 1
    assert len(clock.calls) == 2 and selection.decisions[0].chosen == "conv_bn_act"
    assert json.loads((tmp_path / CACHE_FILE_NAME).read_text())["entries"]  # rewritten, readable again
    again = FakeClock({"2x3x6x6": (1.0, 1.2)})
    _cached_run(tmp_path, model, again)
    assert again.calls == []


def test_a_model_sized_rewrite_stays_eager_and_nested_blocks_are_measured_alone(reference_ops, tmp_path):
    model = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=3, width=4, stem="cifar")
    clock = FakeClock({s: (1.0, 2.0) for s in ("2x4x8x8", "2x8x4x4", "2x16x2x2")})
    by_path = {d.path: d for d in select(model, torch.randn(2, 3, 8, 8), clock, tmp_path).decisions}
    assert by_path["ResNet"].chosen == "eager" and by_path["ResNet"].signature is None
    assert "holds 7 other rewritten blocks" in by_path["ResNet"].reason
    assert by_path["layer2.0"].chosen == by_path["layer2.0.downsample"].chosen == "conv_bn_act"
    assert by_path["layer2.0"].signature.key != by_path["layer2.0.downsample"].signature.key
    assert "ResNet" not in substituted_modules(model)


def test_every_block_is_compiled_despite_dynamos_recompile_limit(reference_ops, tmp_path):
    # 10 signatures x 2 sides = 20 compiles, past dynamo's recompile_limit (8) for one code object.
    from torch._dynamo.utils import counters

    model = chain(*range(3, 14))
    times = {f"2x{c}x6x6": (1.0, 1.2) for c in range(3, 13)}
    before = counters["stats"]["unique_graphs"]
    selection = select(model, torch.randn(2, 3, 6, 6), FakeClock(times), tmp_path)
    assert counters["stats"]["unique_graphs"] - before >= 20
    assert all(d.chosen == "conv_bn_act" for d in selection.decisions)


def test_eval_selection_times_the_forward_only(tmp_path):
    model = chain(3, 4)
    grads_after_step = []

    def clock(step, *, arm, signature, device):
        step()
        grads_after_step.append([p.grad for p in model.parameters()])
        return 1.0 if arm == "fused" else 1.2

    selection = select(model, torch.randn(2, 3, 6, 6), clock, tmp_path, training=False)
    (decision,) = selection.decisions
    assert decision.signature.mode == "eval" and decision.chosen == "conv_bn_act"
    assert len(grads_after_step) == 2


def test_autocast_dtype_is_measured_and_checked(reference_ops, tmp_path):
    # bf16 on the references: the Triton interpreter has no bf16 (its bf16 results are wrong, and the
    # selection rejects them: checked by running this test without the fixture).
    model = chain(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        selection = select(model, torch.randn(2, 3, 6, 6), FakeClock({"2x3x6x6": (1.0, 1.2)}), tmp_path)
    (decision,) = selection.decisions
    assert decision.signature.dtype == "bfloat16" and decision.correct and decision.chosen == "conv_bn_act"


def test_median_timer_warms_up_then_takes_the_median():
    calls = []
    timer = MedianTimer(warmup=2, repeats=5, steps=3)
    seconds = timer(lambda: calls.append(1), arm="fused", signature=None, device=torch.device("cpu"))
    assert len(calls) == 2 + 5 * 3 and 0 <= seconds < 0.01
    with pytest.raises(ValueError, match="positive counts"):
        MedianTimer(repeats=0)


def test_inductor_is_the_baseline_by_default(tmp_path):
    model = chain(3, 4)
    compiled = []
    real_compile = torch.compile

    def spy(fn, **kwargs):
        compiled.append(kwargs.get("backend"))
        return real_compile(fn, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", spy)
        clock = FakeClock({"1x3x5x5": (1.0, 1.2)})
        selection = select(model, torch.randn(1, 3, 5, 5), clock, tmp_path, config=CompileConfig())
    assert compiled == ["inductor", "inductor"]  # the fused block and the block alone
    assert selection.decisions[0].signature.compiler == "inductor:default"
    assert selection.decisions[0].chosen == "conv_bn_act"


# ---------------------------------------------------------------------------------------------------------
# Under DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_ddp_ranks_run_rank_zeros_decisions(tmp_path):
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    script = os.path.join(HERE, "kernel_selection_ddp_script.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), port, str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=280)
        assert proc.returncode == 0, err[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Rank 1's clock says the opposite of rank 0's; it is never asked, and runs rank 0's graph.
    assert ranks[0]["chosen"] == ["conv_bn_act", "eager"]
    assert ranks[1]["chosen"] == ranks[0]["chosen"]
    assert ranks[1]["rewritten"] == ranks[0]["rewritten"] == ["0"]
    assert ranks[0]["timer_calls"] == 4 and ranks[1]["timer_calls"] == 0


# ---------------------------------------------------------------------------------------------------------
# Through the Trainer


class BlockModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = chain(3, 4, 5)
        self.head = nn.Linear(5, 3)
        self.rewritten_in_training: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.rewritten_in_training.append(substituted_modules(self))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=4)


def _trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=2, limit_val_batches=1,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_auto_stays_none_on_cpu_through_the_trainer(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))

    def no_timing(*args, **kwargs):
        raise AssertionError("nothing is measured on CPU")

    monkeypatch.setattr(kernel_selection, "default_timer", lambda: no_timing)
    module = BlockModule()
    strategy = CompiledStrategy(backend="eager")
    _trainer(strategy=strategy, num_sanity_val_steps=1).fit(module, _loader(), _loader(4))
    assert strategy.kernel_decisions == [] and strategy.substituted_blocks() == []
    assert module.rewritten_in_training == [[], []]


@pytest.fixture
def auto_as_on_cuda(monkeypatch, tmp_path):
    """What "auto" resolves to on a GPU (every kernel), on this CPU, with a fake clock and a private cache."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(CompileConfig, "resolve_kernels", lambda self, device: frozenset(KNOWN_KERNELS))
    clock = FakeClock({"4x3x6x6": (1.0, 1.3), "4x4x6x6": (1.0, 0.9)})
    monkeypatch.setattr(kernel_selection, "default_timer", lambda: clock)
    return clock


def test_trainer_selects_at_the_first_forward_and_logs_the_decisions(auto_as_on_cuda, caplog, tmp_path):
    clock = auto_as_on_cuda
    module = BlockModule()
    strategy = CompiledStrategy(backend="eager")
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    with caplog.at_level(logging.INFO):
        # The first forward is the sanity check: eval mode, under inference_mode; training is what is timed.
        monitor = TrainingMonitor(log_every_n_steps=1)
        trainer = _trainer(strategy=strategy, num_sanity_val_steps=1, logger=logger, callbacks=[monitor])
        trainer.fit(module, _loader(), _loader(4))
    assert len(clock.calls) == 4  # one selection, two signatures, two sides each
    decisions = strategy.kernel_decisions
    assert [(d.path, d.chosen) for d in decisions] == [("net.0", "conv_bn_act"), ("net.1", "eager")]
    assert {d.signature.mode for d in decisions} == {"train"}
    assert module.rewritten_in_training == [["net.0"], ["net.0"]]
    assert not strategy.compile_stats.fell_back and strategy.compile_stats.graph_breaks == 0
    assert substituted_modules(module) == []  # restored after fit
    assert "measuring 2 block signature(s)" in caplog.text
    assert "measured 2 block signature(s) in" in caplog.text
    assert "net.1" in caplog.text and "1.3x" in caplog.text  # the table

    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    text = acc.Tensors("compile/kernel_decisions/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "`net.0` | conv_bn_act | 1.3x | yes" in text and "`net.1` | eager | 0.9x | yes" in text
    content = acc.PluginTagToContent("hparams")
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert hparams.session_start_info.hparams["compile/kernels"].string_value == "auto"
    assert acc.Scalars("final/kernel_blocks_fused")[-1].value == 1.0

    # A second fit (a new run, or a resume) finds its decisions in the cache: nothing is measured.
    caplog.clear()
    clock.calls.clear()
    second = BlockModule()
    strategy = CompiledStrategy(backend="eager")
    with caplog.at_level(logging.INFO):
        _trainer(strategy=strategy, num_sanity_val_steps=0).fit(second, _loader())
    assert clock.calls == []
    assert "used cached decisions for 2 block signature(s)" in caplog.text
    assert second.rewritten_in_training == [["net.0"], ["net.0"]]
    assert all(d.cached for d in strategy.kernel_decisions)


class ResNetModule(L.LightningModule):
    def __init__(self, call_forward_directly: bool) -> None:
        super().__init__()
        self.net = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=3, width=4, stem="cifar")
        self.call_forward_directly = call_forward_directly
        self.rewritten_in_training: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.forward(x) if self.call_forward_directly else self(x)
        self.rewritten_in_training.append(substituted_modules(self))
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("call_forward_directly", [False, True], ids=["self(x)", "self.forward(x)"])
def test_regional_compile_selects_before_any_block_is_traced(
    call_forward_directly, auto_as_on_cuda, reference_ops
):
    clock = auto_as_on_cuda
    clock.default = (1.0, 1.2)  # every block measured is kept
    module = ResNetModule(call_forward_directly)
    strategy = CompiledStrategy(backend="eager", regional=True)
    data = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))), batch_size=4)
    blocks = ["net.layer1.0", "net.layer2.0", "net.layer2.0.downsample", "net.layer3.0",
              "net.layer3.0.downsample", "net.layer4.0", "net.layer4.0.downsample"]
    if call_forward_directly:
        # The root's pre-hook never fires and the first compiled block cannot know its neighbours' inputs:
        # nothing is measured, so nothing stays fused.
        with pytest.warns(UserWarning, match="was not called as a module"):
            _trainer(strategy=strategy, num_sanity_val_steps=0).fit(module, data)
        assert clock.calls == [] and module.rewritten_in_training == [[], []]
        assert not any(d.fused for d in strategy.kernel_decisions)
        return
    _trainer(strategy=strategy, num_sanity_val_steps=0).fit(module, data)
    assert clock.calls
    assert module.rewritten_in_training == [blocks, blocks]  # the stem's ResNet rewrite holds the rest: eager
    # Blocks are measured on copies without the compiler's wrappers (or their gradients would go to the
    # model's blocks); the recording forward compiled nothing (else training would recompile for grad mode).
    assert all(d.correct for d in strategy.kernel_decisions if d.signature is not None)
    assert not [r for r in strategy.compile_stats.recompile_reasons if "grad_mode" in r]


def test_validate_alone_times_the_forward_in_eval_mode(auto_as_on_cuda):
    strategy = CompiledStrategy(backend="eager")
    _trainer(strategy=strategy).validate(BlockModule(), _loader(4))
    assert {d.signature.mode for d in strategy.kernel_decisions} == {"eval"}
    assert [d.chosen for d in strategy.kernel_decisions] == ["conv_bn_act", "eager"]
