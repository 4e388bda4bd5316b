"""`ChangePoints`: which points of a rarely changing value (a learning rate, a peak memory) to log, so that a
value that never changes is one point and not a flat line, and a changing one still draws true.

Logged: the first value, and around each change the last point of the old value and the first of the new
(so a step schedule is drawn as a step, not as a ramp between two distant points); at the end, the last value
of a series that changed at least once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ChangePoints"]


@dataclass
class _Series:
    logged_step: int
    logged: float
    seen_step: int
    seen: float
    changed: bool = False


class ChangePoints:
    """Feed every reading to :meth:`points`; log what it and :meth:`end` return, ``{step: {tag: value}}``."""

    def __init__(self) -> None:
        self._series: dict[str, _Series] = {}

    def reset(self) -> None:
        self._series.clear()

    def points(self, step: int, values: Mapping[str, float]) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for tag, value in values.items():
            series = self._series.get(tag)
            if series is None:
                self._series[tag] = _Series(step, value, step, value)
                out.setdefault(step, {})[tag] = value
                continue
            if value != series.logged:
                if series.seen_step != series.logged_step:
                    out.setdefault(series.seen_step, {})[tag] = series.seen
                out.setdefault(step, {})[tag] = value
                series.logged_step, series.logged, series.changed = step, value, True
            series.seen_step, series.seen = step, value
        return dict(sorted(out.items()))

    def end(self) -> dict[int, dict[str, float]]:
        """The last value of each series that changed, where it was not logged yet."""
        out: dict[int, dict[str, float]] = {}
        for tag, series in self._series.items():
            if series.changed and series.seen_step != series.logged_step:
                out.setdefault(series.seen_step, {})[tag] = series.seen
                series.logged_step, series.logged = series.seen_step, series.seen
        return dict(sorted(out.items()))
