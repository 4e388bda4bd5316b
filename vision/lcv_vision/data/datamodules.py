"""LightningDataModules on top of :class:`~lcv_vision.data.loader.DeviceLoader`.

Batches arrive in ``training_step`` already augmented, normalized, in the requested dtype, channels_last and
on ``trainer.strategy.root_device`` (Lightning's own transfer is then a no-op).  Under DDP every rank gets a
disjoint shard (``trainer.global_rank`` of ``trainer.world_size``).  The train loader's state (seed, epoch,
position) goes into checkpoints, so ``Trainer.fit(ckpt_path=...)`` resumes mid-epoch with the same batches.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lcv_vision.data.color import IMAGENET_MEAN, IMAGENET_STD, Normalize
from lcv_vision.data.datasets import (
    DatasetError,
    DatasetNotFoundError,
    EncodedImages,
    ImageSet,
    OnCorrupt,
    list_classes,
    list_image_folder,
    load_cifar10,
    load_digits_images,
    load_image_folder,
    stratified_split,
)
from lcv_vision.data.geometry import (
    CenterCrop,
    HorizontalFlip,
    RandomCrop,
    RandomResizedCrop,
    RandomTranslate,
    Resize,
    ResizeCenterCrop,
)
from lcv_vision.data.loader import DeviceLoader, Uneven, num_batches
from lcv_vision.data.pipeline import Pipeline

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class _DeviceDataModule(pl.LightningDataModule):
    """Shared plumbing: split storage, loaders on the strategy's device, DDP sharding, loader state."""

    num_classes: int
    image_size: int
    in_channels: int = 3
    on_corrupt: OnCorrupt = "raise"  # files decoded per batch (ImageFolder storage="encoded")
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str]

    def __init__(
        self,
        batch_size: int,
        train_pipeline: Pipeline | None,
        eval_pipeline: Pipeline | None,
        seed: int,
        drop_last: bool,
        num_workers: int,
        dtype: torch.dtype,
        uneven: Uneven = "exact",
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.num_workers = num_workers  # threads used to decode image files
        self.dtype = dtype
        self.uneven = uneven
        self._train_pipeline = train_pipeline
        self._eval_pipeline = eval_pipeline
        self._splits: Mapping[str, ImageSet | EncodedImages] = {}
        self._train_loader: DeviceLoader | None = None
        self._pending_state: dict[str, Any] | None = None

    # subclasses -------------------------------------------------------------------------------------
    def _build(self) -> Mapping[str, ImageSet | EncodedImages]:
        raise NotImplementedError

    def default_train_pipeline(self) -> Pipeline:
        raise NotImplementedError

    def default_eval_pipeline(self) -> Pipeline:
        return Pipeline([Normalize(self.mean, self.std)], dtype=self.dtype)

    @property
    def train_pipeline(self) -> Pipeline:
        return self._train_pipeline if self._train_pipeline is not None else self.default_train_pipeline()

    @property
    def eval_pipeline(self) -> Pipeline:
        return self._eval_pipeline if self._eval_pipeline is not None else self.default_eval_pipeline()

    # Lightning hooks --------------------------------------------------------------------------------
    @override
    def setup(self, stage: str | None = None) -> None:
        if not self._splits:
            self._splits = self._build()
            for name, split in self._splits.items():
                if len(split) == 0:
                    raise ValueError(f"{type(self).__name__}: the {name} split is empty")

    def num_train_batches(self) -> int:
        """Training batches per epoch and rank (builds the data set if needed; creates no loader)."""
        self.setup()
        _, _, world = self._placement()
        return num_batches(len(self._splits["train"]), self.batch_size, world, self.uneven, self.drop_last)

    def _placement(self) -> tuple[torch.device, int, int]:
        trainer = self.trainer
        if trainer is None:
            return torch.device("cpu"), 0, 1
        return trainer.strategy.root_device, trainer.global_rank, trainer.world_size

    def _loader(self, split: str, train: bool) -> DeviceLoader:
        self.setup()
        if split not in self._splits:
            raise ValueError(f"{type(self).__name__} has no {split!r} split (has {sorted(self._splits)})")
        data = self._splits[split]
        device, rank, world = self._placement()
        images = data if isinstance(data, EncodedImages) else data.images
        loader = DeviceLoader(
            images,
            data.targets,
            self.batch_size,
            self.train_pipeline if train else self.eval_pipeline,
            shuffle=train,
            drop_last=self.drop_last if train else False,
            seed=self.seed,
            device=device,
            rank=rank,
            world_size=world,
            uneven=self.uneven,
            decode_threads=max(1, self.num_workers),
            on_corrupt=self.on_corrupt,
        )
        # only drop_last can empty a loader: a run that would train on nothing. (Not len(loader): a state
        # loaded after a first len() may not lengthen the epoch, see DeviceLoader.load_state_dict.)
        if num_batches(len(data), self.batch_size, world, self.uneven, loader.drop_last) == 0:
            per_rank = f" per rank ({world} ranks)" if world > 1 else ""
            raise DatasetError(
                f"the {split} split has {len(data)} images{per_rank}, fewer than "
                f"batch_size={self.batch_size} with drop_last=True: not one batch to train on. Lower "
                f"batch_size to at most {len(data) // world} (lcv: --data.batch_size) or keep the last "
                "partial batch (lcv: --data.drop_last false)"
            )
        return loader

    @override
    def train_dataloader(self) -> DeviceLoader:
        loader = self._loader("train", train=True)
        if self._pending_state is not None:
            loader.load_state_dict(self._pending_state)
            self._pending_state = None
        self._train_loader = loader
        return loader

    @override
    def val_dataloader(self) -> DeviceLoader:
        return self._loader("val", train=False)

    @override
    def test_dataloader(self) -> DeviceLoader:
        return self._loader("test", train=False)

    @override
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # already on the device; skip Lightning's recursive move

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._train_loader is None:
            return {}
        return {"train_loader": self._train_loader.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        if state is None:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._pending_state = dict(state)


class DigitsDataModule(_DeviceDataModule):
    """scikit-learn's bundled digits (1797 real 8x8 images) upscaled to ``image_size``, 3 channels, uint8.

    Deterministic stratified split with ``seed``: 70% train / 10% val / 20% test.  No download needed: the
    embedded default data set.  Default augmentation: a random translate of ``image_size // 16`` pixels.
    """

    mean = (0.5,) * 3
    std = (0.5,) * 3

    def __init__(
        self,
        batch_size: int = 64,
        image_size: int = 32,
        train_pipeline: Pipeline | None = None,
        eval_pipeline: Pipeline | None = None,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__(batch_size, train_pipeline, eval_pipeline, seed, drop_last, num_workers, dtype)
        self.image_size = image_size
        self.num_classes = 10
        self.class_names = [str(i) for i in range(10)]

    def _build(self) -> dict[str, ImageSet]:
        full = load_digits_images(self.image_size)
        parts = stratified_split(full.targets, (0.7, 0.1, 0.2), self.seed)
        return {
            name: ImageSet(full.images[idx], full.targets[idx], full.class_names)
            for name, idx in zip(("train", "val", "test"), parts)
        }

    def default_train_pipeline(self) -> Pipeline:
        shift = max(1, self.image_size // 16)
        return Pipeline([RandomTranslate(shift), Normalize(self.mean, self.std)], dtype=self.dtype)


class CIFAR10DataModule(_DeviceDataModule):
    """CIFAR-10 from torchvision (``root``, ``download=True`` to fetch) or from a zip/folder of JPEGs in
    ImageFolder layout (``zip_path``, with ``train/`` and ``test/``).  The test split doubles as ``val``.

    Default train augmentation: reflect-pad 4 + random 32 crop + horizontal flip + normalize.
    """

    mean = CIFAR10_MEAN
    std = CIFAR10_STD

    def __init__(
        self,
        root: str | None = None,
        zip_path: str | None = None,
        download: bool = False,
        batch_size: int = 512,
        train_pipeline: Pipeline | None = None,
        eval_pipeline: Pipeline | None = None,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 2,
        dtype: torch.dtype = torch.float32,
        limit_per_class: int | None = None,
    ):
        super().__init__(batch_size, train_pipeline, eval_pipeline, seed, drop_last, num_workers, dtype)
        if root is None and zip_path is None:
            raise ValueError(
                "CIFAR10DataModule: give root='<dir>' (with download=True to fetch CIFAR-10 there) "
                "or zip_path='<cifar10-jpeg.zip>'"
            )
        self.root, self.zip_path, self.download = root, zip_path, download
        self.limit_per_class = limit_per_class
        self.image_size = 32
        self.num_classes = 10
        self.class_names = [
            "airplane",
            "automobile",
            "bird",
            "cat",
            "deer",
            "dog",
            "frog",
            "horse",
            "ship",
            "truck",
        ]

    @override
    def prepare_data(self) -> None:
        if self.zip_path is None and self.download:
            import torchvision

            for train in (True, False):
                torchvision.datasets.CIFAR10(self.root, train=train, download=True)

    def _build(self) -> dict[str, ImageSet]:
        if self.zip_path is not None:
            train = load_image_folder(
                self.zip_path, "train", None, "raise", self.limit_per_class, self.num_workers
            )
            test = load_image_folder(
                self.zip_path, "test", None, "raise", self.limit_per_class, self.num_workers
            )
        else:
            train = load_cifar10(self.root, True, self.download)
            test = load_cifar10(self.root, False, self.download)
        self.class_names = train.class_names
        return {"train": train, "val": test, "test": test}

    def default_train_pipeline(self) -> Pipeline:
        return Pipeline(
            [
                RandomCrop(32, padding=4, padding_mode="reflect"),
                HorizontalFlip(),
                Normalize(self.mean, self.std),
            ],
            dtype=self.dtype,
        )


class ImageFolderDataModule(_DeviceDataModule):
    """Any ImageFolder tree ``<root>/train/<class>/*`` and ``<root>/val/<class>/*`` (JPEG/PNG, any sizes;
    ``root`` may be a ``.zip``).

    ``storage="uint8"`` (default) decodes the images once and stores them as uint8 squares of
    ``storage_size`` (default ``image_size * 8 / 7``, i.e. 256 for 224).  ``storage="encoded"`` keeps the
    files encoded and decodes every batch (in ``num_workers`` threads, or with nvJPEG on CUDA): for data
    sets too large to hold decoded.

    Default train: random resized crop to ``image_size`` + flip + normalize; eval: shorter side to
    ``storage_size`` + centre crop ``image_size`` + normalize.  ``on_corrupt="skip"`` skips undecodable
    files and warns naming them; ``"raise"`` fails naming the file.

    ``val_split``: the folder next to ``train/`` that holds the validation images (default ``"val"``), or a
    fraction in (0, 1): that share of every class of ``train/`` is held out (seeded with ``seed``) when the
    data set has no validation folder.  The test split is the validation split.  Every class folder of
    ``train/`` must hold images (a class never seen cannot be learnt); an empty one in the validation folder
    is a warning.
    """

    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def __init__(
        self,
        root: str,
        image_size: int = 224,
        batch_size: int = 64,
        train_pipeline: Pipeline | None = None,
        eval_pipeline: Pipeline | None = None,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 2,
        dtype: torch.dtype = torch.float32,
        storage_size: int | None = None,
        on_corrupt: OnCorrupt = "raise",
        limit_per_class: int | None = None,
        val_split: float | str = "val",
        storage: Literal["uint8", "encoded"] = "uint8",
    ):
        super().__init__(batch_size, train_pipeline, eval_pipeline, seed, drop_last, num_workers, dtype)
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        if storage not in ("uint8", "encoded"):
            raise ValueError(f"storage must be 'uint8' or 'encoded', got {storage!r}")
        self.storage = storage
        self.root = root
        self.image_size = image_size
        self.storage_size = storage_size if storage_size is not None else int(round(image_size * 8 / 7))
        self.on_corrupt: OnCorrupt = on_corrupt
        self.limit_per_class = limit_per_class
        self.val_split = val_split
        self.class_names = list_classes(root, "train")  # known before setup (models need num_classes)
        self.val_fraction = _val_fraction(root, val_split)
        if self.val_fraction is None:
            list_classes(
                root, str(val_split)
            )  # a missing validation folder fails now, not after decoding train
        self.num_classes = len(self.class_names)
        self.skipped = 0

    def _load(self, split: str, require_every_class: bool) -> ImageSet | EncodedImages:
        start = time.perf_counter()
        if self.storage == "encoded":
            data: ImageSet | EncodedImages = list_image_folder(
                self.root, split, self.limit_per_class, require_every_class
            )
            rank_zero_info(
                f"{split}: {len(data):,} image files in {len(data.class_names)} classes (decoded per batch)"
            )
            return data
        data = load_image_folder(
            self.root,
            split,
            self.storage_size,
            self.on_corrupt,
            self.limit_per_class,
            self.num_workers,
            require_every_class,
        )
        skipped = f", {data.skipped} skipped" if data.skipped else ""
        rank_zero_info(
            f"{split}: {len(data):,} images in {len(data.class_names)} classes decoded to "
            f"{self.storage_size}x{self.storage_size} in {time.perf_counter() - start:.1f} s{skipped}"
        )
        return data

    def _build(self) -> Mapping[str, ImageSet | EncodedImages]:
        train = self._load("train", require_every_class=True)
        self.skipped = getattr(train, "skipped", 0)
        if self.val_fraction is not None:
            kept, held_out = stratified_split(
                train.targets, (1 - self.val_fraction, self.val_fraction), self.seed
            )
            if held_out.numel() == 0:
                raise DatasetError(
                    f"val_split={self.val_split} of {len(train)} training images holds out none: raise the "
                    "fraction or add a val/ folder"
                )
            val = train.select(held_out)
            train = train.select(kept)
            rank_zero_info(
                f"val: {len(val):,} images held out of train/ ({self.val_fraction:.0%} of every class, "
                f"seed {self.seed}); train keeps {len(train):,}"
            )
        else:
            val = self._load(str(self.val_split), require_every_class=False)
            self.skipped += getattr(val, "skipped", 0)
            if val.class_names != train.class_names:
                only_train = sorted(set(train.class_names) - set(val.class_names))
                only_val = sorted(set(val.class_names) - set(train.class_names))
                raise DatasetError(
                    f"the class folders of {self.root!r} differ between train/ and {self.val_split}/: only "
                    f"in train: {only_train}, only in {self.val_split}: {only_val}; both need the same class "
                    "folders"
                )
        self.class_names, self.num_classes = train.class_names, len(train.class_names)
        return {"train": train, "val": val, "test": val}

    def default_train_pipeline(self) -> Pipeline:
        return Pipeline(
            [RandomResizedCrop(self.image_size), HorizontalFlip(), Normalize(self.mean, self.std)],
            dtype=self.dtype,
        )

    def default_eval_pipeline(self) -> Pipeline:
        if self.storage == "encoded":  # images of any size: resize the shorter side, then crop the centre
            resize = max(self.storage_size, self.image_size)
            return Pipeline(
                [ResizeCenterCrop(self.image_size, resize), Normalize(self.mean, self.std)], dtype=self.dtype
            )
        crop = int(round(self.storage_size * 0.875)) if self.storage_size else self.image_size
        ops: list = [CenterCrop(min(crop, self.storage_size))]
        if ops[0].size != (self.image_size, self.image_size):
            ops.append(Resize(self.image_size))
        return Pipeline([*ops, Normalize(self.mean, self.std)], dtype=self.dtype)


def _val_fraction(root: str, val_split: float | str) -> float | None:
    """``val_split`` as a fraction of train, or ``None`` when it names a validation folder."""
    if isinstance(val_split, str):
        folder = val_split
        try:
            val_split = float(folder)
        except ValueError:
            if root.lower().endswith(".zip") or os.path.isdir(os.path.join(root, folder)):
                return None
            raise DatasetNotFoundError(
                f"no {folder!r} folder in {root!r} (expected {root}/{folder}/<class>/<image>): add "
                "one, or hold out a share of train/ with val_split=0.2 (lcv: --data.val_split 0.2)"
            ) from None
    if isinstance(val_split, bool) or not 0.0 < float(val_split) < 1.0:
        raise ValueError(f"val_split must be a folder name or a fraction in (0, 1), got {val_split!r}")
    return float(val_split)
