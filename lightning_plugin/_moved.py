"""Old module paths that users may have imported, kept working for one release with a warning.

The plugin's modules moved into folders (``strategies/``, ``compile/``, ``kernel_choice/``, ``cpu/``); a user's
``from lightning_plugin.strategy import CompiledStrategy`` still works, and says where the name lives now."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

#: old module -> new module, for the paths that keep a forwarding module
MOVED: dict[str, str] = {
    "lightning_plugin.strategy": "lightning_plugin.strategies.single_device",
    "lightning_plugin.ddp": "lightning_plugin.strategies.ddp",
    "lightning_plugin.compile_stats": "lightning_plugin.compile.stats",
    "lightning_plugin.substitution": "lightning_plugin.kernel_choice.substitution",
    "lightning_plugin.kernel_selection": "lightning_plugin.kernel_choice.selection",
}


def forward_to(old: str) -> Callable[[str], Any]:
    """Warn that ``old`` moved, and return a module ``__getattr__`` that reads every name from its new module."""
    new = MOVED[old]
    warnings.warn(
        f"{old} moved to {new}; import from there (or from lightning_plugin); the old path goes in a later release",
        DeprecationWarning,
        stacklevel=3,
    )

    def __getattr__(name: str) -> Any:
        return getattr(importlib.import_module(new), name)

    return __getattr__
