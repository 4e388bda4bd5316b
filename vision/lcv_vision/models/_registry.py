"""The model registry: names to entrypoint functions, with torchvision/timm as fallbacks.

Kept separate from the architectures so that every model file only imports
``register_model`` and the factory knows nothing about any one architecture.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn

ModelFn = Callable[..., nn.Module]

_model_entrypoints: dict[str, ModelFn] = {}  # name -> function(num_classes=..., **kwargs) -> nn.Module


def register_model(fn: ModelFn) -> ModelFn:
    """Decorator: register ``fn`` under its ``__name__``. A second model with the same name raises."""
    name = fn.__name__
    if name in _model_entrypoints:
        raise ValueError(f"model {name!r} is already registered (by {_model_entrypoints[name].__module__})")
    _model_entrypoints[name] = fn
    return fn


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching an fnmatch ``pattern``, sorted."""
    return sorted(n for n in _model_entrypoints if fnmatch.fnmatch(n, pattern))


def is_model(name: str) -> bool:
    return name in _model_entrypoints


def create_model(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build model ``name`` with a ``num_classes``-way head.

    Our own registry is tried first; an unknown name is then looked up in torchvision
    (``torchvision.models.get_model(name, weights=None)``) and in timm when it is installed. A name
    ``hf:<local dir or config>`` is a Hugging Face ``transformers`` classifier (:mod:`lcv_vision.models.hf`;
    ``kwargs`` override its config).
    Keyword arguments whose value is ``None`` are dropped, so a CLI can default every
    option to ``None`` and the architecture's own defaults stay in effect.

    Example:
        >>> model = create_model("resnet18", num_classes=10)
    """
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if name.startswith("hf:"):
        return _from_transformers(name, num_classes, kwargs)
    if name in _model_entrypoints:
        return _model_entrypoints[name](num_classes=num_classes, **kwargs)
    model = _from_torchvision(name, num_classes, kwargs)
    if model is None:
        model = _from_timm(name, num_classes, kwargs)
    if model is None:
        close = difflib.get_close_matches(name, list_models(), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown model {name!r}: not in the vision registry, torchvision or timm.{hint} "
            f"Registered models: {', '.join(list_models())}"
        )
    return model


def _from_transformers(name: str, num_classes: int, kwargs: dict[str, Any]) -> nn.Module:
    try:
        import transformers  # noqa: F401  (only to say what is missing)
    except ImportError:
        raise ValueError(
            f"model {name!r} needs Hugging Face transformers: pip install 'lightning-compiled-vision[hf]'"
        ) from None
    from lcv_vision.models.hf import create_hf_model

    return create_hf_model(name, num_classes, **kwargs)


def _from_torchvision(name: str, num_classes: int, kwargs: dict[str, Any]) -> nn.Module | None:
    import torchvision

    if name.lower() not in torchvision.models.list_models():
        return None
    return torchvision.models.get_model(name.lower(), weights=None, num_classes=num_classes, **kwargs)


def _from_timm(name: str, num_classes: int, kwargs: dict[str, Any]) -> nn.Module | None:
    try:
        import timm
    except ImportError:
        return None
    if not timm.is_model(name):
        return None
    return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
