"""The prepared GPU check must stay runnable: every step names a script that exists and flags it accepts.

A stale flag would only show up on the lent GPU machine, where a failed step costs scarce device time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from script_loader import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def _load():
    return load_script("benchmarks/gpu_check.py")


def _accepted_flags(script: str) -> set[str]:
    with open(os.path.join(ROOT, script)) as f:
        return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", f.read()))


@pytest.mark.parametrize("step", _load().steps(), ids=lambda s: s.name)
def test_every_step_uses_existing_scripts_and_flags(step):
    script = step.argv[1]
    if script == "-m":  # pytest
        assert "-m" in step.argv and "gpu" in step.argv
        return
    assert os.path.exists(os.path.join(ROOT, script)), script
    used = {a for a in step.argv[2:] if a.startswith("--")}
    unknown = used - _accepted_flags(script)
    assert not unknown, f"{script} does not accept {sorted(unknown)}"


def test_time_limits_fit_one_device_call():
    assert sum(s.timeout_s for s in _load().steps()) <= 8 * 60


def test_without_a_gpu_it_says_so_and_measures_nothing():
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if proc.returncode == 2:
        assert "no CUDA device" in proc.stdout
    else:  # a GPU machine runs the real thing; nothing to assert here
        pytest.skip("a CUDA device is present")
