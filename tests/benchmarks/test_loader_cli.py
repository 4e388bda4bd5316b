"""``benchmarks/loader.py``'s options are checked before any data is read."""

from __future__ import annotations

import sys

import pytest

import lcv_vision.data.compiled
from script_loader import load_script


def test_an_unknown_compile_backend_is_one_line_at_start(monkeypatch, capsys):
    bench = load_script("benchmarks/loader.py")
    monkeypatch.setattr(sys, "argv", ["loader.py", "--gpu-only", "--compile-backend", "no_such_backend"])
    backend = lcv_vision.data.compiled.BACKEND
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    said = capsys.readouterr()
    assert stopped.value.code == 2
    last = said.err.strip().splitlines()[-1]  # argparse's usage lines, then one error line
    assert last.startswith("loader.py: error: ") and "'no_such_backend' is not a registered" in last
    assert "data:" not in said.out and lcv_vision.data.compiled.BACKEND == backend  # stopped before anything
