"""A test stuck where no Python timeout reaches it (a oneDNN spin in native code once held a CI run silently until
its 90-minute limit) has its stack printed into the run's output, under pytest-xdist as ``make test`` runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_stack_dump_comes_after_every_python_timeout(pytestconfig: pytest.Config):
    marked = [
        float(seconds)
        for path in Path(ROOT, "tests").rglob("*.py")
        for seconds in re.findall(r"mark\.timeout\((\d+)\)", path.read_text())
    ]
    assert marked, "no test marks its own timeout: the pattern above no longer matches how they do"
    dump_after = float(pytestconfig.getini("faulthandler_timeout"))
    assert dump_after > max([float(pytestconfig.getini("timeout")), *marked])


def test_a_test_held_in_native_code_gets_its_stack_printed_by_an_xdist_worker(tmp_path):
    # time.sleep stands in for native code: SIGALRM-based timeouts are off (timeout=0), so only faulthandler's
    # watchdog thread can report it, as it would a C loop that never returns to the interpreter.
    (tmp_path / "test_stuck.py").write_text(
        "import time\n\ndef test_stuck_in_native_code():\n    time.sleep(4)\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "1",
            "-o",
            "timeout=0",
            "-o",
            "faulthandler_timeout=1",
            f"--rootdir={tmp_path}",
            "-c",
            os.devnull,
            str(tmp_path / "test_stuck.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Timeout (0:00:01)!" in output and "in test_stuck_in_native_code" in output, output[-3000:]
