"""``torch.export`` of an inference module with a dynamic batch, and its failures as one line.

Why translate: an export failure is pages of graph dumps and hints; the user needs the operation that cannot
be captured, the line and the module (class and name in the model) that runs it.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import re
import traceback
from collections.abc import Iterator

import torch
from torch import nn

from lcv_vision.deploy.errors import UnexportableModelError

__all__ = ["MAX_BATCH", "capture", "locate_in_module"]

#: The largest batch a package accepts (the batch dimension is symbolic up to here).
MAX_BATCH = 4096

_LOCATION = re.compile(r'File "([^"]+)", line (\d+)|([^\s()"]+\.py):(\d+) in ')


def capture(module: nn.Module, example: torch.Tensor, strict: bool = False) -> torch.export.ExportedProgram:
    """Export ``module(example)`` with the batch dimension dynamic (1..:data:`MAX_BATCH`).

    ``example`` needs a batch of at least 2: a batch of 1 would specialise that dimension."""
    if example.shape[0] < 2:
        raise ValueError(f"export needs an example batch of >= 2 images, got {example.shape[0]}")
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        with _quiet_export_logs():
            return torch.export.export(module, (example,), dynamic_shapes=({0: batch},), strict=strict)
    except Exception as err:  # torch raises many types here (Unsupported, UserError, GuardOn...)
        raise UnexportableModelError(describe_failure(err, module)) from err


def describe_failure(err: BaseException, module: nn.Module) -> str:
    """``cannot export the model: <what> at <file:line> (`<code>`) in <Class> '<name>'``."""
    what = _what_failed(err)
    where = _locations(err)
    found = next(
        ((f, n, located) for f, n in reversed(where) if (located := locate_in_module(module, f, n))), None
    )
    if found is None:
        place = f" at {where[-1][0]}:{where[-1][1]}" if where else ""
        return f"cannot export the model: {what}{place}"
    file, line, (cls, name) = found
    code = linecache.getline(file, line).strip()
    return (
        f"cannot export the model: {what} at {file}:{line} (`{code}`) in {cls} '{name or '<root>'}'; "
        "torch.export needs one graph for every input"
    )


def locate_in_module(module: nn.Module, file: str, line: int) -> tuple[str, str] | None:
    """``(class name, qualified name)`` of the submodule whose ``forward`` holds ``file:line``, the deepest
    first."""
    best: tuple[str, str] | None = None
    for name, sub in module.named_modules():
        try:
            lines, start = inspect.getsourcelines(type(sub).forward)
            source = inspect.getsourcefile(type(sub).forward)
        except (OSError, TypeError):
            continue
        if source == file and start <= line < start + len(lines):
            if best is None or name.count(".") > best[1].count("."):
                best = (type(sub).__name__, name)
    return best


def _what_failed(err: BaseException) -> str:
    name = type(err).__name__
    if name == "GuardOnDataDependentSymNode":
        return "data-dependent Python control flow or a shape read from a tensor's value (.item())"
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), name)
    return f"{name}: {first[:200]}"


def _locations(err: BaseException) -> list[tuple[str, int]]:
    """Every ``file:line`` the error names: its message (dynamo's user stack) and its traceback (non-strict
    export runs the Python code), outermost first."""
    found = [(f.filename, int(f.lineno or 0)) for f in traceback.extract_tb(err.__traceback__)]
    for match in _LOCATION.finditer(str(err)):
        file, line = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
        found.append((file, int(line)))
    return found


@contextlib.contextmanager
def _quiet_export_logs() -> Iterator[None]:
    """Export logs the partial graph of a failure at WARNING; the one-line error says what matters."""
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_EXPORT_LOGGERS = ("torch._dynamo", "torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes")
