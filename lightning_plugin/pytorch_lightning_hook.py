"""Registering our strategies with the standalone ``pytorch_lightning`` package, without importing it ourselves.

Importing ``pytorch_lightning`` has side effects a user did not ask for: it routes ``lightning.pytorch``'s
rank-zero log messages to its own logger, so ``logging.getLogger("lightning.pytorch").setLevel(...)`` stops
working. So ``import lightning_plugin`` never imports it. Where the user imports it (before or after us), our
names are registered there too: at once if it is already imported, otherwise by a finder on ``sys.meta_path``
that runs ``lightning_plugin.pytorch_lightning_support`` right after ``pytorch_lightning`` has loaded. Lightning
has no entry point for third-party strategies, so a hook is the only way to register on someone else's import.
An explicit ``import lightning_plugin.pytorch_lightning_support`` does the same."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

PACKAGE = "pytorch_lightning"
SUPPORT = "lightning_plugin.pytorch_lightning_support"


def _register() -> None:
    try:
        importlib.import_module(SUPPORT)
    except ImportError as err:  # an installed but unusable pytorch_lightning must not break the user's import
        warnings.warn(
            f"lightning_plugin: strategy='compiled' is not available to pytorch_lightning.Trainer ({err}); "
            "lightning.pytorch.Trainer is unaffected",
            stacklevel=2,
        )


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands out the real spec of ``pytorch_lightning`` with a loader that registers
    our strategies once the package has executed."""

    def __init__(self) -> None:
        self._searching = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE or self._searching:
            return None
        # Stays installed until the package runs: ``importlib.util.find_spec`` probes (Lightning's
        # ``RequirementCache``) ask here too, and must not disarm it.
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            uninstall()  # imported once: a second import is served from sys.modules
            run(module)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _RegisterAfterImport()


def uninstall() -> None:
    """Remove the finder (nothing happens on a later ``import pytorch_lightning``)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def register_when_imported() -> None:
    """Register now if ``pytorch_lightning`` is imported already, else when (if ever) the user imports it."""
    if PACKAGE in sys.modules:
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
