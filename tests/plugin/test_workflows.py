"""The compiled strategy as users run it: many fits in one process, copies of the module, honest counters.

Tests of what compiled runs do use ``compile="always"``: with ``"auto"`` a short fit runs some steps eagerly
(its measurement, see test_compile_decision.py) and validates eagerly until it has decided.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from boring import TRAINER_KWARGS, TinyModule, make_loader
from lightning_plugin import CompileConfig, CompiledStrategy

TRAIN_STEPS, VAL_STEPS = 3, 2  # make_loader(): 20 samples in batches of 8; validation: 12 samples


def fit(module, strategy, **overrides):
    trainer = L.Trainer(strategy=strategy, **{**TRAINER_KWARGS, **overrides})
    trainer.fit(module, make_loader(), make_loader(n=12, seed=1))
    return trainer


class GraphRunCounter:
    """A backend that runs each graph eagerly and counts how often compiled graphs run.

    One instance serves every fit of a test, as a user's backend would: it tells independently
    of the strategy's own counters whether a forward ran through compiled code.
    """

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


# ------------------------------------------------------------------------------ defect 1: many fits
@pytest.mark.parametrize("new_module_each_fit", [False, True], ids=["same-module", "new-module-per-fold"])
def test_every_fit_of_many_runs_compiled(new_module_each_fit):
    counter = GraphRunCounter()
    module = TinyModule()
    for fold in range(5):  # dynamo's limit of 8 entries ran out at the 4th fit
        if new_module_each_fit:
            module = TinyModule()
        strategy = CompiledStrategy(backend=counter, compile="always")
        before = counter.runs
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "dynamo gave up" either
            warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
            fit(module, strategy)
        assert counter.runs - before >= TRAIN_STEPS + VAL_STEPS, f"fit {fold + 1} ran (partly) eagerly"
        stats = strategy.compile_stats
        assert not stats.skipped_frames and not stats.fell_back, stats.summary()
        # Either this fit compiled its graphs or it reused the ones compiled by an earlier fit.
        assert stats.graphs + stats.reused_frames >= 1, stats.summary()


class ShapeRecorder(GraphRunCounter):
    """Also records, for each graph compiled, whether dynamo made any input size dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.dynamic: list[bool] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        sizes = [s for v in values if isinstance(v, torch.Tensor) for s in v.shape]
        self.dynamic.append(any(isinstance(v, torch.SymInt) for v in [*values, *sizes]))
        return super().__call__(gm, example_inputs)


def test_a_fit_of_another_input_size_compiles_static_graphs():
    """Dynamo remembers the sizes that changed between compiles of a code; a second model through the same
    ``forward`` got dynamic-shape graphs (slower steps) before the strategy forgot that at each compile."""
    recorder = ShapeRecorder()
    for size in (8, 12):
        trainer = L.Trainer(strategy=CompiledStrategy(backend=recorder, compile="always"), **TRAINER_KWARGS)
        graphs_before = len(recorder.dynamic)
        trainer.fit(TinyModule(), make_loader(n=16, size=size))  # two full batches: no smaller last one
        assert recorder.dynamic[graphs_before:] == [False], recorder.dynamic


def test_alternating_compile_settings_stay_compiled():
    """A sweep over compile settings: each setting's graphs must not use up the others' room in dynamo's
    cache."""
    counters = [GraphRunCounter(), GraphRunCounter(), GraphRunCounter()]
    module = TinyModule()
    for fit_index in range(5):
        counter = counters[fit_index % 3]
        before = counter.runs
        fit(module, CompiledStrategy(backend=counter, compile="always"))
        assert counter.runs - before >= TRAIN_STEPS + VAL_STEPS, f"fit {fit_index + 1} ran (partly) eagerly"


def test_dynamo_giving_up_on_a_frame_is_reported():
    strategy = CompiledStrategy(backend="aot_eager", compile="always")
    # One graph per frame allowed: the smaller last batch and validation would need more, so dynamo gives up.
    with (
        torch._dynamo.config.patch(recompile_limit=1),
        pytest.warns(UserWarning, match=r"ran .*eagerly.*recompile limit"),
    ):
        fit(TinyModule(), strategy)
    stats = strategy.compile_stats
    assert stats.skipped_frames and "recompile limit" in stats.skipped_frames[0]
    assert "ran eagerly" in stats.summary()
    assert stats.as_dict()["skipped_frames"] >= 1


class LoopBreakModule(TinyModule):
    """A graph break inside a loop: dynamo skips the whole frame."""

    def forward(self, x):
        for _ in range(2):
            x = x + 0.0
            torch._dynamo.graph_break()
        return self.net(x)


def test_a_skipped_frame_is_reported():
    strategy = CompiledStrategy(backend="aot_eager")
    with pytest.warns(UserWarning, match=r"ran .*eagerly"):
        fit(LoopBreakModule(), strategy)
    assert strategy.compile_stats.skipped_frames, strategy.compile_stats.summary()


# ------------------------------------------------------------------------------ defect 2: copies
class CopiesDuringFit(Callback):
    """What EMA/teacher callbacks and checkpoint-the-object code do at the start of fit."""

    def on_fit_start(self, trainer, pl_module):
        self.copy = copy.deepcopy(pl_module)
        self.pickled = pickle.dumps(pl_module)
        buffer = io.BytesIO()
        torch.save(pl_module, buffer)
        self.saved = buffer.getvalue()
        x = torch.randn(2, 3, 8, 8)
        self.live_output = pl_module(x).detach()
        with torch.no_grad():
            for p in self.copy.parameters():
                p.zero_()
        self.zeroed_copy_output = self.copy(x).detach()
        self.copy_is_patched = "forward" in self.copy.__dict__
        self.x = x


def test_a_copy_made_during_fit_is_an_independent_eager_module():
    module = TinyModule()
    callback = CopiesDuringFit()
    strategy = CompiledStrategy(backend="aot_eager")
    fit(module, strategy, callbacks=[callback])
    assert strategy.compile_stats.graphs >= 1  # the live module was compiled
    assert not callback.copy_is_patched, "the copy must not carry the compiled forward"
    # A module with all-zero weights outputs zeros; the live (compiled) module does not.
    torch.testing.assert_close(callback.zeroed_copy_output, torch.zeros_like(callback.zeroed_copy_output))
    assert callback.live_output.abs().sum() > 0
    assert "forward" not in callback.copy.__dict__  # still eager after fit
    for blob in (pickle.loads(callback.pickled), torch.load(io.BytesIO(callback.saved), weights_only=False)):
        assert "forward" not in blob.__dict__
        blob.eval()
        assert blob(callback.x).shape == (2, 3)


# ------------------------------------------------------------------------------ defect 3: graph breaks
class BranchingModule(TinyModule):
    """A data-dependent Python branch: dynamo splits the graph there."""

    def forward(self, x):
        x = self.net.stem(x)
        if x.mean() > 0:
            x = x * 2
        return self.net.head(self.net.blocks(F.relu(x)).mean(dim=(2, 3)))


def test_graph_breaks_match_torch_dynamo_explain():
    reference = torch._dynamo.explain(BranchingModule().forward)(torch.randn(8, 3, 8, 8))
    assert reference.graph_break_count >= 1
    strategy = CompiledStrategy(backend="aot_eager", compile_eval=False)
    fit(BranchingModule(), strategy, limit_train_batches=1, limit_val_batches=0)
    stats = strategy.compile_stats
    assert stats.graph_breaks == reference.graph_break_count, stats.break_reasons
    assert any("generic_jump" in reason and "test_workflows.py" in reason for reason in stats.break_reasons)


class PrintsFirst(TinyModule):
    """A break before any op: dynamo compiles no graph for it (``torch._dynamo.explain`` misses it too)."""

    def forward(self, x):
        print("batch", tuple(x.shape))
        return self.net(x)


def test_a_break_before_any_op_is_counted():
    strategy = CompiledStrategy(backend="aot_eager", compile_eval=False)
    fit(PrintsFirst(), strategy, limit_train_batches=1, limit_val_batches=0)
    stats = strategy.compile_stats
    assert stats.graph_breaks == 1, stats.break_reasons
    assert "print" in stats.break_reasons[0]


# ------------------------------------------------------------------------------ defect 4: compile time
def test_compile_time_counts_each_second_once():
    """Each frame's compile time (dynamo's: tracing, AOTAutograd and the backend, forward and backward graph)
    counts once, and the backend's seconds are not added on top. Checked on the records, not against a wall
    clock: a sum of durations against the fit's duration depended on timings."""
    strategy = CompiledStrategy()  # inductor: the backward compile is a large share
    # Inductor's on-disk caches would skip the backward compile whose time was counted twice: compile for
    # real.
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        fit(TinyModule(), strategy, limit_val_batches=0)
    stats = strategy.compile_stats
    # one graph per frame, its backward compiled inside the forward's frame (not lazily, in a window of its
    # own)
    assert [(r.frame_id, r.frame_compile_id) for r in stats.graph_records] == [
        tuple(int(i) for i in r.compile_id.split("/")) for r in stats.frame_records
    ], stats.summary()
    frame_seconds = sum(r.seconds for r in stats.frame_records)
    assert 0 < stats.backend_time_s <= frame_seconds, stats.summary()  # nested in the frames
    assert stats.compile_time_s == frame_seconds, stats.summary()  # not frames + backend


def test_compile_time_leaves_out_other_compiles_in_the_process():
    other_graphs = []

    def other_backend(gm, example_inputs):
        other_graphs.append(gm)
        return gm.forward

    class CompilesSomethingElse(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            torch.compile(lambda t: torch.sin(t) * 2, backend=other_backend)(torch.randn(4))

    # tracing only: TinyModule's frames take about a second
    strategy = CompiledStrategy(backend="eager", compile="always")
    fit(TinyModule(), strategy, callbacks=[CompilesSomethingElse()])
    # The other compile ran inside the fit but is not the strategy's: neither its frame nor its graph is
    # counted, and the compile time is the sum over the strategy's own records only.
    stats = strategy.compile_stats
    assert other_graphs and stats.graphs == 3, stats.summary()
    assert stats.compile_time_s == max(sum(r.seconds for r in stats.frame_records), stats.backend_time_s)
    assert [r.code_name for r in stats.frame_records] == [
        "forward"
    ] * 3  # first, smaller last batch, validation


# ------------------------------------------------------------------------------ defect 5: fullgraph
def test_fullgraph_raises_on_a_graph_break():
    assert CompileConfig(fullgraph=True).fallback == "raise"
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Data-dependent branching"):
        fit(BranchingModule(), CompiledStrategy(backend="aot_eager", fullgraph=True))


def test_fullgraph_with_an_explicit_eager_fallback_warns_and_runs_eagerly():
    strategy = CompiledStrategy(backend="aot_eager", fullgraph=True, fallback="eager")
    module = BranchingModule()
    with pytest.warns(UserWarning, match="continuing in eager mode"):
        fit(module, strategy)
    assert strategy.compile_stats.fell_back
    assert len(module.train_losses) == TRAIN_STEPS


def test_fallback_default_follows_fullgraph_through_replace():
    assert CompileConfig().fallback == "eager"
    assert CompileConfig(fullgraph=True).replace(fullgraph=False).fallback == "eager"
    assert CompileConfig(fullgraph=True, fallback="eager").fallback == "eager"
    assert CompileConfig(fallback="raise").replace(mode=None).fallback == "raise"
