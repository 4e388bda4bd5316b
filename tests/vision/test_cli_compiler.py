"""``lcv fit`` on the CPU trains with the compiled strategy and its summary ends with what the compiler
did."""

from __future__ import annotations

import re
import sys

import pytest

from lightning_plugin import CompiledStrategy
from lightning_plugin.kernel_choice.cache import CACHE_DIR_ENV

pytest.importorskip(
    "jsonargparse", reason="the lcv CLI needs jsonargparse (a dependency of lightning[pytorch-extra])"
)

from lcv_args import TINY_QUIET
from lcv_vision.cli import run

TINY = [
    *TINY_QUIET,
    "--trainer.max_epochs",
    "1",
    "--trainer.limit_val_batches",
    "1",
    "--test_after_fit",
    "false",
    "--trainer.strategy.backend",
    "aot_eager",
]  # dynamo + AOTAutograd, no C++ compiler: quick


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lcv"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "decisions"))


def _compiler_lines(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  compiler: "))
    return lines[start:]


def test_fit_summary_ends_with_the_compiler_and_the_measured_ratio(capsys):
    fit = run(["fit", "--recipe", "digits-small", "--trainer.limit_train_batches", "14", *TINY])
    strategy = fit.trainer.strategy
    assert isinstance(strategy, CompiledStrategy)  # the CPU default, as on a GPU
    decision = strategy.compile_decision
    assert decision is not None and decision.source == "measured"
    compiler, kernels, ratio = _compiler_lines(capsys.readouterr().out)
    stats = strategy.compile_stats
    assert re.fullmatch(
        r"  compiler: [1-9]\d* graph\(s\), 0 graph break\(s\), 0 recompile\(s\), \d+\.\d s "
        r"compiling \((\d+ hit\(s\), \d+ miss\(es\) in the on-disk compile caches|no on-disk "
        r"cache used)\)",
        compiler,
    ), compiler
    assert f"{stats.graphs} graph(s)" in compiler
    assert kernels == "  kernel substitutions: 0 (none on this device)"
    outcome = "kept compiling" if decision.choice == "compiled" else "trained eagerly"
    measured = f"({decision.speedup:.2f}x, median of 4 each, measured at the start of this fit)"
    assert ratio.startswith("  compiled vs eager training steps: ") and measured in ratio, ratio
    assert outcome in ratio and "images/s" in ratio, ratio


def test_a_fit_too_short_to_measure_says_so(capsys):
    run(["fit", "--recipe", "digits-small", "--trainer.limit_train_batches", "3", *TINY])
    lines = _compiler_lines(capsys.readouterr().out)
    assert lines[-1] == "  compiled vs eager: not measured (the fit ended before the measurement)"
