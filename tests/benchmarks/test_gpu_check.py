"""The prepared GPU check must work the first time it meets a GPU: its dry run runs here, in CI.

A stale flag, a crash in a step, a result written only at the end or a test file that stops collection on a
machine without albumentations would only show on the lent GPU machine, where each costs scarce device time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile

import pytest

from script_loader import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
VERSION_KEYS = {"gpu", "driver", "cuda", "cudnn", "torch", "triton", "commit", "date", "device"}


def _load():
    return load_script("benchmarks/gpu_check.py")


def _accepted_flags(script: str) -> set[str]:
    with open(os.path.join(ROOT, script)) as f:
        return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", f.read()))


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("step", _load().steps(), ids=lambda s: s.name)
def test_every_step_uses_existing_scripts_and_flags(step):
    for argv in (step.argv, step.dry_argv):
        if argv is None:
            assert step.dry_run_skip, f"{step.name} has no dry run and says nothing about why"
            continue
        if argv[0] == "-m":  # pytest
            assert "gpu" in argv
            continue
        assert os.path.exists(os.path.join(ROOT, argv[0])), argv[0]
        unknown = {a for a in argv[1:] if a.startswith("--")} - _accepted_flags(argv[0])
        assert not unknown, f"{argv[0]} does not accept {sorted(unknown)}"


def test_budget_leaves_set_up_time_in_one_eight_minute_call():
    module = _load()
    assert module.DEFAULT_BUDGET_S + 60 <= 8 * 60
    names = [s.name for s in module.steps()]
    # end to end first: correctness, then the time-to-accuracy pairs seed by seed, kernels last
    pairs = [
        f"{bench}-seed{seed}"
        for seed in module.ACCURACY_SEEDS
        for bench in ("cifar10_time_to_94", "airbench_reference")
    ]
    assert names[: 1 + len(pairs)] == ["correctness", *pairs]
    end_to_end = [names.index(n) for n in ("resnet50_train", "step_overhead", "loader", "conv", "norms")]
    assert end_to_end == sorted(end_to_end)
    assert names[-1] == "max_autotune" and len(set(names)) == len(names)


def test_list_names_the_steps_and_only_takes_a_seeded_family():
    listed = subprocess.run(
        [sys.executable, SCRIPT, "--list", "--only", "correctness", "airbench_reference"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    rows = [line.split()[0] for line in listed.splitlines()[2:] if line.strip()]
    assert rows == ["correctness", *(f"airbench_reference-seed{seed}" for seed in _load().ACCURACY_SEEDS)]
    assert "--seed 1 --tag seed1" in listed  # each seed writes its own result file
    wrong = subprocess.run(
        [sys.executable, SCRIPT, "--list", "--only", "airbench"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert (
        wrong.returncode == 2 and "unknown step 'airbench'" in wrong.stderr and "correctness" in wrong.stderr
    )


def test_dry_run_runs_every_step_and_hands_over_versioned_results(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--dry-run",
            "--budget",
            "3000",
            "--out",
            str(out),
        ],  # no step trimmed by load
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=850,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "gpu_check-summary.json").read_text())
    assert summary["dry_run"] is True and VERSION_KEYS <= set(summary["machine"])
    rows = {r["step"]: r for r in summary["steps"]}
    for step in _load().steps():
        row = rows[step.name]
        if step.dry_argv is None:
            assert row["status"] == "skipped" and row["note"] == step.dry_run_skip
            continue
        assert row["status"] == "ok", (step.name, row)
        if step.name != "gpu_tests":  # pytest measures nothing; every benchmark measures something
            assert row["cases"] > 0, (step.name, row)
    records = _records(out / "gpu_check.jsonl")
    machines = [r for r in records if r["record"] == "machine"]
    assert {r["bench"] for r in machines} >= {
        "op_correctness",
        "conv",
        "resnet_train",
        "loader",
        "strategy_overhead",
    }
    for machine in machines:
        assert VERSION_KEYS <= set(machine), machine
    cases = [r for r in records if r["record"] == "case"]
    assert all(r["ok"] for r in cases if r["bench"] == "op_correctness")
    conv_cases = {(r["case"], r["provider"]) for r in cases if r["bench"] == "conv"}
    assert ("conv+bn+relu fwd+bwd", "ours") in conv_cases and ("conv", "inductor:max-autotune") in conv_cases
    with tarfile.open(out / "gpu_results.tgz") as tar:
        names = tar.getnames()
    assert {f"logs/{s.name}.log" for s in _load().steps() if s.dry_argv} <= set(names)
    assert "results/op_correctness-cpu.json" in names
    # the dry run's tiny numbers never replace real results in the repository
    assert not (out / "results").exists()


def test_a_step_killed_at_its_cap_keeps_what_it_measured(tmp_path):
    """A benchmark that hangs after measuring one case is killed; its case is in the stream already."""
    module = _load()
    script = tmp_path / "slow_bench.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
        from _common import ResultStream
        ResultStream("slow").add({{"case": "first", "ms": 1.0}})
        time.sleep(60)
    """)
    )
    stream = tmp_path / "stream.jsonl"
    env = {**os.environ, module.STREAM_ENV: str(stream)}
    # The cap leaves the script ~10x what its start and its one record take on an idle core (a torch import).
    step = module.Step("slow", [str(script)], cap_s=12, dry_argv=None)
    # Killed at its cap (a status, not a measured duration: the machine's speed does not enter it). The
    # deadline is an absolute time the API takes, far enough not to matter.
    row = module.run_step(step, step.argv, time.time() + 600, str(tmp_path), str(tmp_path), env)
    assert row["status"].startswith("killed") and row["cases"] == 1
    assert [r["case"] for r in _records(stream) if r["record"] == "case"] == ["first"]


def test_a_step_is_skipped_when_the_deadline_leaves_too_little(tmp_path):
    module = _load()
    step = module.Step("late", ["benchmarks/op_correctness.py", "--tiny"], cap_s=60, dry_argv=None)
    row = module.run_step(
        step,
        step.argv,
        time.time() + 5,
        str(tmp_path),
        str(tmp_path),
        {module.STREAM_ENV: str(tmp_path / "s.jsonl")},
    )
    assert row["status"] == "skipped" and "deadline" in row["note"]


def test_benchmarks_start_no_case_past_their_deadline(tmp_path):
    stream = tmp_path / "stream.jsonl"
    env = {
        **os.environ,
        "LCV_DEADLINE": str(time.time() - 1),
        "LCV_RESULTS_JSONL": str(stream),
        "LCV_RESULTS_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "benchmarks/op_correctness.py", "--tiny"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = _records(stream)
    assert [r["record"] for r in records if r["record"] != "machine"] == ["skipped"] * 12
    assert all(r["reason"] == "deadline reached" for r in records if r["record"] == "skipped")


def test_commit_is_taken_from_the_environment_in_a_copy_without_git(tmp_path):
    copy = tmp_path / "benchmarks"
    copy.mkdir()
    with open(os.path.join(ROOT, "benchmarks", "_common.py")) as f:
        (copy / "_common.py").write_text(f.read())
    code = "import _common; print(_common.machine_info()['commit'])"
    env = {**os.environ, "LCV_COMMIT": "abc1234", "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=copy, env=env, check=True
    ).stdout
    assert out.strip() == "abc1234"


def test_commit_from_the_environment_wins_over_a_stale_git_in_the_copy(tmp_path):
    """The lent GPU machine's copy carried a .git at an older commit: its results were labelled with it."""
    copy = tmp_path / "benchmarks"
    copy.mkdir()
    with open(os.path.join(ROOT, "benchmarks", "_common.py")) as f:
        (copy / "_common.py").write_text(f.read())
    git = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "old"]):
        subprocess.run(cmd, cwd=tmp_path, env=git, check=True)
    code = "import _common; print(_common.machine_info()['commit'])"
    stale = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=copy, check=True
    ).stdout.strip()
    named = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=copy,
        env={**os.environ, "LCV_COMMIT": "abc1234"},
        check=True,
    ).stdout.strip()
    assert stale != "abc1234" and named == "abc1234"


def test_gpu_tests_collect_where_optional_packages_are_missing(tmp_path):
    """The GPU image has no albumentations, jsonargparse or airbench: collection must skip, never stop."""
    for name in ("albumentations", "jsonargparse", "airbench"):
        (tmp_path / name).mkdir()
        message = f"No module named {name!r} (hidden by the test)"
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({message!r}, name={name!r})\n"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, f"{ROOT}/kernels", f"{ROOT}/vision"]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-m",
            "gpu",
            "tests",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "error" not in proc.stdout.splitlines()[-1].lower()
    collected = re.search(r"(\d+)/\d+ tests collected", proc.stdout)
    assert collected and int(collected.group(1)) >= 10  # the GPU tests of every kernel and the loader
    imports = (
        "import lcv_kernels, lightning_plugin, lcv_vision, lcv_vision.data, lcv_vision.models, "
        "lcv_vision.recipes, lcv_vision.module"
    )
    core = subprocess.run(
        [sys.executable, "-c", imports], env=env, capture_output=True, text=True, check=False
    )
    assert core.returncode == 0, core.stderr[-2000:]


def test_device_data_round_trip_is_byte_identical(tmp_path):
    module = load_script("benchmarks/device_data.py")
    source = tmp_path / "a.zip"
    members = {f"train/c{i % 3}/{i:04d}.jpg": os.urandom(100 + i) for i in range(20)}
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr("train/", b"")  # a directory entry is not a member to carry
        for name, data in members.items():
            zf.writestr(name, data)
    assert module.pack(str(source), str(tmp_path / "p.npz")) == 20
    assert module.unpack(str(tmp_path / "p.npz"), str(tmp_path / "b.zip")) == 20
    with zipfile.ZipFile(tmp_path / "b.zip") as zf:
        assert zf.namelist() == list(members)
        assert all(zf.read(name) == data for name, data in members.items())


def test_conv_benchmark_fwd_bwd_computes_the_input_gradient():
    """The fwd+bwd rows count three convolutions' FLOPs: dgrad must really run, on both sides."""
    code = textwrap.dedent("""
        import torch, conv
        x = torch.randn(2, 3, 6, 6, requires_grad=True)
        eager = conv.eager_block(3, 4, 3, 1, 1)
        ours = conv.FusedConvBNAct.from_modules(*conv.eager_block(3, 4, 3, 1, 1))
        ours.load_state_dict({"conv.weight": eager[0].weight,
                              **{f"bn.{k}": v for k, v in eager[1].state_dict().items()}})
        conv.forward_backward(eager, x); g_eager = x.grad.clone()
        conv.forward_backward(ours, x)
        # dgrad sums C_out*R*S = 4*9 products per pixel after BN's backward sums over N*H*W = 2*6*6
        from lcv_kernels.tolerances import reduction_tolerance
        atol, rtol = reduction_tolerance(torch.float32, 4 * 9 + 2 * 6 * 6)
        bound = atol + rtol * float(g_eager.abs().max())
        assert g_eager.abs().sum() > 0 and torch.allclose(x.grad, g_eager, rtol=0, atol=bound), "dgrad differs"
        print("ok")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.join(ROOT, "benchmarks"),
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
        check=False,
    )
    assert proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_loader_pipelines_equal_the_albumentations_ones_they_are_timed_against():
    """On the GPU machine (no albumentations) ours is built natively: it must be the same pipeline."""
    pytest.importorskip("albumentations")
    import torch

    from lcv_vision.data import from_albumentations

    loader = load_script("benchmarks/loader.py")
    images = torch.randint(0, 256, (6, 3, 40, 36), dtype=torch.uint8)
    for native, compose in (
        (loader.ours_cifar(), loader.alb_cifar()),
        (loader.ours_imagenet(), loader.alb_imagenet()),
    ):
        a, _ = native(images, generator=torch.Generator().manual_seed(3))
        b, _ = from_albumentations(compose)(images, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_without_a_gpu_it_says_so_and_measures_nothing():
    proc = subprocess.run(
        [sys.executable, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    if proc.returncode == 2:
        assert "no CUDA device" in proc.stdout
    else:  # a GPU machine runs the real thing; nothing to assert here
        pytest.skip("a CUDA device is present")
