"""What `make test` does when a pytest-xdist worker dies: the run ends, and its output says why.

`make test` runs two pytest-xdist workers with ``--dist loadgroup``. When a worker dies (a segfault in native
code, the kernel's OOM killer, ``faulthandler_exit_on_timeout`` ending a hung test), pytest-xdist 3.8 reports
the test it died on as failed and starts a replacement worker, but its loadgroup scheduler then waits forever:

- the dead worker's *finished* groups go back on the queue, and a worker handed one gets an empty list of
  tests, never reports a result, and so is never given more work (pytest-xdist issues 1323, 1378);
- a replacement handed a single test waits for a second one before running it (a worker runs a test only
  once it knows the next), and only that worker's own results would bring it one (issue 1327).

A CI run that waits so is stopped at its time limit and says nothing about why (it happened on 2026-12-07).
``CrashTolerantLoadGroupScheduling`` keeps pytest-xdist's grouping and order and fixes only the recovery:
the dead worker's finished groups stay finished, the test it died on is not run again (it is already reported
as failed, and would likely take the replacement down too), its unfinished tests go back on the queue, and
every live worker is kept at two or more queued tests or told to finish.

Two more things keep a death from being silent. A library that calls ``faulthandler.enable()`` during a test
points Python's crash report at file descriptor 2, which pytest captures during each test and drops with the
dead worker, so every later segfault printed nothing: each test starts with it pointed back at pytest's copy of
the real stderr. And a worker killed by SIGKILL (the OOM killer's signal) prints nothing at all, so the run
says how each dead worker ended and how much memory the machine had left. ``tests/test_worker_crashes.py``
kills workers in real pytest-xdist runs and checks all of this.
"""

from __future__ import annotations

import faulthandler
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController


class CrashTolerantLoadGroupScheduling(LoadGroupScheduling):
    """pytest-xdist's ``LoadGroupScheduling`` that recovers from a dead worker instead of waiting forever."""

    def remove_node(self, node: WorkerController) -> str | None:
        workload = self.assigned_work.pop(node)  # KeyError for an unknown node, as pytest-xdist expects
        crashitem = next(
            (nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None
        )
        if crashitem is None:
            return None
        for unit in workload.values():
            if crashitem in unit:
                unit[crashitem] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.nodes:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node: WorkerController) -> None:
        if node not in self.registered_collections:
            return  # a replacement still collecting: ``schedule()`` gives it work once its collection is in
        super()._reschedule(node)
        while not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not node.shutting_down and not self.workqueue:
            node.shutdown()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadGroupScheduling | None:
    """Use the crash-tolerant scheduler for ``--dist loadgroup``; pytest-xdist's own for any other mode."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    return CrashTolerantLoadGroupScheduling(config, log)


def _exit_status(node: WorkerController) -> int | None:
    """The dead worker's exit status (negative: the signal that killed it); None where execnet hides it."""
    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)  # execnet's Popen2IOMaster
    if not isinstance(popen, subprocess.Popen):
        return None
    try:
        return popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None


def _memory_left() -> str:
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available, total = (int(fields[name].split()[0]) // 1024 for name in ("MemAvailable", "MemTotal"))
    except (OSError, KeyError, ValueError):
        return "memory left not known"
    return f"{available} MiB of {total} MiB available now"


def describe_dead_worker(status: int | None, memory_left: str) -> str:
    """One line on how a worker ended, for the run's output."""
    if status is None:
        how = "ended (exit status not known)"
    elif status < 0:
        name = signal.Signals(-status).name if -status in signal.valid_signals() else f"signal {-status}"
        how = f"was killed by {name}"
        if -status == signal.SIGKILL:
            how += " (nothing can print a stack then: the kernel's OOM killer sends it)"
    else:
        how = f"exited with status {status}"
    return f"{how}; {memory_left}"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: WorkerController, error: object | None) -> None:
    if error is None:  # a worker that finished its tests
        return
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        line = describe_dead_worker(_exit_status(node), _memory_left())
        reporter.write_line(f"[{node.gateway.id}] worker process {line}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Point Python's crash report back at the real stderr before each test (see the module's docstring)."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key
    except ImportError:  # pytest moved it: the reports may go missing again, the tests still run
        return
    if faulthandler.is_enabled() and fault_handler_stderr_fd_key in item.config.stash:
        faulthandler.enable(file=item.config.stash[fault_handler_stderr_fd_key], all_threads=True)
