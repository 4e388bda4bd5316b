"""compile="auto"/"always"/"never": the strategy measures compiled against eager steps and keeps the faster.

The step clock is virtual (``virtual_clock``: no real time enters it). The compiled side is made slow with a
backend that adds a second to it in every graph call, the eager side with a forward that does so only when
dynamo is not tracing it (the machine's load cannot change the outcome); both keep the model's maths, so
weights can be compared.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from unittest import mock

import lightning as L
import pytest
import torch

import lightning_plugin
from boring import TRAINER_KWARGS, TinyModule, make_loader
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from lightning_plugin.compile import decision as compile_decision
from lightning_plugin.compile.decision import DECISIONS_FILE, SAMPLES, WARMUP_STEPS, model_signature
from lightning_plugin.config import CompileConfig
from lightning_plugin.kernel_choice.cache import CACHE_DIR_ENV

HERE = os.path.dirname(__file__)
DELAY_S = 1.0
_delays = [0.0]


_reads = [0]
TICK_S = 1e-3


def virtual_clock() -> float:
    """Purely virtual: every read advances it by a millisecond (a step costs 1 ms on either side), and a
    slowed side adds DELAY_S per call. The machine's speed and load never enter a decision."""
    _reads[0] += 1
    return _reads[0] * TICK_S + _delays[0]


def _delay() -> None:
    _delays[0] += DELAY_S


#: warm-up, one eager warm-up step, then SAMPLES each way
STEPS_TO_DECIDE = WARMUP_STEPS + 1 + 2 * SAMPLES


def slow_backend(gm: torch.fx.GraphModule, example_inputs):
    """A compiled forward that computes what eager does, a little later."""

    def run(*args):
        _delay()
        return gm.forward(*args)

    return run


def plain_backend(gm: torch.fx.GraphModule, example_inputs):
    return gm.forward


class SlowEagerModule(TinyModule):
    """Its eager forward sleeps; the traced one does not (dynamo drops the branch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            _delay()
        return self.net(x)


@pytest.fixture(autouse=True)
def _own_decision_cache_and_clock(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "decisions"))
    monkeypatch.setattr(compile_decision, "step_clock", virtual_clock)


def _fit(module, backend, steps: int = 16, **settings) -> L.Trainer:
    strategy = lightning_plugin.CompiledStrategy(backend=backend, **settings)
    trainer = L.Trainer(
        **{**TRAINER_KWARGS, "max_epochs": 1, "limit_train_batches": steps}, strategy=strategy
    )
    trainer.fit(module, make_loader(n=8 * steps, batch_size=8))
    return trainer


def _decision_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compile='auto'" in r.getMessage()]


def test_slow_compiled_side_switches_to_eager_with_one_line(caplog):
    caplog.set_level(logging.INFO)
    trainer = _fit(TinyModule(), slow_backend)
    decision = trainer.strategy.compile_decision
    assert decision is not None and decision.choice == "eager" and decision.source == "measured"
    assert decision.speedup < 1.0 and decision.steps == SAMPLES
    lines = _decision_lines(caplog)
    assert len(lines) == 1, lines
    assert f"{decision.speedup:.2f}x" in lines[0] and "compile='always'" in lines[0]
    stats = trainer.strategy.compile_stats
    assert stats.decision == "eager" and stats.speedup == decision.speedup
    assert (
        stats.as_dict()["trains_eagerly"] == 1.0 and stats.as_dict()["speedup_vs_eager"] == decision.speedup
    )


def test_fast_compiled_side_keeps_compiling():
    trainer = _fit(SlowEagerModule(), plain_backend)
    decision = trainer.strategy.compile_decision
    assert decision is not None and decision.choice == "compiled" and decision.speedup > 1.0
    graphs = trainer.strategy.compile_stats.graphs
    assert graphs >= 1


def test_decision_waits_for_enough_steps():
    """A fit shorter than the measurement keeps compiling and decides nothing (nothing cached)."""
    trainer = _fit(TinyModule(), slow_backend, steps=STEPS_TO_DECIDE - 2)
    assert trainer.strategy.compile_decision is None
    assert trainer.strategy.compile_stats.decision is None


@pytest.mark.parametrize("mode, graphs", [("always", True), ("never", False)])
def test_always_and_never_override_the_measurement(mode, graphs):
    trainer = _fit(TinyModule(), slow_backend, compile=mode)
    decision = trainer.strategy.compile_decision
    assert decision.source == mode and decision.speedup is None
    assert decision.choice == ("compiled" if graphs else "eager")
    assert (trainer.strategy.compile_stats.graphs > 0) == graphs


def test_bad_compile_value_is_one_line():
    expected = r"CompileConfig.compile='sometimes' is not one of \['auto', 'always', 'never'\]"
    with pytest.raises(ValueError, match=expected):
        CompileConfig(compile="sometimes")


def test_weights_after_switching_equal_an_eager_fit():
    torch.manual_seed(0)
    switched = TinyModule()
    torch.manual_seed(0)
    eager = TinyModule()
    trainer = _fit(switched, slow_backend, steps=STEPS_TO_DECIDE + 3)
    assert trainer.strategy.compile_decision.choice == "eager"
    L.Trainer(**{**TRAINER_KWARGS, "limit_train_batches": STEPS_TO_DECIDE + 3}).fit(
        eager, make_loader(n=8 * (STEPS_TO_DECIDE + 3), batch_size=8)
    )
    # compiled steps before the switch sum in another order; their errors carry through all the steps
    tol = trajectory_tolerance(torch.float32, network_length(eager, (8, 3, 8, 8)), STEPS_TO_DECIDE + 3)
    for key, value in eager.state_dict().items():
        atol = bound(tol, value)
        torch.testing.assert_close(switched.state_dict()[key], value, atol=atol, rtol=0, msg=key)


def test_cached_eager_decision_compiles_nothing_in_a_new_strategy(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _fit(TinyModule(), slow_backend)
    assert (tmp_path / "decisions" / DECISIONS_FILE).exists()
    torch._dynamo.reset()
    caplog.clear()
    trainer = _fit(TinyModule(), slow_backend, steps=4)
    decision = trainer.strategy.compile_decision
    assert decision.choice == "eager" and decision.source == "cached"
    assert trainer.strategy.compile_stats.graphs == 0 and trainer.strategy.compile_stats.frame_records == []
    lines = _decision_lines(caplog)
    assert len(lines) == 1 and "without compiling" in lines[0], lines


def test_cached_eager_decision_in_a_new_process(tmp_path):
    """The second process finds the first one's decision on disk and compiles nothing."""
    env = {**os.environ, CACHE_DIR_ENV: str(tmp_path / "decisions")}
    results = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "decision_script.py"), str(out), "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(out.read_text()))
    assert (
        results[0]["decision"] == "eager" and results[0]["source"] == "measured" and results[0]["graphs"] > 0
    )
    assert (
        results[1]["decision"] == "eager" and results[1]["source"] == "cached" and results[1]["graphs"] == 0
    )


def test_cached_compiled_decision_skips_the_measurement():
    first = _fit(SlowEagerModule(), plain_backend)
    assert first.strategy.compile_decision.source == "measured"
    trainer = _fit(SlowEagerModule(), plain_backend, steps=4)
    assert trainer.strategy.compile_decision.source == "cached"
    assert trainer.strategy.compile_decision.choice == "compiled"


def test_several_fits_of_one_trainer_decide_once():
    strategy = lightning_plugin.CompiledStrategy(backend=slow_backend)
    module = TinyModule()
    trainer = L.Trainer(**{**TRAINER_KWARGS, "limit_train_batches": 16}, strategy=strategy)
    for epochs in (1, 2):
        trainer.fit_loop.max_epochs = epochs
        trainer.fit(module, make_loader(n=128, batch_size=8))
        assert trainer.current_epoch == epochs and strategy.compile_decision.choice == "eager"
    assert strategy.compile_decision.source == "measured"  # the second fit reused it, not the disk cache
    # evaluation after an eager decision stays eager: nothing compiled for it
    trainer.validate(module, make_loader(n=8, batch_size=8))
    assert strategy.compile_stats.graphs == 0


def _signature(module, shape=(8, 3, 8, 8), precision="32-true", backend="inductor", **settings):
    compiler = lightning_plugin.CompiledStrategy(backend=backend, **settings)._compiler
    return model_signature(module, (torch.zeros(shape), torch.zeros(shape[0])), precision, compiler)


def test_cache_key_changes_with_input_model_precision_and_device():
    from lightning_plugin.compile.decision import decision_fingerprint

    base = _signature(TinyModule())
    assert _signature(TinyModule()) == base  # same model, fresh weights: same key
    assert _signature(TinyModule(), shape=(8, 3, 16, 16)) != base
    assert _signature(TinyModule(), shape=(4, 3, 8, 8)) != base
    assert _signature(TinyModule(channels=8)) != base
    assert _signature(SlowEagerModule()) != base
    assert _signature(TinyModule(), precision="bf16-mixed") != base
    assert _signature(TinyModule(), backend="aot_eager") != base
    assert _signature(TinyModule(), tune_cpu=False) != base
    # the Inductor options actually given (the CPU tuning's) are part of it: a retuned strategy measures anew
    compiled = lightning_plugin.CompiledStrategy()._compiler
    module = TinyModule()
    assert compiled.compile(module, torch.device("cpu"))
    assert compiled.inductor_options.get("cpp_wrapper") is True
    batch = (torch.zeros(8, 3, 8, 8), torch.zeros(8))
    tuned = model_signature(module, batch, "32-true", compiled)
    assert tuned != base
    # so is the version of the CPU graph changes: a decision measured before they changed is measured anew
    from lightning_plugin.cpu import graph_passes as cpu_graph_passes

    assert compiled.graph_passes == cpu_graph_passes.source_hash()
    with mock.patch.object(cpu_graph_passes, "source_hash", return_value="lcv-cpu-training-another"):
        assert model_signature(module, batch, "32-true", compiled) != tuned
    compiled.restore(module)
    cpu = decision_fingerprint(torch.device("cpu"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert decision_fingerprint(torch.device("cpu")) != cpu
    finally:
        torch.set_num_threads(threads)
    assert decision_fingerprint(torch.device("meta")) != cpu


@pytest.mark.timeout(600)
def test_ddp_ranks_follow_rank_zero(tmp_path):
    """Two gloo ranks; only rank 0's compiled side is slow, so only rank 0's measurement says eager."""
    out = tmp_path / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", CACHE_DIR_ENV: str(tmp_path / "decisions")}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "decision_script.py"), str(out), "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"ddp.json.rank{r}").read_text()) for r in range(2)]
    assert [r["decision"] for r in ranks] == ["eager", "eager"]
    assert ranks[0]["speedup"] == ranks[1]["speedup"] < 1.0
