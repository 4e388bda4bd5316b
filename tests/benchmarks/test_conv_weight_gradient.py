"""The benchmark behind the matrix-product weight gradient's rule runs, times both sides, restores the rule's
thresholds it overrides, and says where the rule applies."""

from __future__ import annotations

import json

from lightning_plugin.cpu import graph_passes as cpu_graph_passes
from script_loader import load_script


def test_a_small_grid_end_to_end(tmp_path, monkeypatch):
    bench = load_script("benchmarks/conv_weight_gradient.py")
    monkeypatch.setenv("LCV_RESULTS_DIR", str(tmp_path))
    before = (
        cpu_graph_passes.MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS,
        cpu_graph_passes.MATMUL_WEIGHT_GRADIENT_MIN_TAPS,
    )
    rows = bench.main(
        [
            "--batches",
            "2",
            "--channels",
            "8,456",
            "--sizes",
            "2,3",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--name",
            "t",
        ]
    )
    after = (
        cpu_graph_passes.MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS,
        cpu_graph_passes.MATMUL_WEIGHT_GRADIENT_MIN_TAPS,
    )
    assert after == before
    assert [(r["channels"], r["map"], r["applies"]) for r in rows] == [
        (8, "2x2", False),
        (8, "3x3", False),
        (456, "2x2", True),  # 456 x 9 = 4,104 taps on 4 positions
        (456, "3x3", False),  # 9 positions
    ]
    assert all(r["oneDNN ms"] > 0 and r["GEMM ms"] > 0 for r in rows)
    assert json.loads((tmp_path / "t.json").read_text())["results"] == rows
