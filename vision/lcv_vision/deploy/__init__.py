"""From an ``lcv fit`` checkpoint to a served model: export, quantize, load, classify, serve.

Importing this package needs torch and PIL only; ``torchao`` (int8), ``onnx``/``onnxruntime`` (``--format
onnx``) and ``litserve`` (``lcv serve``) are imported where they are used, and a missing one is one line
naming the extra to install.
"""

from lcv_vision.deploy.errors import (
    DeployError,
    ImageRejectedError,
    IncompatiblePackageError,
    MissingExtraError,
    UnexportableModelError,
    UnsupportedPrecisionError,
)
from lcv_vision.deploy.package import DeployedModel, PackageInfo, load_package

__all__ = [
    "DeployError",
    "DeployedModel",
    "ImageRejectedError",
    "IncompatiblePackageError",
    "MissingExtraError",
    "PackageInfo",
    "UnexportableModelError",
    "UnsupportedPrecisionError",
    "load_package",
]
