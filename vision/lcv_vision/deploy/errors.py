"""The errors of the deploy path: each one line a user can act on, printed by ``lcv`` without a traceback."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "DeployError",
    "ImageRejectedError",
    "IncompatiblePackageError",
    "MissingExtraError",
    "UnexportableModelError",
    "UnsupportedPrecisionError",
    "import_extra",
]


class DeployError(ValueError):
    """A deploy step cannot go on; the message says why in one line."""


class IncompatiblePackageError(DeployError):
    """A ``.pt2`` package was built for another torch or a CPU instruction set this machine lacks."""


class UnexportableModelError(DeployError):
    """``torch.export`` cannot capture the model; the message names the operation and the module."""


class UnsupportedPrecisionError(DeployError):
    """The precision asked for does not run fast (or at all) on this machine."""


class MissingExtraError(DeployError):
    """An optional dependency of one command is not installed."""


class ImageRejectedError(DeployError):
    """An image the classifier will not take; ``status`` is the HTTP status a server answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def import_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or :class:`MissingExtraError` naming the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"{purpose} needs {module.split('.')[0]!r}, which is not installed: "
            f"pip install 'lightning-compiled-vision[{extra}]'"
        ) from err
