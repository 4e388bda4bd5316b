"""Registering the compiled strategies by name in a Lightning strategy registry."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class _Overriding:
    """Registers with ``override=True`` so a re-import (e.g. a reload in a notebook) does not fail."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def register(self, name: str, strategy: Any, description: str | None = None, **init_params: Any) -> None:
        self.registry.register(name, strategy, description, override=True, **init_params)


def register_all(registry: Any, strategies: Iterable[Any]) -> None:
    """Each class registers its names (``register_strategies``, Lightning's convention) in ``registry``."""
    for strategy in strategies:
        strategy.register_strategies(_Overriding(registry))
