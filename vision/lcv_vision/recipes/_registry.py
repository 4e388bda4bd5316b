"""The recipe registry (timm style): ``register_recipe``, ``list_recipes``, ``get_recipe``.

Unlike timm's model registry, a duplicate name *raises*: two recipes silently shadowing
each other would make ``lcv fit --recipe X`` depend on import order.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
from collections.abc import Callable
from typing import Any

from lcv_vision.recipes._recipe import Recipe

__all__ = ["UnknownRecipeError", "get_recipe", "list_recipes", "register_recipe"]

_recipes: dict[str, Recipe] = {}  # name -> validated Recipe (get_recipe hands out copies)


class UnknownRecipeError(ValueError):
    """Raised by :func:`get_recipe` for a name that is not registered; the message lists the known ones."""


def register_recipe(recipe: Recipe | Callable[[], Recipe]) -> Any:
    """Register a :class:`Recipe`, or decorate a zero-argument function returning one.

    Raises ``ValueError`` when the name is already taken or the recipe is inconsistent.
    Returns its argument, so it works as a decorator.
    """
    built = recipe() if callable(recipe) and not isinstance(recipe, Recipe) else recipe
    if not isinstance(built, Recipe):
        raise TypeError(
            f"register_recipe needs a Recipe (or a function returning one), got {type(built).__name__}"
        )
    if built.name in _recipes:
        raise ValueError(f"recipe {built.name!r} is already registered")
    _recipes[built.name] = built.validate()
    return recipe


def list_recipes(pattern: str = "*") -> list[str]:
    """Registered recipe names matching an fnmatch ``pattern``, sorted."""
    return sorted(n for n in _recipes if fnmatch.fnmatch(n, pattern))


def get_recipe(name: str, **overrides: Any) -> Recipe:
    """A copy of recipe ``name`` with ``overrides`` applied (``None`` values keep the recipe's defaults)."""
    if name not in _recipes:
        close = difflib.get_close_matches(name, list(_recipes), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownRecipeError(f"unknown recipe {name!r}.{hint} Known recipes: {', '.join(list_recipes())}")
    return copy.deepcopy(_recipes[name]).replace(**overrides)
