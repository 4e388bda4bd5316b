"""One GPU session's checks in one call: GPU tests, then every benchmark, each under its own time limit.

Device time is scarce (15 minutes per issue, machine start included), so this runs everything that
needs a GPU in a single prepared command of at most ~8 minutes, keeps going when one step fails or
times out, writes each benchmark's JSON to ``benchmarks/results/`` (GPU name, versions, commit and
date are in every file) plus a summary ``gpu_check-<date>.json``, and prints a short table last.

    python benchmarks/gpu_check.py                 # all steps, default budget
    python benchmarks/gpu_check.py --only tests conv
    python benchmarks/gpu_check.py --list

Use ``benchmarks/gpu_check.sh`` on the lent machine: it sets up the environment first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import machine_info, print_table, write_results  # noqa: E402

#: Where gpu_check.sh expects a copy of the CIFAR-10 JPEG zip (an ignored folder named in `carry`).
DEVICE_CIFAR_ZIP = os.path.join(ROOT, ".device_data", "cifar10-jpeg.zip")


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    result_file: str | None = None  # benchmarks/results/<this>, when the step writes one
    needs: str | None = None  # a file that must exist, else the step is skipped with the reason

    def missing(self) -> str | None:
        if self.needs and not os.path.exists(os.path.join(ROOT, self.needs)):
            return f"{self.needs} not found"
        return None


def steps() -> list[Step]:
    py = sys.executable
    cifar_zip = DEVICE_CIFAR_ZIP if os.path.exists(DEVICE_CIFAR_ZIP) else os.path.join(
        ROOT, "..", "shared", "data", "cifar10-jpeg.zip"
    )
    # Limits add up to ~8 minutes: the whole device budget is 15, machine start included.
    return [
        Step("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests",
                       "--timeout", "120"], 70),
        Step("conv", [py, "benchmarks/conv.py", "--layers", "conv1_7x7s2", "layer1_3x3", "layer2_3x3",
                      "layer3_1x1_reduce", "layer4_3x3", "--repeats", "20"], 75, "conv-gpu.json", "benchmarks/conv.py"),
        Step("resnet_train", [py, "benchmarks/resnet_train.py", "--variants", "eager", "compile", "ours",
                              "ours_no_conv", "max_autotune", "--repeats", "3"], 140, "resnet_train-gpu.json",
             "benchmarks/resnet_train.py"),
        Step("loader", [py, "benchmarks/loader.py", "--cifar-images", "50000", "--jpeg-images", "2048",
                        "--repeats", "3"], 45, "loader-gpu.json", "benchmarks/loader.py"),
        Step("strategy_overhead", [py, "benchmarks/strategy_overhead.py", "--batch", "256", "--channels", "64",
                                   "--repeats", "3"], 35, "strategy_overhead-cuda.json"),
        Step("cifar10_accuracy", [py, "benchmarks/cifar10_accuracy.py", "--zip", cifar_zip], 75,
             "cifar10_accuracy-gpu.json", "benchmarks/cifar10_accuracy.py"),
        Step("airbench_reference", [py, "benchmarks/airbench_reference.py", "--zip", cifar_zip], 40,
             "airbench_reference-gpu.json", "benchmarks/airbench_reference.py"),
    ]


def run_step(step: Step, log_dir: str) -> dict:
    """Run one step with its time limit; return its row (the log goes to ``log_dir``)."""
    reason = step.missing()
    if reason:
        return {"step": step.name, "status": "skipped", "seconds": 0.0, "note": reason}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    log_path = os.path.join(log_dir, f"gpu_check-{step.name}.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=step.timeout_s, check=False)
            status = "ok" if proc.returncode == 0 else f"failed (rc={proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timeout ({step.timeout_s}s)"
    seconds = time.perf_counter() - start
    with open(log_path) as log:
        tail = log.read().splitlines()[-14:]
    print(f"\n=== {step.name}: {status} in {seconds:.0f}s ===", *tail, sep="\n", flush=True)
    return {"step": step.name, "status": status, "seconds": seconds, "note": step.result_file or "",
            "log_tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="run only these steps")
    parser.add_argument("--list", action="store_true", help="list the steps and their time limits")
    parser.add_argument("--log-dir", default="/tmp/lcv_gpu_logs", help="one log file per step")
    args = parser.parse_args()
    all_steps = steps()
    known = [s.name for s in all_steps]
    if args.only:
        unknown = sorted(set(args.only) - set(known))
        if unknown:
            parser.error(f"unknown step(s) {unknown}; steps: {known}")
        all_steps = [s for s in all_steps if s.name in args.only]
    if args.list:
        print_table([{"step": s.name, "timeout_s": s.timeout_s, "command": " ".join(s.argv[1:])} for s in all_steps],
                    ["step", "timeout_s", "command"])
        return
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured (run it on the lent GPU machine)")
        sys.exit(2)
    os.makedirs(args.log_dir, exist_ok=True)
    info = machine_info()
    print(f"gpu_check on {info['device']}, torch {info['torch']}, triton {info['triton']}, commit {info['commit']}",
          flush=True)
    rows = [run_step(step, args.log_dir) for step in all_steps]
    path = write_results(f"gpu_check-{info['date'][:10]}", {"steps": rows})
    print(f"\nsummary written to {path}\n")
    print_table(rows, ["step", "status", "seconds", "note"])


if __name__ == "__main__":
    main()
