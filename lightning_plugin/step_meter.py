"""`StepMeter`: splits a training loop's wall time into step time and data wait, with no framework.

The Lightning callbacks that report throughput (``TrainingMonitor``'s ``StepMonitor``, ``lcv``'s
``ThroughputMeter``) are thin adapters that call it from their hooks, so the two cannot disagree on what a
step or a wait is. A CUDA step returns to Python long before its kernels finish, so on a GPU the meter reads
the time from timing events recorded on the device's stream (:class:`CudaEventClock`), resolved only when a span
is read: no host sync per step. Elsewhere it reads the host clock (:class:`HostClock`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "CudaEventClock",
    "HostClock",
    "StepMeter",
    "StepTotals",
    "Timeline",
    "device_timeline",
    "stream_synchronizer",
]


@dataclass(frozen=True)
class StepTotals:
    """What a span of steps (a logging window, an epoch) cost."""

    steps: int = 0
    samples: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0  # between steps: fetching the next batch

    @property
    def busy_s(self) -> float:
        return self.step_s + self.wait_s

    @property
    def samples_per_sec(self) -> float | None:
        """End to end: data wait included."""
        return self.samples / self.busy_s if self.busy_s > 0 and self.samples > 0 else None

    @property
    def data_wait_fraction(self) -> float | None:
        return self.wait_s / self.busy_s if self.busy_s > 0 else None

    @property
    def mean_step_s(self) -> float | None:
        return self.step_s / self.steps if self.steps else None

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(
            self.steps + other.steps,
            self.samples + other.samples,
            self.step_s + other.step_s,
            self.wait_s + other.wait_s,
        )

    def __sub__(self, other: StepTotals) -> StepTotals:
        return StepTotals(
            self.steps - other.steps,
            self.samples - other.samples,
            self.step_s - other.step_s,
            self.wait_s - other.wait_s,
        )


class Timeline(Protocol):
    """Where the meter reads the time: ``mark()`` is called in every hook and must be cheap; ``seconds``
    is called only when a span is read (:meth:`StepMeter.take`), and may wait for the device there."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class HostClock:
    """The host clock, read after ``synchronize()`` (when given)."""

    def __init__(
        self, clock: Callable[[], float] | None = None, synchronize: Callable[[], None] | None = None
    ) -> None:
        self.clock = clock
        self.synchronize = synchronize

    def mark(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return self.clock() if self.clock is not None else time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """Timing events recorded on the device's current stream: a mark enqueues an event and returns at once,
    so a step costs no host sync; the host waits only when a span is read (once per logging window).

    The gap between one step's end and the next step's start is then the time the *device* sat idle waiting
    for the next batch: a loader that keeps ahead of the device shows no data wait, as it should.

    Args:
        device: the CUDA device whose current stream is marked.
        event_factory: makes a timing event (``torch.cuda.Event(enable_timing=True)``; tests pass a fake).
    """

    def __init__(self, device: torch.device, event_factory: Callable[[], Any] | None = None) -> None:
        self.device = device
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))

    def mark(self) -> Any:
        event = self.event_factory()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()  # both recorded on one stream: start is done when end is
        return float(start.elapsed_time(end)) / 1e3


class StepMeter:
    """Accumulates step time and data wait until :meth:`take` hands them over and starts a new span.

    Between ``step_started()`` and ``step_ended()`` the clock counts step time; from ``step_ended()`` (or
    ``discard()``) to the next ``step_started()`` it counts data wait. ``discard()`` drops the time since the
    last reading: call it after work that is neither (validation, writing logs, an epoch's start). Until the
    first ``discard()`` or ``step_ended()`` nothing counts as wait, so a run resumed mid-epoch starts clean.

    The intervals are kept as pairs of marks and turned into seconds only when the span is read
    (:attr:`span`, :meth:`take`), so a :class:`CudaEventClock` costs no host sync per step; :attr:`steps`
    counts without reading anything.

    Args:
        clock: seconds, monotonic; ``None``: ``time.perf_counter``.
        synchronize: called before every reading of the host clock (e.g. :func:`stream_synchronizer`).
        timeline: where to read the time instead of the host clock (e.g. :class:`CudaEventClock`).
    """

    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        synchronize: Callable[[], None] | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.timeline: Timeline = timeline if timeline is not None else HostClock(clock, synchronize)
        self.reset()

    @property
    def synchronize(self) -> Callable[[], None] | None:
        return getattr(self.timeline, "synchronize", None)

    @synchronize.setter
    def synchronize(self, synchronize: Callable[[], None] | None) -> None:
        """Read the host clock after ``synchronize()`` from now on."""
        self.timeline = HostClock(getattr(self.timeline, "clock", None), synchronize)

    def reset(self) -> None:
        """Forget everything: no span, no last reading (a new run)."""
        self._mark: Any = None  # the last reading
        self._in_step = False
        self._span = StepTotals()
        self._pending: list[tuple[bool, Any, Any]] = []  # (is a step, start mark, end mark)

    def step_started(self) -> None:
        now = self.timeline.mark()
        if self._mark is not None and not self._in_step:
            self._pending.append((False, self._mark, now))
        self._mark, self._in_step = now, True

    def step_ended(self, samples: int) -> None:
        now = self.timeline.mark()
        if self._mark is not None and self._in_step:
            self._pending.append((True, self._mark, now))
        self._span = self._span + StepTotals(1, samples, 0.0, 0.0)
        self._mark, self._in_step = now, False

    def discard(self) -> None:
        self._mark = self.timeline.mark()

    @property
    def steps(self) -> int:
        """Steps ended since the last :meth:`take`; reads no clock."""
        return self._span.steps

    @property
    def span(self) -> StepTotals:
        """The totals since the last :meth:`take` (waits for the device with a :class:`CudaEventClock`)."""
        step_s = wait_s = 0.0
        for is_step, start, end in self._pending:
            seconds = self.timeline.seconds(start, end)
            step_s, wait_s = (step_s + seconds, wait_s) if is_step else (step_s, wait_s + seconds)
        self._pending.clear()
        self._span = self._span + StepTotals(0, 0, step_s, wait_s)
        return self._span

    def take(self) -> StepTotals:
        span, self._span = self.span, StepTotals()
        return span


def device_timeline(device: torch.device) -> Timeline:
    """CUDA timing events on a GPU (no host sync per step), the host clock elsewhere."""
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


def stream_synchronizer(device: torch.device) -> Callable[[], None] | None:
    """Waits for the device's *current* stream only (``None`` off CUDA): a loader preparing the next batch on
    a side stream keeps overlapping with the step."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.current_stream(device).synchronize()
