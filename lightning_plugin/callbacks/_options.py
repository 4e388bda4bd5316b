"""Option checks of the monitoring callbacks: one rule per option name, shared by all of them.

A rule per name (not per class) keeps one wording for an option wherever it is accepted, and lets
``TrainingMonitor`` check all its options under its own name before it builds the parts (which check theirs
again, under theirs, when used alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and value > 0


def _optional_positive_number(value: Any) -> bool:
    return value is None or _positive_number(value)


#: name -> (accepts the value?, exception type, what it must be)
_RULES: dict[str, tuple[Callable[[Any], bool], type[Exception], str]] = {
    "log_every_n_steps": (lambda v: v is None or _positive_int(v), ValueError, "a positive int or None"),
    "num_images": (_positive_int, ValueError, "a positive int"),
    "flops_per_sample": (_optional_positive_number, ValueError, "a positive finite number or None"),
    "peak_flops": (_optional_positive_number, ValueError, "a positive finite number or None"),
    "measure_flops": (lambda v: isinstance(v, bool), TypeError, "a bool"),
    "log_images": (lambda v: isinstance(v, bool), TypeError, "a bool"),
    "log_hparams": (lambda v: isinstance(v, bool), TypeError, "a bool"),
    "batch_size_fn": (lambda v: v is None or callable(v), TypeError, "callable or None"),
}


def check_options(owner: str, **options: Any) -> None:
    """Raise on the first option that breaks its rule: ``"<owner>: <name> must be <rule>, got <value>"``."""
    for name, value in options.items():
        accepts, error, rule = _RULES[name]
        if not accepts(value):
            raise error(f"{owner}: {name} must be {rule}, got {value!r}")


def check_normalization(
    owner: str, mean: Sequence[float] | None, std: Sequence[float] | None
) -> tuple[list[float], list[float]] | None:
    """``mean``/``std`` as float lists (both or neither, same non-zero length, std positive); None for
    neither."""
    if (mean is None) != (std is None):
        raise ValueError(f"{owner}: pass both `mean` and `std`, or neither")
    if mean is None or std is None:
        return None
    if len(mean) != len(std) or len(mean) == 0:
        raise ValueError(f"{owner}: mean and std need the same non-zero length, got {mean!r} / {std!r}")
    if any(s <= 0 for s in std):
        raise ValueError(f"{owner}: std values must be positive, got {std!r}")
    return [float(m) for m in mean], [float(s) for s in std]
