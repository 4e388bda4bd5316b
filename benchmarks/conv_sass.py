"""Offline SASS table of the Hopper conv (``lcv_kernels.conv_hopper``) for every shape in its config table.

No GPU is needed or used: each config is compiled for sm_90a with Triton's own ptxas and its SASS is read
(``lcv_kernels.conv_hopper_sass``). Runs once per triton: the one in this environment, and each
``--triton DIR`` (a folder made with ``pip install --no-deps --target DIR triton==3.6.0``, put first on
PYTHONPATH in a subprocess). Writes ``benchmarks/results/conv-sass.json``: per row the shape, config,
triton, with or without the BatchNorm statistics epilogue and (1x1s) the BN+ReLU prologue, registers,
instructions per 8 HGMMA in the K loop, shared memory, CTAs/SM, HGMMA/UTMALDG/LDGSTS/LDG counts, spills and
the bar failures (issue 38).
These are compile-time facts, not timings: "not measured on GPU".

    python benchmarks/conv_sass.py --triton /work/triton36
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table, write_results  # noqa: E402

_WORKER = """
import json, sys
from lcv_kernels.conv_hopper import CONFIGS, MODE_GEMM, layer_mode
from lcv_kernels.conv_hopper_sass import sass_row
jobs = [(s, False, item) for s in (False, True) for item in CONFIGS.items()]
# the BN+ReLU prologue (1x1 stride-1 convs only), alone and with the statistics epilogue (the chain link)
jobs += [(s, True, item) for s in (False, True) for item in CONFIGS.items() if layer_mode(item[0]) == MODE_GEMM]
for stats, prologue, (shape, config) in jobs:
    try:
        row = sass_row(shape, config, stats=stats, prologue=prologue)
    except Exception as err:  # a compile failure is a row, not the end of the table
        import triton
        row = {"shape": list(shape), "config": config.describe(), "triton": triton.__version__, "stats": stats,
               "prologue": prologue, "error": repr(err)[:500], "bar_failures": ["did not compile"]}
    print(json.dumps(row), flush=True)
"""


def run_table(triton_dir: str | None) -> list[dict[str, Any]]:
    """Every table row compiled with one triton (``triton_dir`` first on PYTHONPATH, or this environment's)."""
    paths = ([triton_dir] if triton_dir else []) + [_ROOT, os.path.join(_ROOT, "kernels")]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, cwd=_ROOT, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the SASS worker failed ({triton_dir or 'local triton'}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", action="append", default=[], help="a folder holding another triton")
    parser.add_argument("--output", default="conv-sass", help="results file name (without .json)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for triton_dir in [None, *args.triton]:
        rows.extend(run_table(triton_dir))
    for row in rows:
        row["meets_bar"] = not row["bar_failures"]

    def kind(r: dict[str, Any]) -> tuple[str, bool, bool]:
        return r["triton"], r["stats"], r.get("prologue", False)

    summary = {
        f"triton {triton}, {'with' if stats else 'without'} the statistics epilogue"
        f"{', with the BN+ReLU prologue' if prologue else ''}": (
            f"{sum(r['meets_bar'] for r in rows if kind(r) == (triton, stats, prologue))}/"
            f"{sum(kind(r) == (triton, stats, prologue) for r in rows)} rows meet the bar"
        )
        for triton in dict.fromkeys(r["triton"] for r in rows)
        for prologue in (False, True)
        for stats in (False, True)
    }
    payload = {
        "what": "offline sm_90a SASS of lcv_kernels.conv_hopper's config table (compile-time facts)",
        "gpu": "not measured on GPU",
        "bar": "per row: HGMMA and UTMALDG in the K loop, no LDGSTS/LDG there, no spills, "
        "<= 140 instructions per 8 HGMMA on one K step's path, >= 1 CTA/SM",
        "note": "compiles ran on a CPU machine shared with other agents; nothing here is a timing",
        "summary": summary,
        "rows": rows,
    }
    print_table(
        rows,
        [
            "triton",
            "stats",
            "prologue",
            "shape",
            "config",
            "registers",
            "instructions_per_8_hgmma",
            "shared_bytes",
            "ctas_per_sm",
            "loop_hgmma",
            "loop_utmaldg",
            "loop_ldgsts",
            "loop_ldg",
            "spill_bytes",
            "meets_bar",
        ],
    )
    print(json.dumps(summary))
    print(write_results(args.output, payload))


if __name__ == "__main__":
    main()
