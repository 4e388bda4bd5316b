"""The DataModules a recipe trains on: ``lcv_vision.data``'s three, plus a typed ``augment`` argument.

Why subclasses: ``lcv_vision.data`` DataModules take a ``Pipeline`` object, which a command line cannot
spell. These take an :class:`~lcv_vision.recipes.AugmentConfig` instead (``--data.augment.cutout 8``) and
build the pipeline from it with the DataModule's own mean/std/size/classes, and they hide the
arguments a recipe always fixes (output dtype float32, pipeline objects).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from typing_extensions import override

from lcv_vision.data.color import Normalize
from lcv_vision.data.datamodules import CIFAR10DataModule, DigitsDataModule, ImageFolderDataModule
from lcv_vision.data.datasets import OnCorrupt
from lcv_vision.data.geometry import CenterCrop, ResizeCenterCrop
from lcv_vision.data.loader import first_images
from lcv_vision.data.pipeline import Pipeline
from lcv_vision.recipes._pipeline import build_train_pipeline
from lcv_vision.recipes._recipe import AugmentConfig

__all__ = ["CIFAR10Data", "DigitsData", "ImageFolderData", "RecipeData", "DATAMODULES"]

# The mixin goes on `lcv_vision.data`'s DataModules; mypy checks it against their common base, so that its
# overrides and `super()` calls are checked.
if TYPE_CHECKING:
    from lcv_vision.data.datamodules import _DeviceDataModule as _DataModuleBase
else:
    _DataModuleBase = object


class RecipeData(_DataModuleBase):
    """Mixin: an ``augment`` config turned into the train pipeline, and access to raw training images."""

    augment: AugmentConfig | None
    image_size: int  # set by each DataModule
    num_classes: int

    @override
    def default_train_pipeline(self) -> Pipeline:
        if self.augment is None:
            return super().default_train_pipeline()
        return build_train_pipeline(
            self.augment,
            mean=self.mean,
            std=self.std,
            image_size=self.image_size,
            num_classes=self.num_classes,
            epoch=self._train_epoch,
            seed=self.seed,
        )

    def _train_epoch(self) -> int:
        loader = getattr(self, "_train_loader", None)
        return 0 if loader is None else int(loader.epoch)

    @override
    def predict_dataloader(self) -> Any:
        """Predictions run over the test split (no augmentation; batches still carry their labels)."""
        return self.test_dataloader()

    def sample_train_images(self, n: int) -> torch.Tensor:
        """``n`` training images drawn at random (seeded with ``seed``), normalised but not augmented.

        For data-dependent initialisation (airbench's whitening layer takes the first 5,000 images of
        CIFAR-10's shuffled order). A random draw, not the first ``n`` files: ImageFolder trees are sorted
        by class, so the first 5,000 CIFAR-10 JPEGs are all airplanes. It does not touch the train loader,
        so its position and its checkpointed state stay exact.
        """
        loader = self._loader("train", train=False)
        loader.shuffle = True  # epoch 0's seeded permutation
        images = first_images(loader, n)
        if images is None:
            raise ValueError("the training split is empty: no images to sample")
        return images


class DigitsData(RecipeData, DigitsDataModule):
    """:class:`lcv_vision.data.DigitsDataModule` (bundled sklearn digits, no download) with ``augment``."""

    def __init__(
        self,
        batch_size: int = 64,
        image_size: int = 32,
        augment: AugmentConfig | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, image_size=image_size, seed=seed, drop_last=drop_last)
        self.augment = augment
        self.save_hyperparameters()  # logged as data/* next to the module's hyperparameters


class CIFAR10Data(RecipeData, CIFAR10DataModule):
    """:class:`lcv_vision.data.CIFAR10DataModule` with ``augment``.

    Give ``root`` (torchvision's CIFAR-10 there; ``download=True`` fetches it) or ``zip_path`` (a zip or
    folder of JPEGs in ImageFolder layout with ``train/`` and ``test/``).
    """

    def __init__(
        self,
        root: str | None = None,
        zip_path: str | None = None,
        download: bool = False,
        batch_size: int = 512,
        augment: AugmentConfig | None = None,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 2,
        limit_per_class: int | None = None,
    ) -> None:
        super().__init__(
            root=root,
            zip_path=zip_path,
            download=download,
            batch_size=batch_size,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            limit_per_class=limit_per_class,
        )
        self.augment = augment
        self.save_hyperparameters()


class ImageFolderData(RecipeData, ImageFolderDataModule):
    """:class:`lcv_vision.data.ImageFolderDataModule` with ``augment`` and a separate evaluation size.

    ``storage="encoded"`` keeps the files encoded and decodes each batch (data sets too large to hold
    decoded, e.g. ImageNet); ``"uint8"`` decodes everything once into ``storage_size`` squares.

    ``eval_image_size`` (FixRes, Touvron et al. 2019): evaluate on a centre crop of this side taken from the
    stored squares (``storage_size``), e.g. train 176 / store 232 / evaluate 224 as in torchvision's
    ResNet-50 recipe. ``None`` keeps the base class's evaluation crop.
    """

    def __init__(
        self,
        root: str | None = None,
        image_size: int = 224,
        batch_size: int = 64,
        augment: AugmentConfig | None = None,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 2,
        storage_size: int | None = None,
        eval_image_size: int | None = None,
        on_corrupt: OnCorrupt = "raise",
        limit_per_class: int | None = None,
        val_split: float | str = "val",
        storage: Literal["uint8", "encoded"] = "uint8",
    ) -> None:
        if root is None:
            raise ValueError(
                "ImageFolderData: give root='<dir or .zip>' with train/<class>/* and val/<class>/*"
            )
        super().__init__(
            root=root,
            image_size=image_size,
            batch_size=batch_size,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            storage_size=storage_size,
            on_corrupt=on_corrupt,
            limit_per_class=limit_per_class,
            val_split=val_split,
            storage=storage,
        )
        if (
            eval_image_size is not None
            and storage == "uint8"
            and not 0 < eval_image_size <= self.storage_size
        ):
            raise ValueError(
                f"ImageFolderData: eval_image_size={eval_image_size} must be in [1, "
                f"storage_size={self.storage_size}]"
            )
        self.augment = augment
        self.eval_image_size = eval_image_size
        self.save_hyperparameters()

    @override
    def default_eval_pipeline(self) -> Pipeline:
        if self.eval_image_size is None:
            return super().default_eval_pipeline()
        if self.storage == "encoded":  # files of any size: shorter side to storage_size, centre crop
            first: Any = ResizeCenterCrop(self.eval_image_size, max(self.storage_size, self.eval_image_size))
        else:
            first = CenterCrop(self.eval_image_size)
        return Pipeline([first, Normalize(self.mean, self.std)], dtype=self.dtype)


#: recipe ``dataset`` -> DataModule class.
DATAMODULES: dict[str, type[RecipeData]] = {
    "digits": DigitsData,
    "cifar10": CIFAR10Data,
    "imagefolder": ImageFolderData,
}
