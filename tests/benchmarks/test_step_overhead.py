"""``benchmarks/step_overhead.py`` runs and reports every side: a few steps, the eager backend, structure only
(its numbers are the benchmark's business, not a test's)."""

from __future__ import annotations

import json

import pytest

from script_loader import load_script


def test_step_overhead_reports_every_side(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LCV_RESULTS_DIR", str(tmp_path))
    bench = load_script("benchmarks/step_overhead.py")
    sides = ["plain", "compiled", "lightning", "compiled_lightning_path", "compile_step"]
    payload = bench.main(
        ["--steps", "8", "--warmup", "2", "--repeats", "1", "--backend", "eager", "--progress-bar", "none"]
        + ["--sides", ",".join(sides), "--out", "step_overhead-test"]
    )
    written = json.loads((tmp_path / "step_overhead-test.json").read_text())
    assert [row["side"] for row in written["results"]] == sides
    assert all(row["us/step"] > 0 for row in written["results"])
    assert set(written["per_repeat_us"]) == set(sides)
    assert written["gpu"] == "not measured on GPU"
    assert set(written["load_average"]) == {"start", "end"} and written["load_average"]["start"] >= 0
    assert written["compiled_minus_plain_us"] == payload["compiled_minus_plain_us"]
    profile = written["profile"]
    assert (
        profile["compiled us/step under cProfile"] > 0
        and "ncalls" in profile["compiled top functions by own time"]
    )
    assert "compiled - plain" in capsys.readouterr().out


def test_a_negative_cpp_wrapper_threshold_is_refused_in_one_line(capsys):
    bench = load_script("benchmarks/step_overhead.py")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--cpp-wrapper-min-ops", "-1", "--no-profile"])
    assert stop.value.code == 2
    assert "--cpp-wrapper-min-ops must be >= 0; got -1" in capsys.readouterr().err
