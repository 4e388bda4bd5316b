"""Is the ``kernels`` (or ``vision``) that Python finds the one shipped with lightning-compiled-vision?

Our layout fixes the top-level names ``kernels``, ``lightning_plugin`` and ``vision``, and the first and last
are generic: other distributions install them too (Hugging Face's ``kernels`` is on PyPI), and a local
directory of the same name on ``sys.path`` shadows an installed package. Without this check the symptom is an
unrelated ``ImportError`` deep inside our code. Each of our packages carries a marker line in its
``__init__.py``; it is read from the file (not imported), so checking ``vision`` from here does not import a
higher layer, and a copy of our own tree elsewhere (another checkout) still counts as ours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DISTRIBUTION = "lightning-compiled-vision"
#: Set in ``kernels/__init__.py`` and ``vision/__init__.py``, found there by ``require_own_package``.
MARKER = "__distribution__"
_MARKER_LINE = f'{MARKER} = "{DISTRIBUTION}"'
_ROOT = Path(__file__).resolve().parent.parent


class ForeignPackageError(ImportError):
    """A top-level package of ours is shadowed by, or mixed with, another distribution's of that name."""


def _found_at(name: str) -> tuple[Path | None, bool]:
    """Where ``import name`` loads from, and whether that package is ours (``(None, False)`` if none is
    found)."""
    module = sys.modules.get(name)
    if module is not None:  # already imported (or being imported): ask the module itself
        origin = getattr(module, "__file__", None)
        return (Path(origin).parent if origin else None), getattr(module, MARKER, None) == DISTRIBUTION
    spec = importlib.util.find_spec(name)  # top-level name: finds, does not import
    if spec is None:
        return None, False
    if spec.origin is None or not spec.origin.endswith(".py"):  # a namespace package, or no source to read
        locations = list(spec.submodule_search_locations or [])
        return (Path(locations[0]) if locations else None), False
    origin = Path(spec.origin)
    return origin.parent, _MARKER_LINE in origin.read_text(encoding="utf-8", errors="replace")


def require_own_package(name: str, required: bool = True) -> None:
    """Raise :class:`ForeignPackageError` when ``import name`` would load another distribution's package.

    ``required=False``: a missing package is fine (``vision`` is not needed by the plugin), a foreign one is
    not."""
    expected = _ROOT / name
    found, ours = _found_at(name)
    if ours:
        return
    if found is None:
        if required:
            raise ForeignPackageError(
                f"'{name}' is not importable; expected at {expected} (reinstall {DISTRIBUTION})"
            )
        return
    if found.resolve() == expected:
        problem = (
            f"'{name}' at {found} has files of two distributions mixed in one directory ({DISTRIBUTION}'s "
            f"and another that installs a top-level '{name}'): uninstall both "
            f"(`pip uninstall {name} {DISTRIBUTION}`), then reinstall {DISTRIBUTION} in its own virtual "
            f"environment"
        )
    else:
        problem = (
            f"'{name}' at {found} is not {DISTRIBUTION}'s '{name}' (expected at {expected}, beside "
            f"lightning_plugin): another distribution of that name (Hugging Face's `kernels` is one) or a "
            f"local directory comes first on sys.path; uninstall it (`pip uninstall {name}`), install "
            f"{DISTRIBUTION} in its own virtual environment, or rename the directory"
        )
    raise ForeignPackageError(problem)
