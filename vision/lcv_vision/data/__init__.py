"""Fast batched data augmentation and loading: uint8 storage, per-sample random params on whole batches."""

from typing import Any

from lcv_vision.data.color import ColorJitter, Normalize, ToGray
from lcv_vision.data.datamodules import CIFAR10DataModule, DigitsDataModule, ImageFolderDataModule
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
    # albumentations (and cv2) are imported only when the bridge is used.
    if name == "from_albumentations":
        from lcv_vision.data.albumentations_bridge import from_albumentations

        return from_albumentations
    raise AttributeError(name)
