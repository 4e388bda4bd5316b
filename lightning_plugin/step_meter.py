"""`StepMeter`: splits a training loop's wall time into step time and data wait, with no framework.

The Lightning callbacks that report throughput (``TrainingMonitor``'s ``StepMonitor``, ``lcv``'s
``ThroughputMeter``) are thin adapters that call it from their hooks, so the two cannot disagree on what a
step or a wait is. Times are read after a device synchronisation (``synchronize``), because a CUDA step
returns to Python long before its kernels finish."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["StepMeter", "StepTotals", "stream_synchronizer"]


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


class StepMeter:
    """Accumulates step time and data wait until :meth:`take` hands them over and starts a new span.

    Between ``step_started()`` and ``step_ended()`` the clock counts step time; from ``step_ended()`` (or
    ``discard()``) to the next ``step_started()`` it counts data wait. ``discard()`` drops the time since the
    last reading: call it after work that is neither (validation, writing logs, an epoch's start). Until the
    first ``discard()`` or ``step_ended()`` nothing counts as wait, so a run resumed mid-epoch starts clean.

    Args:
        clock: seconds, monotonic; ``None``: ``time.perf_counter``.
        synchronize: called before every reading (e.g. :func:`stream_synchronizer`); ``None`` for none.
    """

    def __init__(
        self, clock: Callable[[], float] | None = None, synchronize: Callable[[], None] | None = None
    ) -> None:
        self.clock = clock
        self.synchronize = synchronize
        self.reset()

    def reset(self) -> None:
        """Forget everything: no span, no last reading (a new run)."""
        self._mark: float | None = None  # the last reading
        self._in_step = False
        self._span = StepTotals()

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return self.clock() if self.clock is not None else time.perf_counter()

    def step_started(self) -> None:
        now = self._now()
        if self._mark is not None and not self._in_step:
            self._span = StepTotals(
                self._span.steps, self._span.samples, self._span.step_s, self._span.wait_s + now - self._mark
            )
        self._mark, self._in_step = now, True

    def step_ended(self, samples: int) -> None:
        now = self._now()
        step_s = now - self._mark if self._mark is not None and self._in_step else 0.0
        self._span = self._span + StepTotals(1, samples, step_s, 0.0)
        self._mark, self._in_step = now, False

    def discard(self) -> None:
        self._mark = self._now()

    @property
    def span(self) -> StepTotals:
        """The totals since the last :meth:`take`."""
        return self._span

    def take(self) -> StepTotals:
        span, self._span = self._span, StepTotals()
        return span


def stream_synchronizer(device: torch.device) -> Callable[[], None] | None:
    """Waits for the device's *current* stream only (``None`` off CUDA): a loader preparing the next batch on
    a side stream keeps overlapping with the step."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.current_stream(device).synchronize()
