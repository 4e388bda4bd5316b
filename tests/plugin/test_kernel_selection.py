"""``kernels="auto"``: the selection logic, with a fake clock (no GPU here) and the Triton interpreter.

The timer is injected, so the choices are checked against known timings; the numerics are real (the fused ops
run their Triton kernels in the interpreter unless a test is about structure only and uses the references).
The selection through the Trainer and under DDP: ``test_kernel_selection_trainer.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lcv_kernels.conv_bn_act
from lcv_vision.models.resnet import BasicBlock, ResNet
from lightning_plugin import CompileConfig
from lightning_plugin.kernel_choice.cache import CACHE_FILE_NAME
from lightning_plugin.kernel_choice.measurement import MedianTimer
from lightning_plugin.kernel_choice.selection import MIN_SPEEDUP
from lightning_plugin.kernel_choice.substitution import substituted_modules
from selection_helpers import FakeClock, chain, select, use_reference_ops


@pytest.fixture
def reference_ops(monkeypatch):
    """The fused ops on their PyTorch references, for tests about the selection's structure, not numerics."""
    use_reference_ops(monkeypatch)  # and no oneDNN: see its docstring


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
    real = lcv_kernels.conv_bn_act.conv_bn_act_forward

    def faulty(conv, bn, x, activation="none", residual=None):
        out = real(conv, bn, x, activation, residual)
        if fault == "output" or (fault == "eval mode only" and not bn.training):
            return out + 0.5
        if fault == "gradient":
            return _ScaleGrad.apply(out)
        if fault == "running stats" and bn.training:
            bn.running_mean.add_(0.5)
        return out

    monkeypatch.setattr(lcv_kernels.conv_bn_act, "conv_bn_act_forward", faulty)
    monkeypatch.setattr("lightning_plugin.blocks._run.conv_bn_act_forward", faulty)
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


def test_cache_is_reused_and_invalidated_by_a_version_change(reference_ops, tmp_path, monkeypatch):
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


def test_corrupt_cache_warns_once_and_measures_again(reference_ops, tmp_path):
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


def test_eval_selection_times_the_forward_only(reference_ops, tmp_path):
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


def test_median_timer_warms_up_then_takes_the_median(monkeypatch):
    import types

    import lightning_plugin.kernel_choice.measurement as measurement

    calls = []
    reads = iter([0.0, 3.0, 10.0, 16.0, 20.0, 23.0, 30.0, 39.0, 40.0, 43.0])  # samples 1, 2, 1, 3, 1 s a step
    monkeypatch.setattr(measurement, "time", types.SimpleNamespace(perf_counter=lambda: next(reads)))
    timer = MedianTimer(warmup=2, repeats=5, steps=3)
    seconds = timer(lambda: calls.append(1), arm="fused", signature=None, device=torch.device("cpu"))
    assert len(calls) == 2 + 5 * 3 and seconds == 1.0
    with pytest.raises(ValueError, match="positive counts"):
        MedianTimer(repeats=0)


def test_inductor_is_the_baseline_by_default(tmp_path):
    """The default config asks torch.compile for Inductor on both sides. The spy records the request and
    compiles it with ``aot_eager`` (the same dynamo and AOTAutograd graphs): what Inductor generates is not
    this test's subject, and its two C++ builds a side were most of the test's time."""
    model = chain(3, 4)
    compiled = []
    real_compile = torch.compile

    def spy(fn, **kwargs):
        compiled.append(kwargs.get("backend"))
        return real_compile(fn, **{**kwargs, "backend": "aot_eager"})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", spy)
        clock = FakeClock({"1x3x5x5": (1.0, 1.2)})
        selection = select(model, torch.randn(1, 3, 5, 5), clock, tmp_path, config=CompileConfig())
    assert compiled == ["inductor", "inductor"]  # the fused block and the block alone
    assert selection.decisions[0].signature.compiler == "inductor:default"
    assert selection.decisions[0].chosen == "conv_bn_act"
