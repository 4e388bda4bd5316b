"""glibc keeping freed memory (``lightning_plugin.cpu.memory``): the page faults of a step-like pattern of
allocations disappear, and nothing is touched where the C library is not glibc."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from lightning_plugin.cpu import memory as cpu_memory

# A training step in miniature: 40 buffers of 256 KiB to 12 MiB allocated and written (activations), then all
# freed (end of the step); the minor page faults of the last rounds are counted. glibc adjusts its thresholds
# as a process runs, and whether this pattern faults under that adjustment varies from run to run (a compiled
# training step did: 2,454 faults per step against 35 kept, see the module). So both children start from
# glibc's documented initial thresholds (128 KiB), fixed: the freed top of the heap then goes back to the
# kernel every round, and the next round faults its pages in again, unless ``retain_freed_memory`` changes
# the thresholds afterwards.
_STEPS = """
import ctypes, json, resource, sys
import torch
from lightning_plugin.cpu import memory as cpu_memory
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(cpu_memory.M_TRIM_THRESHOLD, 128 * 1024) == 1
assert libc.mallopt(cpu_memory.M_MMAP_THRESHOLD, 128 * 1024) == 1
SIZES = [1 << 16, 1 << 18, 1 << 20, 3 << 20]  # float32 elements
if sys.argv[1] == "kept":
    assert cpu_memory.retain_freed_memory()
def step():
    buffers = [torch.empty(n).fill_(1.0) for n in SIZES * 10]
    del buffers
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5))
"""

_PAGES_PER_STEP = 10 * 4 * ((1 << 16) + (1 << 18) + (1 << 20) + (3 << 20)) // 4096


def _faults_per_step(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_kept_memory_stops_the_page_faults_of_each_step():
    default = _faults_per_step("default")
    kept = _faults_per_step("kept")
    assert default > 0.5 * _PAGES_PER_STEP, default  # glibc's initial thresholds re-fault most pages
    assert kept < 0.05 * _PAGES_PER_STEP, kept


def test_not_glibc_changes_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a, **k: calls.append(a))
    assert cpu_memory.retain_freed_memory() is False
    assert calls == []
    assert cpu_memory.retain_freed_memory() is False  # decided once per process


def test_refused_mallopt_reports_false(monkeypatch):
    class Mallopt:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def __call__(self, param: int, value: int) -> int:
            self.calls.append((param, value))
            return 0  # glibc's answer for a refused setting

    class FakeLibc:
        mallopt = Mallopt()

    libc = FakeLibc()
    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda *a, **k: libc)
    assert cpu_memory.retain_freed_memory() is False
    assert libc.mallopt.calls == [(cpu_memory.M_TRIM_THRESHOLD, cpu_memory.TRIM_THRESHOLD_BYTES)]
