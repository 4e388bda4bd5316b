"""What the compiled strategy compiles, counts, restores and falls back from."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from boring import TRAINER_KWARGS, ConvBlock, TinyModule, make_loader
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from lightning_plugin import CompiledStrategy
from lightning_plugin.compile.compiler import find_repeated_blocks


def fit(module, strategy, loader=None, validate=True, **overrides):
    trainer = L.Trainer(strategy=strategy, **{**TRAINER_KWARGS, **overrides})
    trainer.fit(module, loader or make_loader(), make_loader(n=12, seed=1) if validate else None)
    return trainer


@pytest.fixture(scope="module")
def plain_fit_stats(tmp_path_factory):
    """The compile stats of one plain aot_eager fit, which several tests read (one fit, not one each). Set
    up as conftest's per-test fixtures would: seeded, an empty decision cache, dynamo reset after."""
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LCV_KERNEL_CACHE_DIR", str(tmp_path_factory.mktemp("lcv_decisions")))
        strategy = CompiledStrategy(backend="aot_eager")
        fit(TinyModule(), strategy)
    torch._dynamo.reset()
    return strategy.compile_stats


@pytest.mark.xdist_group("plain_fit")  # one worker builds the module fixture (else each worker does)
def test_zero_graph_breaks_with_self_log_in_steps(plain_fit_stats):
    stats = plain_fit_stats
    assert stats.graphs >= 1
    assert stats.graph_breaks == 0, stats.break_reasons
    assert not stats.fell_back


def test_known_recompiles_are_counted_with_reasons():
    # 20 samples in batches of 8: a last batch of 4, then validation flips grad mode. compile="always": "auto"
    # would run the third step eagerly (its measurement) and validation eagerly until it has decided.
    strategy = CompiledStrategy(backend="aot_eager", compile="always")
    fit(TinyModule(), strategy)
    stats = strategy.compile_stats
    assert stats.recompiles >= 2
    reasons = " | ".join(stats.recompile_reasons)
    assert "size mismatch" in reasons or "expected 8" in reasons, reasons
    assert "grad_mode" in reasons, reasons
    assert stats.as_dict()["recompiles"] == stats.recompiles


@pytest.mark.xdist_group("plain_fit")
def test_compile_time_covers_tracing_not_only_the_backend(plain_fit_stats):
    stats = plain_fit_stats
    # dynamo's own timer around each frame's compile includes the backend call plus tracing and guards.
    assert stats.compile_time_s > stats.backend_time_s > 0
    assert stats.as_dict()["compile_time_s"] == stats.compile_time_s


def test_same_losses_as_eager_with_inductor():
    torch.manual_seed(0)
    eager = TinyModule()
    torch.manual_seed(0)
    compiled = TinyModule()
    fit(eager, "auto", validate=False, max_epochs=2)
    strategy = CompiledStrategy()  # inductor, the real thing
    fit(compiled, strategy, validate=False, max_epochs=2)
    assert strategy.compile_stats.graphs >= 1 and not strategy.compile_stats.fell_back
    # fp32 on CPU: reassociation inside fused kernels changes the last bits of each step's sums only.
    steps = len(eager.train_losses)
    tol = trajectory_tolerance(torch.float32, network_length(eager, (8, 3, 8, 8)), steps)
    losses = torch.tensor(eager.train_losses)
    torch.testing.assert_close(torch.tensor(compiled.train_losses), losses, atol=bound(tol, losses), rtol=0)
    for (name, p_eager), p_compiled in zip(eager.state_dict().items(), compiled.state_dict().values()):
        torch.testing.assert_close(p_compiled, p_eager, atol=bound(tol, p_eager), rtol=0, msg=name)


def test_teardown_restores_the_module_and_a_second_fit_works():
    module = TinyModule()
    strategy = CompiledStrategy(backend="aot_eager")
    fit(module, strategy)
    assert "forward" not in module.__dict__, "forward must be the class method again after fit"
    assert not strategy.is_compiled
    module(torch.randn(2, 3, 8, 8))  # usable eagerly
    strategy2 = CompiledStrategy(backend="aot_eager")
    fit(module, strategy2)
    # Same settings, same code: the second fit runs the graphs the first one compiled.
    assert strategy2.compile_stats.graphs == 0 and strategy2.compile_stats.reused_frames >= 1
    assert "forward" not in module.__dict__
    trainer = L.Trainer(strategy=CompiledStrategy(backend="aot_eager"), **TRAINER_KWARGS)
    trainer.validate(module, make_loader(n=8))
    preds = trainer.predict(module, make_loader(n=8))
    assert torch.cat(preds).shape == (8,)
    assert "forward" not in module.__dict__


def test_a_module_compiled_by_the_user_is_not_compiled_twice():
    module = TinyModule()
    module.net = torch.compile(module.net, backend="aot_eager")
    strategy = CompiledStrategy(backend="aot_eager")
    with pytest.warns(UserWarning, match="will not be compiled twice"):
        fit(module, strategy)
    assert strategy.compile_stats.graphs == 0
    # The strategy still saves clean keys for the user's own compiled submodule.
    assert not any("_orig_mod" in k for k in strategy.lightning_module_state_dict())


def failing_backend(gm, example_inputs):
    raise RuntimeError("deliberately failing backend")


def test_fallback_to_eager_when_the_backend_fails():
    strategy = CompiledStrategy(backend=failing_backend, fallback="eager")
    module = TinyModule()
    with pytest.warns(UserWarning, match="continuing in eager mode"):
        fit(module, strategy)
    assert strategy.compile_stats.fell_back
    assert "BackendCompilerFailed" in strategy.compile_stats.fallback_reason
    assert len(module.train_losses) == 3  # every step ran


def test_fallback_raise_stops():
    strategy = CompiledStrategy(backend=failing_backend, fallback="raise")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="deliberately failing"):
        fit(TinyModule(), strategy)


def _backward_failing_backend():
    """Compiles the forward graph fine and fails on the backward graph (which AOTAutograd lowers lazily)."""
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(gm, example_inputs):
        return gm.forward

    def backward_compiler(gm, example_inputs):
        raise RuntimeError("deliberately failing backward compile")

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)


def test_fallback_to_eager_when_only_the_backward_compile_fails():
    strategy = CompiledStrategy(backend=_backward_failing_backend(), fallback="eager")
    module = TinyModule()
    with pytest.warns(UserWarning, match="continuing in eager mode"):
        fit(module, strategy)
    assert strategy.compile_stats.fell_back
    assert "deliberately failing backward" in strategy.compile_stats.fallback_reason
    assert len(module.train_losses) == 3


def test_fallback_raise_stops_on_a_failing_backward_compile():
    strategy = CompiledStrategy(backend=_backward_failing_backend(), fallback="raise")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="deliberately failing backward"):
        fit(TinyModule(), strategy)


def test_user_errors_are_not_hidden_by_the_fallback():
    module = TinyModule()
    strategy = CompiledStrategy(backend="aot_eager")
    trainer = L.Trainer(strategy=strategy, **TRAINER_KWARGS)
    wrong_shape = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(4, 5, 8, 8), torch.zeros(4, dtype=torch.long)),
        batch_size=4,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="channels"):
            trainer.fit(module, wrong_shape)


def test_compile_eval_false_keeps_validation_eager():
    strategy = CompiledStrategy(backend="aot_eager", compile_eval=False)
    fit(TinyModule(), strategy)
    reasons = " ".join(strategy.compile_stats.recompile_reasons)
    assert "grad_mode" not in reasons, "validation must not have been compiled"


def test_regional_compiles_each_repeated_block():
    module = TinyModule()
    blocks = find_repeated_blocks(module)
    assert len(blocks) == 2 and all(isinstance(b, ConvBlock) for b in blocks)
    strategy = CompiledStrategy(backend="aot_eager", regional=True, compile_eval=False)
    fit(module, strategy)
    stats = strategy.compile_stats
    # One code object for both blocks: the second block reuses the first one's graph.
    first_frames = {r.frame_id for r in stats.graph_records if not r.is_recompile}
    assert len(first_frames) == 1
    assert stats.graph_breaks == 0
    assert all("forward" not in b.__dict__ for b in blocks)


def test_regional_without_repeated_blocks_warns_and_compiles_forward():
    module = TinyModule()
    module.net.blocks = module.net.blocks[:1]
    strategy = CompiledStrategy(backend="aot_eager", regional=True)
    with pytest.warns(UserWarning, match="no repeated block"):
        fit(module, strategy)
    assert strategy.compile_stats.graphs >= 1


def test_channels_last_converts_weights():
    module = TinyModule()
    strategy = CompiledStrategy(backend="aot_eager", channels_last=True)
    fit(module, strategy)
    assert module.net.blocks[0].conv.weight.is_contiguous(memory_format=torch.channels_last)


def _compiled_whole_by_torch_compile(module):
    return torch.compile(module, backend="aot_eager")  # Lightning unwraps it and keeps a _compiler_ctx


def _compiled_whole_by_module_compile(module):
    module.compile(backend="aot_eager")  # nn.Module.compile: compiles _call_impl in place
    return module


def _compiled_nested_submodule(module):
    module.net.blocks[1] = torch.compile(module.net.blocks[1], backend="aot_eager")
    return module


def _compiled_submodule_by_module_compile(module):
    module.net.head.compile(backend="aot_eager")
    return module


@pytest.mark.parametrize(
    "compile_by_user, reason",
    [
        (_compiled_whole_by_torch_compile, r"passed to the Trainer as torch\.compile\(model\)"),
        (_compiled_whole_by_module_compile, r"'TinyModule' was compiled with nn\.Module\.compile\(\)"),
        (_compiled_nested_submodule, r"submodule 'net\.blocks\.1' is a torch\.compile'd module"),
        (
            _compiled_submodule_by_module_compile,
            r"submodule 'net\.head' was compiled with nn\.Module\.compile\(\)",
        ),
    ],
    ids=["torch.compile(module)", "module.compile()", "torch.compile(submodule)", "submodule.compile()"],
)
def test_every_kind_of_user_compile_is_left_alone(compile_by_user, reason):
    module = TinyModule()
    given = compile_by_user(module)
    strategy = CompiledStrategy(backend="aot_eager")
    with pytest.warns(UserWarning, match=f"{reason}\\. It will not be compiled twice") as record:
        fit(given, strategy)
    assert sum("will not be compiled twice" in str(w.message) for w in record) == 1
    # Nothing went through the strategy's own (counting) backend, and nothing of ours is left patched.
    assert strategy.compile_stats.graphs == 0 and not strategy.is_compiled
    assert not any(getattr(m.__dict__.get("forward"), "__lcv_compiled__", False) for m in module.modules())
    assert len(module.train_losses) == 3  # the user's compiled model still trained every step


def test_teardown_after_test_restores_the_module():
    module = TinyModule()
    strategy = CompiledStrategy(backend="aot_eager")
    trainer = L.Trainer(strategy=strategy, **TRAINER_KWARGS)
    seen_during_test = []
    original_test_step = module.test_step

    def test_step(batch, batch_idx):  # the forward the strategy installed, seen from inside the test loop
        seen_during_test.append(getattr(module.__dict__.get("forward"), "__lcv_compiled__", False))
        return original_test_step(batch, batch_idx)

    module.test_step = test_step
    trainer.test(module, make_loader(n=8))
    assert seen_during_test and all(seen_during_test), "test must run the strategy's compiled forward"
    assert strategy.compile_stats.graphs >= 1
    assert "forward" not in module.__dict__, "forward must be the class method again after test"
    assert not strategy.is_compiled
    module(torch.randn(2, 3, 8, 8))  # usable eagerly
