"""One GPU session's checks in one call, under one deadline, handing over every result as it is measured.

Device time is scarce (15 minutes per issue, machine start included), so this runs everything that needs a GPU
in a single prepared command, end to end first: the fused ops against their references; the airbench recipe's
time to 94% through the Trainer and airbench's own code on the same data, alternating over three seeds (when
the data travelled); ResNet-50 training throughput (eager, torch.compile, the strategy, its kernel choice);
what the Trainer adds to a step (``step_overhead.py``, host syncs counted); the loader; the GPU tests;
airbench94 throughput; compile overhead; then the single-kernel benchmarks: our conv against cuDNN and
Inductor, the norms against copy bandwidth, max-autotune last. One global deadline (``--budget``, default 7
minutes) bounds the whole run: each step gets what is left (at most its own cap), the benchmarks start no case
they cannot finish before it (``LCV_DEADLINE``), and each measured case is appended at once to one JSON-lines
file (``LCV_RESULTS_JSONL``). After every step the summary and an archive of the results and logs are written
again, so a run killed at any moment has handed over everything it measured.

    python benchmarks/gpu_check.py                     # on the GPU machine (use gpu_check.sh there)
    python benchmarks/gpu_check.py --only correctness conv --budget 120
    python benchmarks/gpu_check.py --list              # steps, caps and commands
    python benchmarks/gpu_check.py --dry-run           # CPU: every step on tiny shapes, in about a minute

Output (``--out``, default ``$OUT`` or ``benchmarks/results``): ``gpu_check.jsonl`` (one line per measured
case, each benchmark's first line holding GPU, driver, CUDA, cuDNN, torch, triton, commit and date),
``gpu_check-summary.json`` (one row per step: status, seconds, cases measured) and ``gpu_results.tgz``
(every benchmark's full JSON and every step's log).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import (  # noqa: E402
    DEADLINE_ENV,
    RESULTS_DIR,
    RESULTS_DIR_ENV,
    SHARED_ZIP,
    STREAM_ENV,
    machine_info,
    print_table,
)

#: Where gpu_check.sh unpacks the CIFAR-10 JPEGs carried as ``.device_data/cifar10-jpeg.npz``.
DEVICE_CIFAR_ZIP = "/tmp/lcv-device-data/cifar10-jpeg.zip"
#: Seconds a step keeps after its benchmark's own deadline to write its final JSON before it is killed.
GRACE_S = 15
#: A step is not started with less than this left.
MIN_STEP_S = 20
#: The whole run on a GPU: the device tool's call gets 8 minutes, and set-up (wheels, data) takes well
#: under 1.
DEFAULT_BUDGET_S = 420
DRY_RUN_BUDGET_S = 90
#: Seeds of the time-to-accuracy pair (ours through the Trainer, airbench's own code), run alternating.
ACCURACY_SEEDS = (0, 1, 2)


@dataclass
class Step:
    """One command, its cap in seconds, and the command for the CPU dry run (tiny shapes)."""

    name: str
    argv: list[str]
    cap_s: int
    dry_argv: list[str] | None
    needs_module: str | None = None  # an optional package: without it the step is skipped, with the reason
    needs_file: str | None = None
    dry_run_skip: str = ""  # why the dry run does not run this step (only when dry_argv is None)

    def missing(self) -> str | None:
        if self.needs_module is not None:
            import importlib.util

            if importlib.util.find_spec(self.needs_module) is None:
                return f"{self.needs_module} is not installed"
        if self.needs_file is not None and not os.path.exists(self.needs_file):
            return f"{self.needs_file} not found (the data did not travel)"
        return None


def cifar_zip() -> str:
    return DEVICE_CIFAR_ZIP if os.path.exists(DEVICE_CIFAR_ZIP) else SHARED_ZIP


def steps() -> list[Step]:
    """Every step, most valuable first."""
    data_zip = cifar_zip()  # the CIFAR-10 JPEG zip, where it travels
    tiny_train = [
        "--tiny",
        "--compile-backend",
        "eager",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--batch",
        "2",
        "--size",
        "16",
        "--no-norm",
        "--variant-seconds",
        "2",
    ]
    unordered = [
        Step("correctness", ["benchmarks/op_correctness.py"], 60, ["benchmarks/op_correctness.py", "--tiny"]),
        Step(
            "conv",
            ["benchmarks/conv.py", "--warmup", "5", "--repeats", "20"],
            90,
            [
                "benchmarks/conv.py",
                "--tiny",
                "--dtype",
                "fp32",
                "--compile-backend",
                "eager",
                "--layers",
                "layer1_1x1_reduce",
                "airbench_g2_conv2",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--case-seconds",
                "1",
            ],
        ),
        Step(
            "norms",
            ["benchmarks/resnet_train.py", "--no-train", "--warmup", "5", "--repeats", "20"],
            30,
            [
                "benchmarks/resnet_train.py",
                "--tiny",
                "--no-train",
                "--no-compile",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--case-seconds",
                "1",
            ],
        ),
        Step(
            "resnet50_train",
            [
                "benchmarks/resnet_train.py",
                "--no-norm",
                "--variants",
                "eager",
                "compile",
                "ours_none",
                "ours_auto",
                "--warmup",
                "5",
                "--repeats",
                "3",
            ],
            180,
            ["benchmarks/resnet_train.py", *tiny_train, "--variants", "eager", "ours_all", "compile"],
        ),
        Step(
            "step_overhead",
            [
                "benchmarks/step_overhead.py",
                "--steps",
                "300",
                "--repeats",
                "3",
                "--sides",
                "plain,compiled,compile_step,lightning",
            ],
            90,
            None,
            dry_run_skip="not in the dry run: tests/benchmarks/test_step_overhead.py runs it with a few steps",
        ),
        Step(
            "gpu_tests",
            [
                "-m",
                "pytest",
                "-v",  # each test's name as it ends: a step cut short still says how far it got
                "-p",
                "no:cacheprovider",
                "-m",
                "gpu",
                "tests",
                "--timeout",
                "120",
                "--durations",
                "10",
            ],
            150,
            None,
            dry_run_skip="on a CPU every GPU test skips; tests/benchmarks/test_gpu_check.py collects them "
            "with the GPU image's missing packages hidden",
        ),
        Step(
            "airbench_train",
            [
                "benchmarks/resnet_train.py",
                "--model",
                "airbench94",
                "--no-norm",
                "--variants",
                "eager",
                "ours_auto",
                "ours_none",
                "--warmup",
                "5",
                "--repeats",
                "3",
            ],
            60,
            [
                "benchmarks/resnet_train.py",
                *tiny_train,
                "--model",
                "airbench94",
                "--variants",
                "eager",
                "ours_auto",
            ],
        ),
        Step(
            "loader",
            ["benchmarks/loader.py", "--gpu-only", "--repeats", "5", "--profile"],
            120,
            [
                "benchmarks/loader.py",
                "--gpu-only",
                "--device-rows-on",
                "cpu",
                "--gpu-cifar-images",
                "128",
                "--gpu-rrc-images",
                "4",
                "--gpu-cifar-batches",
                "32",
                "--gpu-rrc-batches",
                "2",
                "--gpu-per-sample-images",
                "4",
                "--compile-backend",
                "aot_eager",
                "--repeats",
                "1",
                "--case-seconds",
                "1",
            ],
        ),
        Step(
            "cifar10_time_to_94",
            ["benchmarks/cifar10_accuracy.py", "--zip", data_zip],
            75,
            None,
            dry_run_skip="not in the dry run: tests/vision/test_examples.py runs it on 200 images with "
            "--compile-backend aot_eager",
            needs_file=data_zip,
        ),
        Step(
            "strategy_overhead",
            [
                "benchmarks/strategy_overhead.py",
                "--workloads",
                "small_cnn,resnet18,vit_tiny",
                "--repeats",
                "3",
            ],
            40,
            [
                "benchmarks/strategy_overhead.py",
                "--compile-backend",
                "eager",
                "--no-compile-time",
                "--workloads",
                "small_cnn",
                "--steps",
                "4",
                "--warmup",
                "2",
                "--repeats",
                "1",
            ],
        ),
        Step(
            "airbench_reference",
            ["benchmarks/airbench_reference.py", "--zip", data_zip],
            40,
            None,
            needs_module="airbench",
            needs_file=data_zip,
            dry_run_skip="not in the dry run (airbench's full-width net needs >= 1,024 images); "
            "tests/benchmarks/test_airbench_reference.py covers it",
        ),
        Step(
            "max_autotune",
            [
                "benchmarks/conv.py",
                "--compile-mode",
                "max-autotune",
                "--only-providers",
                "inductor:max-autotune",
                "--layers",
                "layer1_3x3",
                "layer3_1x1_reduce",
                "airbench_g2_conv2",
                "--warmup",
                "5",
                "--repeats",
                "20",
            ],
            90,
            [
                "benchmarks/conv.py",
                "--tiny",
                "--dtype",
                "fp32",
                "--compile-backend",
                "eager",
                "--compile-mode",
                "max-autotune",
                "--only-providers",
                "inductor:max-autotune",
                "--layers",
                "layer1_3x3",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--case-seconds",
                "1",
            ],
        ),
    ]
    by_name = {step.name: step for step in unordered}
    # End to end first (issue 35): time to accuracy through the Trainer against airbench's own code, seed by
    # seed alternating so that a run cut short still holds matched pairs; then training throughput, the
    # strategy's per-step overhead and the loader; single-kernel micro-benchmarks last.
    paired = []
    for seed in ACCURACY_SEEDS:
        for name in ("cifar10_time_to_94", "airbench_reference"):
            paired.append(seeded(by_name[name], seed))
    order = [
        "resnet50_train",
        "step_overhead",
        "loader",
        "gpu_tests",
        "airbench_train",
        "strategy_overhead",
        "conv",
        "norms",
    ]
    return [by_name["correctness"], *paired, *(by_name[name] for name in order), by_name["max_autotune"]]


def seeded(step: Step, seed: int) -> Step:
    """``step`` for one seed: its own name, log and result file; the dry run walks seed 0's command only."""
    argv = [*step.argv, "--seed", str(seed), "--tag", f"seed{seed}"]
    if seed == ACCURACY_SEEDS[0] or step.dry_argv is None:
        dry_argv, skip = step.dry_argv, step.dry_run_skip
    else:
        dry_argv, skip = None, f"the dry run walks this command once ({step.name}-seed{ACCURACY_SEEDS[0]})"
    # Later seeds start from the compile cache the first one filled.
    cap_s = step.cap_s if seed == ACCURACY_SEEDS[0] else max(MIN_STEP_S, step.cap_s * 2 // 3)
    return replace(
        step, name=f"{step.name}-seed{seed}", argv=argv, dry_argv=dry_argv, dry_run_skip=skip, cap_s=cap_s
    )


def expand(names: list[str], known: list[str]) -> list[str]:
    """``--only`` names: a step's own name, or a seeded step's family (``cifar10_time_to_94``: every seed)."""
    chosen: list[str] = []
    for name in names:
        matches = [k for k in known if k == name or k.startswith(f"{name}-seed")]
        if not matches:
            raise ValueError(name)
        chosen.extend(m for m in matches if m not in chosen)
    return chosen


def _count_cases(stream_path: str, start_line: int) -> tuple[int, int]:
    """(cases measured, cases skipped) in the stream after ``start_line``."""
    if not os.path.exists(stream_path):
        return 0, 0
    with open(stream_path) as f:
        records = [json.loads(line).get("record") for line in f.readlines()[start_line:] if line.strip()]
    return records.count("case"), records.count("skipped")


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def run_step(step: Step, argv: list[str], deadline: float, out_dir: str, log_dir: str, env: dict) -> dict:
    """Run one step until its own deadline (the smaller of the global one and its cap); return its row."""
    row = {"step": step.name, "status": "", "seconds": 0.0, "cases": 0, "skipped_cases": 0, "note": ""}
    reason = step.missing()
    left = deadline - time.time()
    if reason is None and left < MIN_STEP_S:
        reason = f"deadline: {left:.0f}s left"
    if reason is not None:
        row.update(status="skipped", note=reason)
        print(f"\n=== {step.name}: skipped ({reason}) ===", flush=True)
        return row
    budget = min(step.cap_s, left)
    step_env = {**env, DEADLINE_ENV: f"{time.time() + budget - GRACE_S:.3f}"}
    stream_path = env[STREAM_ENV]
    first_line = _lines(stream_path)
    log_path = os.path.join(log_dir, f"{step.name}.log")
    print(f"\n=== {step.name} (up to {budget:.0f}s): {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, *argv],
                cwd=ROOT,
                env=step_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=budget,
                check=False,
            )
            status = "ok" if proc.returncode == 0 else f"failed (rc={proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"killed at {budget:.0f}s"
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["cases"], row["skipped_cases"] = _count_cases(stream_path, first_line)
    row["status"] = status
    with open(log_path) as log:
        tail = log.read().splitlines()[-12:]
    row["log_tail"] = tail
    print(
        f"=== {step.name}: {status} in {row['seconds']}s, {row['cases']} cases ===",
        *tail,
        sep="\n",
        flush=True,
    )
    return row


def hand_over(out_dir: str, summary: dict, results_dir: str, log_dir: str) -> None:
    """Rewrite the summary and the archive in ``out_dir`` (called after every step)."""
    tmp = os.path.join(out_dir, ".gpu_check-summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out_dir, "gpu_check-summary.json"))
    tmp = os.path.join(out_dir, ".gpu_results.tgz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        if os.path.isdir(results_dir):
            tar.add(results_dir, arcname="results")
        tar.add(log_dir, arcname="logs")
    os.replace(tmp, os.path.join(out_dir, "gpu_results.tgz"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="run only these steps, in the order given")
    parser.add_argument("--list", action="store_true", help="list the steps, their caps and commands")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S}, {DRY_RUN_BUDGET_S} for --dry-run)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: every step on tiny shapes (reference ops, the interpreter; compiled steps trace with "
        "backend 'eager', the loader's with 'aot_eager')",
    )
    parser.add_argument(
        "--out", default=None, help="where the results go (default $OUT, else benchmarks/results)"
    )
    args = parser.parse_args()
    started = time.time()
    work = tempfile.mkdtemp(prefix="lcv-gpu-check-")
    all_steps = steps()
    known = [s.name for s in all_steps]
    if args.only:
        try:
            chosen = expand(args.only, known)
        except ValueError as error:
            parser.error(f"unknown step {str(error)!r}; steps: {known}")
        by_name = {s.name: s for s in all_steps}
        all_steps = [by_name[name] for name in chosen]
    if args.list:
        print_table(
            [{"step": s.name, "cap_s": s.cap_s, "command": " ".join(s.argv)} for s in all_steps],
            ["step", "cap_s", "command"],
        )
        return
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; nothing measured (run it on the GPU machine, or use --dry-run)"
        )
        sys.exit(2)
    out_dir = args.out or os.environ.get("OUT") or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    # The dry run's full JSONs go to a scratch folder: its tiny CPU numbers must not replace real results.
    results_dir = (
        os.path.join(work, "results") if args.dry_run else os.environ.get(RESULTS_DIR_ENV, RESULTS_DIR)
    )
    log_dir = os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    stream_path = os.path.join(out_dir, "gpu_check.jsonl")
    if os.path.exists(stream_path):
        os.remove(stream_path)
    budget = args.budget or (DRY_RUN_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S)
    deadline = started + budget
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        STREAM_ENV: stream_path,
        RESULTS_DIR_ENV: results_dir,
        # kernels="auto" measures afresh (its per-block ratios are results), never from an old cache
        "LCV_KERNEL_CACHE_DIR": os.path.join(work, "kernel-cache"),
        "PYTHONPATH": os.pathsep.join(
            p
            for p in (
                ROOT,
                os.path.join(ROOT, "kernels"),
                os.path.join(ROOT, "vision"),
                os.environ.get("PYTHONPATH"),
            )
            if p
        ),
    }
    if not args.dry_run:
        env.pop("TRITON_INTERPRET", None)
    info = machine_info()
    print(
        f"gpu_check{' --dry-run' if args.dry_run else ''} on {info['device']} (driver {info['driver']}, "
        f"CUDA {info['cuda']}, cuDNN {info['cudnn']}), torch {info['torch']}, triton {info['triton']}, "
        f"commit {info['commit']}; budget {budget:.0f}s; results in {out_dir}",
        flush=True,
    )
    summary = {"machine": info, "dry_run": args.dry_run, "budget_s": budget, "steps": []}
    for step in all_steps:
        argv = step.dry_argv if args.dry_run else step.argv
        if argv is None:
            row = {
                "step": step.name,
                "status": "skipped",
                "seconds": 0.0,
                "cases": 0,
                "skipped_cases": 0,
                "note": step.dry_run_skip,
            }
        else:
            # A dry run checks that each step works, not how long it takes: on a busy CPU a step's GPU-sized
            # cap would kill it, so only the whole run's budget holds.
            capped = replace(step, cap_s=int(budget)) if args.dry_run else step
            row = run_step(capped, argv, deadline, out_dir, log_dir, env)
        summary["steps"].append(row)
        summary["elapsed_s"] = round(time.time() - started, 1)
        hand_over(out_dir, summary, results_dir, log_dir)
    shutil.rmtree(work, ignore_errors=True)  # everything in it is in the archive
    print(f"\nwhole run {summary['elapsed_s']}s of {budget:.0f}s; results in {out_dir}\n")
    print_table(summary["steps"], ["step", "status", "seconds", "cases", "skipped_cases", "note"])


if __name__ == "__main__":
    main()
