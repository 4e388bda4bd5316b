"""A worker that dies mid-run must not hold `make test` until CI's time limit.

Each test runs a real ``pytest -n 2 --dist loadgroup`` with our scheduler (``tests/worker_crashes.py``)
over a small suite in which one test takes its worker down: killed as the kernel's OOM killer kills
(SIGKILL, no Python left to report anything), or hung until ``faulthandler_exit_on_timeout`` ends it. With
pytest-xdist 3.8's own loadgroup scheduler each of these runs waits forever after the replacement worker starts.
The run must end, report the one test as failed, and run every other test exactly once (grouped tests that
came after the dead one included).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker_crashes import CrashTolerantLoadGroupScheduling, describe_dead_worker

TESTS = Path(__file__).resolve().parent

SUITE = textwrap.dedent(
    """
    import ctypes, faulthandler, os, signal, time
    from pathlib import Path

    import pytest

    def _ran(name):
        with Path(os.environ["RECOVERY_LOG"]).open("a") as log:
            log.write(name + "\\n")
        if os.environ["RECOVERY_DIES_AT"] == name:
            if os.environ["RECOVERY_HOW"] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if os.environ["RECOVERY_HOW"] == "segfault":
                ctypes.string_at(0)
            time.sleep(600)  # hung in a way no Python exception can interrupt before the faulthandler exit
        # What torch's elastic error handler does: crash reports to fd 2, which pytest captures in a test.
        faulthandler.enable(all_threads=True)

    @pytest.mark.parametrize("i", range(10))
    def test_before(i):
        _ran(f"before{i}")

    @pytest.mark.xdist_group("shared")
    @pytest.mark.parametrize("i", range(4))
    def test_grouped(i):
        _ran(f"grouped{i}")

    def test_alone():
        _ran("alone")

    @pytest.mark.parametrize("i", range(10))
    def test_after(i):
        _ran(f"after{i}")
    """
)
NAMES = [f"before{i}" for i in range(10)] + [f"grouped{i}" for i in range(4)] + ["alone"]
NAMES += [f"after{i}" for i in range(10)]


def _run_suite(tmp_path: Path, dies_at: str, how: str, plugin: bool = True) -> tuple[str, str, list[str]]:
    """The inner run's stdout (the controller's report), stderr (what the workers print: faulthandler's
    stacks) and the tests that ran. Two pipes: in one, a progress dot can land inside a stack's first line."""
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log = tmp_path / "ran.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RECOVERY_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
        RECOVERY_LOG=str(log),
        RECOVERY_DIES_AT=dies_at,
        RECOVERY_HOW=how,
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "pytest.ini"]
    command += ["-n", "2", "--dist", "loadgroup", "-o", "faulthandler_timeout=3"]
    command += ["-o", "faulthandler_exit_on_timeout=true", "test_suite.py"]
    if plugin:
        command[3:3] = ["-p", "worker_crashes"]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        output, errors = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, errors = process.communicate()
        pytest.fail(
            f"the run did not end after its worker died at {dies_at}:\n{output[-3000:]}{errors[-3000:]}"
        )
    return output, errors, log.read_text().split()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("dies_at", "how"),
    [("alone", "sigkill"), ("grouped1", "sigkill"), ("after3", "hang"), ("after3", "segfault")],
)
def test_a_run_whose_worker_dies_ends_and_runs_every_other_test_once(
    tmp_path: Path, dies_at: str, how: str
) -> None:
    output, errors, ran = _run_suite(tmp_path, dies_at, how)
    assert f"1 failed, {len(NAMES) - 1} passed" in output, output[-3000:]
    assert f"crashed while running 'test_suite.py::test_{dies_at.rstrip('0123456789')}" in output, output[
        -3000:
    ]
    assert sorted(ran) == sorted(NAMES), "each test must run exactly once, the dead one not again"
    if how == "hang":  # the stack of the hung test reached the output before its worker ended
        assert "Timeout (0:00:03)!" in errors and "in _ran" in errors, errors[-3000:]
        assert "worker process exited with status 1;" in output, output[-3000:]
    elif how == "segfault":  # its stack too, though earlier tests pointed faulthandler at captured output
        assert "Fatal Python error: Segmentation fault" in errors and "in _ran" in errors, errors[-3000:]
        assert "worker process was killed by SIGSEGV;" in output, output[-3000:]
    else:
        assert "worker process was killed by SIGKILL (nothing can print" in output, output[-3000:]
    assert re.search(r"\d+ MiB of \d+ MiB available now", output), output[-3000:]


def test_the_suite_runs_with_the_crash_tolerant_scheduler(request: pytest.FixtureRequest) -> None:
    # tests/conftest.py loads the plugin; without it `make test` would use pytest-xdist's own scheduler.
    assert request.config.pluginmanager.has_plugin("worker_crashes")


class _Worker:
    """What the scheduler sees of a pytest-xdist worker: the test indices sent to it, and shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.queued: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queued += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _step(scheduler: Any, workers: list[_Worker]) -> int | None:
    """Run one test as pytest-xdist's workers do: a worker runs its next queued test once it holds the one
    after it too, or has been told to shut down (it needs the next test to know which fixtures to tear down)."""
    ready = [w for w in workers if w.queued and (len(w.queued) >= 2 or w.shutting_down)]
    if not ready:
        return None
    index = ready[0].queued.pop(0)
    scheduler.mark_test_complete(ready[0], index)
    return index


def test_the_scheduler_requeues_only_unfinished_work_of_a_dead_worker() -> None:
    collection = [f"t.py::test_{i}" for i in range(8)] + [f"t.py::test_g{i}@shared" for i in range(3)]
    collection += [f"t.py::test_{i}" for i in range(8, 12)]
    dies_at = collection.index("t.py::test_g1@shared")
    config = SimpleNamespace(
        getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=False)
    )
    scheduler = CrashTolerantLoadGroupScheduling(config)  # type: ignore[arg-type]
    workers = [_Worker("gw0"), _Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()

    ran: list[int] = []
    while not any(w.queued[:1] == [dies_at] for w in workers):  # run until a worker is about to run test_g1
        index = _step(scheduler, workers)
        assert index is not None, "the run stopped before the grouped tests"
        ran.append(index)
    dead = next(w for w in workers if w.queued[:1] == [dies_at])
    assert scheduler.remove_node(dead) == collection[dies_at]  # reported by pytest-xdist as failed
    assert all(not all(unit.values()) for unit in scheduler.workqueue.values()), (
        "a finished group went back on the queue: its worker would be sent no tests and never asked again"
    )

    replacement = _Worker("gw2")
    scheduler.add_node(replacement)
    scheduler.add_node_collection(replacement, collection)
    scheduler.schedule()
    workers = [w for w in workers if w is not dead] + [replacement]
    while (index := _step(scheduler, workers)) is not None:
        ran.append(index)

    assert sorted(ran) == [i for i in range(len(collection)) if i != dies_at], "others once, test_g1 never"
    assert scheduler.tests_finished and all(w.shutting_down for w in workers)


def test_a_dead_worker_is_described_by_its_signal_or_status() -> None:
    assert describe_dead_worker(-signal.SIGSEGV, "m") == "was killed by SIGSEGV; m"  # no OOM hint
    assert describe_dead_worker(-signal.SIGKILL, "m").startswith("was killed by SIGKILL (")
    assert describe_dead_worker(3, "m") == "exited with status 3; m"
    assert describe_dead_worker(None, "m") == "ended (exit status not known); m"
