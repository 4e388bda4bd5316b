"""Dynamo's in-memory cache for the strategy's own frames, kept usable across many fits in one process.

Dynamo keeps compiled entries per code object (``forward``'s code, and the resume functions
it makes at graph breaks) and runs a frame eagerly, silently apart from a log line, once it
holds ``recompile_limit`` (8) entries. Fits with the same settings share their entries (the
strategy's backends compare equal, see ``CountingBackend``); this module clears what an
earlier compile *of ours* left that cannot serve the next one: entries made with other
settings, and frames dynamo gave up on (it keeps running those eagerly for good).
Entries made by anyone else's ``torch.compile`` are left alone.

Dynamo also remembers, per code, which input sizes changed between its compiles, and compiles that code with
those dimensions dynamic from then on ("automatic dynamic shapes"). A fit of another model through the same
``forward`` (a second workload, another input size) would then get a dynamic-shape graph, whose steps are
slower: torchvision ResNet-18 after a small CNN in one process, 158 against 133 ms per CPU step. Each compile
of ours starts from a clean slate for its frames; within a fit, dynamo's rule applies as usual (the smaller
last batch turns the batch dimension dynamic).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code

from lightning_plugin.compile.stats import CountingBackend

#: Code objects of the strategy's frames that dynamo gave up on in this process.
_GIVEN_UP: weakref.WeakSet[types.CodeType] = weakref.WeakSet()


def code_of(fn: Callable[..., Any]) -> types.CodeType | None:
    """The code object dynamo compiles for ``fn`` (a function or a bound method)."""
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def mark_given_up(code: types.CodeType | None) -> None:
    """Remember that dynamo ran (part of) ``code`` eagerly, so the next compile starts it afresh."""
    if code is not None:
        _GIVEN_UP.add(code)


def prepare(code: types.CodeType | None, backend: CountingBackend) -> int:
    """Clear our stale entries for ``code``; return how many cached entries ``backend`` will reuse."""
    if code is None:
        return 0
    for frame in _with_resume_functions(code):
        forget_changed_sizes(frame)
    ours = [_compiler_of(entry) for entry in _debug_get_cache_entry_list(code)]
    ours = [b for b in ours if isinstance(b, CountingBackend)]
    if code in _GIVEN_UP or any(b != backend for b in ours):
        for stale in _with_resume_functions(code):
            reset_code(stale)
        _GIVEN_UP.discard(code)
        return 0
    return len(ours)


def forget_changed_sizes(code: types.CodeType) -> None:
    """Drop dynamo's record of the sizes that changed for ``code`` (its automatic-dynamic state)."""
    try:
        from torch._dynamo import pgo

        state = pgo.get_code_state()
    except Exception:  # pragma: no cover - a torch without it: nothing is remembered there either
        return
    for key in [k for k in state if _same_code(k, code)]:
        del state[key]


def _same_code(key: Any, code: types.CodeType) -> bool:
    return (
        getattr(key, "filename", None) == code.co_filename
        and getattr(key, "firstlineno", None) == code.co_firstlineno
        and getattr(key, "name", None) == code.co_name
    )


def _compiler_of(entry: Any) -> Any:
    """The backend that made a cache entry (``torch.compile`` wraps callables in ``_TorchCompileWrapper``)."""
    backend = entry.backend
    return getattr(backend, "compiler_fn", backend)


def _with_resume_functions(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the resume functions dynamo generated from it at graph breaks (recursively)."""
    resumes: Any  # dynamo's ExactWeakKeyDictionary {code: {key: resume code}}, or {} where it is missing
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache

        resumes = ContinueExecutionCache.cache
    except (ImportError, AttributeError):  # pragma: no cover - older/newer torch: reset the frame only
        resumes = {}
    pending, seen = [code], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(resumes.get(current, {}).values())
