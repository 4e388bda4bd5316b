"""Fast batched data augmentation and loading: uint8 storage, per-sample random params on whole batches."""

from typing import TYPE_CHECKING, Any

from lcv_vision.data.color import ColorJitter, Normalize, ToGray
from lcv_vision.data.datasets import (
    CorruptImageError,
    DatasetError,
    DatasetNotFoundError,
    EncodedImages,
    ImageSet,
    list_image_folder,
    load_cifar10,
    load_digits_images,
    load_image_folder,
)
from lcv_vision.data.erasing import CoarseDropout, Erasing
from lcv_vision.data.geometry import (
    AlternatingFlipCrop,
    CenterCrop,
    HorizontalFlip,
    Pad,
    PadIfNeeded,
    RandomCrop,
    RandomResizedCrop,
    RandomTranslate,
    Resize,
    ResizeCenterCrop,
    VerticalFlip,
)
from lcv_vision.data.loader import DeviceLoader
from lcv_vision.data.mixing import MixupCutmix
from lcv_vision.data.ops import BatchOp, Params, RaggedBatch
from lcv_vision.data.pipeline import Pipeline
from lcv_vision.data.trivial_augment import TrivialAugmentWide

if TYPE_CHECKING:  # imported on first use (below): they import Lightning, the rest of this package does not
    from lcv_vision.data.albumentations_bridge import from_albumentations
    from lcv_vision.data.datamodules import CIFAR10DataModule, DigitsDataModule, ImageFolderDataModule

#: Names imported on first use: the DataModules import Lightning (~5 s in a fresh process, most of it the
#: torchmetrics its version check imports), albumentations' bridge imports albumentations and cv2.
_LAZY = {
    "CIFAR10DataModule": "lcv_vision.data.datamodules",
    "DigitsDataModule": "lcv_vision.data.datamodules",
    "ImageFolderDataModule": "lcv_vision.data.datamodules",
    "from_albumentations": "lcv_vision.data.albumentations_bridge",
}

__all__ = [
    "AlternatingFlipCrop",
    "BatchOp",
    "CIFAR10DataModule",
    "CenterCrop",
    "CoarseDropout",
    "ColorJitter",
    "CorruptImageError",
    "DatasetError",
    "DatasetNotFoundError",
    "DeviceLoader",
    "DigitsDataModule",
    "EncodedImages",
    "Erasing",
    "HorizontalFlip",
    "ImageFolderDataModule",
    "ImageSet",
    "MixupCutmix",
    "Normalize",
    "Pad",
    "PadIfNeeded",
    "Params",
    "Pipeline",
    "RaggedBatch",
    "RandomCrop",
    "RandomResizedCrop",
    "RandomTranslate",
    "Resize",
    "ResizeCenterCrop",
    "ToGray",
    "TrivialAugmentWide",
    "VerticalFlip",
    "from_albumentations",
    "list_image_folder",
    "load_cifar10",
    "load_digits_images",
    "load_image_folder",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))  # the names imported on first use too (tab completion)
