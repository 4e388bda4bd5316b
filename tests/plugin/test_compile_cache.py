"""The portable compile cache: saved after compiling, loaded by a fresh process, skipped when made
elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch

from boring import TRAINER_KWARGS, LinearModule, make_vector_loader
from lightning_plugin import CompileConfig, CompiledStrategy
from lightning_plugin.compile import cache as compile_cache
from lightning_plugin.compile.cache import (
    CACHE_FILE_NAME,
    environment,
    load_compile_cache,
    save_compile_cache,
)

HERE = os.path.dirname(__file__)
CPU = torch.device("cpu")


def _fit_in_fresh_process(cache_file, inductor_dir):
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
    }  # same OMP_NUM_THREADS: with another, Inductor misses
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "cache_script.py"), str(cache_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_fresh_process_with_an_empty_inductor_cache_compiles_nothing_again(tmp_path):
    """Two runs of one script, each a new process with its own Inductor cache folder (two machines, for
    Inductor): the second compiles nothing. Both runs are fresh processes, so the Inductor and dynamo
    settings another test left in this worker cannot enter the first run's cache keys."""
    cache_file = tmp_path / "run" / CACHE_FILE_NAME
    first = _fit_in_fresh_process(cache_file, tmp_path / "first-inductor-cache")
    assert first["saved"] and first["fx_misses"] >= 1, first
    loaded = _fit_in_fresh_process(
        cache_file, tmp_path / "empty-inductor-cache"
    )  # another machine, for Inductor
    assert loaded["graphs"] >= 1
    assert loaded["fx_hits"] >= 1 and loaded["fx_misses"] == 0, loaded
    assert loaded["cpp_builds"] == 0, loaded  # the kernels (and the CPU feature probes) came from the file


def _write_cache_made_with(path, monkeypatch, **made_with):
    """A cache file whose header says it was made in another environment (the payload is never read)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
        patch.setattr(compile_cache, "_kernel_binaries", lambda root: iter(()))
        patch.setattr(compile_cache, "environment", lambda device: {**environment(device), **made_with})
        assert save_compile_cache(path, CPU)


@pytest.mark.parametrize(
    "made_with, named",
    [
        ({"torch": "2.0.0"}, "torch 2.0.0 here"),
        ({"triton": "0.1"}, "triton 0.1 here"),
        ({"device": "cuda NVIDIA H100 80GB HBM3 sm_90"}, "device cuda NVIDIA H100"),
        ({"python": "3.7"}, "python 3.7"),
    ],
    ids=["torch", "triton", "device", "python"],
)
def test_a_cache_made_elsewhere_is_skipped_with_one_line(tmp_path, monkeypatch, made_with, named):
    path = tmp_path / CACHE_FILE_NAME
    _write_cache_made_with(path, monkeypatch, **made_with)
    monkeypatch.setattr(
        torch.compiler, "load_cache_artifacts", lambda data: pytest.fail("must not be loaded")
    )
    with pytest.warns(UserWarning, match="made elsewhere") as record:
        assert not load_compile_cache(path, CPU)
    message = str(record[0].message)
    assert named in message and "\n" not in message and len(record) == 1


def test_an_unreadable_cache_is_skipped_with_one_line(tmp_path):
    path = tmp_path / CACHE_FILE_NAME
    path.write_bytes(b"not a cache\n")
    with pytest.warns(UserWarning, match="unreadable .*not a compile cache file") as record:
        assert not load_compile_cache(path, CPU)
    assert "\n" not in str(record[0].message)


def test_the_strategy_warns_once_and_compiles_when_the_cache_was_made_elsewhere(tmp_path, monkeypatch):
    path = tmp_path / CACHE_FILE_NAME
    _write_cache_made_with(path, monkeypatch, torch="2.0.0")
    strategy = CompiledStrategy(backend="aot_eager", cache=str(path))
    with pytest.warns(UserWarning, match="made elsewhere") as record:
        L.Trainer(**{**TRAINER_KWARGS, "strategy": strategy, "limit_train_batches": 2}).fit(
            LinearModule(), make_vector_loader()
        )
    assert sum("made elsewhere" in str(w.message) for w in record) == 1
    assert strategy.compile_stats.graphs + strategy.compile_stats.reused_frames >= 1


def test_cache_true_saves_next_to_the_checkpoints_and_a_resume_loads_from_there(tmp_path, monkeypatch):
    first_run, second_run = tmp_path / "first", tmp_path / "second"
    kwargs = {**TRAINER_KWARGS, "enable_checkpointing": True, "limit_train_batches": 2}
    trainer = L.Trainer(**kwargs, default_root_dir=first_run, strategy=CompiledStrategy(cache=True))
    trainer.fit(LinearModule(), make_vector_loader())
    saved = first_run / "checkpoints" / CACHE_FILE_NAME
    assert saved.is_file()
    checkpoint = trainer.checkpoint_callback.best_model_path

    loaded = []
    monkeypatch.setattr(compile_cache, "load_compile_cache", lambda path, device: loaded.append(path) or True)
    import lightning_plugin.compile.mixin as mixin

    monkeypatch.setattr(mixin, "load_compile_cache", compile_cache.load_compile_cache)
    resumed = L.Trainer(
        **{**kwargs, "max_epochs": 2}, default_root_dir=second_run, strategy=CompiledStrategy(cache=True)
    )
    resumed.fit(LinearModule(), make_vector_loader(), ckpt_path=checkpoint)
    assert loaded == [saved]
    assert (second_run / "checkpoints" / CACHE_FILE_NAME).is_file()  # the resumed run keeps its own copy


@pytest.mark.parametrize("bad", ["", 3, ["a"]], ids=["empty", "int", "list"])
def test_bad_cache_setting(bad):
    with pytest.raises(TypeError, match="CompileConfig.cache must be True, False or a file path"):
        CompileConfig(cache=bad)


def test_environment_names_what_the_artifacts_depend_on():
    env = environment(CPU)
    assert env["torch"] == torch.__version__
    assert (
        env["device"].startswith("cpu ") and env["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(env) == {"torch", "triton", "python", "device"}
