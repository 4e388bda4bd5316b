"""Build uint8 ``(N, C, H, W)`` image tensors + int64 labels from the data sets we support.

- :func:`load_digits_images`: scikit-learn's bundled ``load_digits`` (1797 real 8x8 digits), no download.
- :func:`load_cifar10`: torchvision's CIFAR-10 (downloads when asked).
- :func:`load_image_folder`: an ImageFolder tree ``<root>/<split>/<class>/**/<file>`` of JPEG/PNG/GIF/WebP
  files, or the same layout inside a ``.zip`` (read member by member, never extracted).

Images are decoded once, in a thread pool, straight into one preallocated tensor, with a progress bar when
that takes more than a few seconds. Problems with the user's files raise :class:`DatasetError` subclasses that
name the files; what is left out (corrupt files with ``on_corrupt="skip"``, image types torchvision cannot
decode, empty class folders) is named in a warning.
Images of different sizes are stored at one ``storage_size`` (shorter side resized, centre square crop),
like FFCV's fixed-resolution storage; random resized crops then run on that copy.

For data sets too large to hold decoded, :func:`list_image_folder` returns :class:`EncodedImages` (the
files, not decoded), which the loader decodes one batch at a time.
"""

from __future__ import annotations

import os
import threading
import warnings
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # for the annotation; decode_jpeg_batch imports it when called
    from lcv_vision.data.ops import RaggedBatch

OnCorrupt = Literal["raise", "skip"]


class DatasetError(ValueError):
    """Something wrong with the user's images or folders (not with the code): ``lcv`` reports it in one
    line."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """A folder, split, zip or class the options point to is not there."""


class CorruptImageError(DatasetError, RuntimeError):
    """An image file could not be read or decoded."""


@dataclass
class ImageSet:
    """uint8 images ``(N, C, H, W)``, int64 targets ``(N,)``, the class names and the files left out."""

    images: Tensor
    targets: Tensor
    class_names: list[str]
    skipped_files: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def skipped(self) -> int:
        """How many corrupt or unreadable files were left out (``on_corrupt="skip"``)."""
        return len(self.skipped_files)

    def select(self, indices: Tensor) -> ImageSet:
        """The samples at ``indices`` (e.g. one part of a split)."""
        return ImageSet(self.images[indices], self.targets[indices], self.class_names, self.skipped_files)


def load_digits_images(image_size: int = 32) -> ImageSet:
    """scikit-learn digits (values 0..16 on 8x8) -> uint8 0..255, bilinear upscaled, 3 channels."""
    from sklearn.datasets import load_digits

    if image_size < 8:
        raise ValueError(f"load_digits_images: image_size must be >= 8, got {image_size}")
    digits = load_digits()
    x = torch.from_numpy(digits.images).float().unsqueeze(1) * (255.0 / 16.0)
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = x.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    targets = torch.from_numpy(digits.target).long()
    return ImageSet(x, targets, [str(i) for i in range(10)])


def load_cifar10(root: str | None, train: bool, download: bool = False) -> ImageSet:
    """torchvision CIFAR-10 as uint8 NCHW (channels_last memory, no copy of the HWC array)."""
    import torchvision

    if root is None:
        raise ValueError(
            "CIFAR-10: no root given; pass root='<dir>' (and download=True to fetch it) or zip_path="
        )
    try:
        ds = torchvision.datasets.CIFAR10(root, train=train, download=download)
    except RuntimeError as err:
        raise FileNotFoundError(
            f"CIFAR-10 not found under {root!r} ({err}); pass download=True to download it there, "
            "or zip_path= for a zip of JPEGs in ImageFolder layout"
        ) from err
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2)
    return ImageSet(images, torch.tensor(ds.targets, dtype=torch.int64), list(ds.classes))


# --------------------------------------------------------------------------------------------- folders
#: File types read as images (what ``torchvision.io.decode_image`` decodes).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".webp")
#: Image types torchvision cannot decode: listed in a warning instead of being dropped silently.
UNDECODABLE_EXTENSIONS = (".bmp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".heic", ".heif", ".avif", ".jxl")
#: How many file names a warning or an error lists.
NAMES_SHOWN = 5


@dataclass
class FolderListing:
    """The image files of one split: ``(path, class index)`` items, the class names, and what was left out."""

    items: list[tuple[str, int]]
    classes: list[str]
    undecodable: list[str]  # image files of a type torchvision cannot decode
    where: str  # the split's folder (or ``zip:split``) for messages

    def empty_classes(self) -> list[str]:
        present = {c for _, c in self.items}
        return [name for i, name in enumerate(self.classes) if i not in present]


def _named(names: Sequence[str]) -> str:
    """The first :data:`NAMES_SHOWN` names, and how many more."""
    shown = ", ".join(repr(n) for n in names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def _hidden(name: str) -> bool:
    """Hidden files and folders (``.DS_Store``, ``.ipynb_checkpoints``, macOS AppleDouble ``._x.jpg``) and
    the ``__MACOSX`` folder of zips made on a Mac: never images, never classes."""
    return name.startswith(".") or name == "__MACOSX"


def _classify(path: str, items: list[tuple[str, int]], undecodable: list[str], label: int) -> None:
    ext = os.path.splitext(path)[1].lower()
    if ext in IMAGE_EXTENSIONS:
        items.append((path, label))
    elif ext in UNDECODABLE_EXTENSIONS:
        undecodable.append(path)


def _list_folder(root: str, split: str) -> FolderListing:
    """Every image under ``<root>/<split>/<class>/``, sub-folders included (as torchvision's ``ImageFolder``,
    following links), sorted by path."""
    base = os.path.join(root, split)
    if not os.path.isdir(base):
        raise DatasetNotFoundError(
            f"image folder split not found: {base!r} (expected {root}/{split}/<class>/<image>)"
        )
    classes = sorted(d for d in os.listdir(base) if not _hidden(d) and os.path.isdir(os.path.join(base, d)))
    items: list[tuple[str, int]] = []
    undecodable: list[str] = []
    for label, name in enumerate(classes):
        for folder, subfolders, files in sorted(os.walk(os.path.join(base, name), followlinks=True)):
            subfolders[:] = sorted(d for d in subfolders if not _hidden(d))
            for f in sorted(files):
                if not _hidden(f):
                    _classify(os.path.join(folder, f), items, undecodable, label)
    items.sort(key=lambda item: (item[1], item[0]))
    return FolderListing(items, classes, undecodable, base)


def _list_zip(zf: zipfile.ZipFile, split: str) -> FolderListing:
    prefix = split.strip("/") + "/"
    entries = []
    for name in zf.namelist():
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("/")
        if len(parts) >= 2 and parts[0] and not any(_hidden(p) for p in parts if p):
            entries.append((parts[0], name, bool(parts[-1])))  # (class, member, is a file)
    classes = sorted({c for c, _, _ in entries})
    index = {c: i for i, c in enumerate(classes)}
    items: list[tuple[str, int]] = []
    undecodable: list[str] = []
    for c, name, is_file in sorted(entries, key=lambda e: (e[0], e[1])):
        if is_file:
            _classify(name, items, undecodable, index[c])
    return FolderListing(items, classes, undecodable, f"{zf.filename}:{prefix}")


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise DatasetError(
            f"{path!r} is not a zip file ({err}); pass a folder or a zip of <split>/<class>/<image>"
        ) from err


def _listing(root: str, split: str, require_every_class: bool) -> FolderListing:
    """List a split of a folder or zip; warn about what is left out; fail when nothing (or, with
    ``require_every_class``, some class) has images."""
    if not os.path.exists(root):
        raise DatasetNotFoundError(f"image folder or zip not found: {root!r}")
    if root.lower().endswith(".zip"):
        with _open_zip(root) as zf:
            listing = _list_zip(zf, split)
        if not listing.items:
            raise DatasetNotFoundError(f"no images under '{split}/<class>/' in zip {root!r}")
    else:
        listing = _list_folder(root, split)
        if not listing.items:
            raise DatasetNotFoundError(
                f"no {'/'.join(IMAGE_EXTENSIONS)} images under {listing.where!r} (expected <class>/<image>)"
            )
    if listing.undecodable:
        warnings.warn(
            f"ignored {len(listing.undecodable)} image file(s) under {listing.where!r} of a type torchvision "
            f"cannot decode (convert them to JPEG/PNG): {_named(listing.undecodable)}",
            stacklevel=3,
        )
    empty = listing.empty_classes()
    if empty and require_every_class:
        raise DatasetError(
            f"class folder(s) {_named(empty)} under {listing.where!r} hold no images: a class the model "
            "never sees cannot be learnt; add images or remove the folder(s)"
        )
    if empty:
        warnings.warn(
            f"class folder(s) {_named(empty)} under {listing.where!r} hold no images (kept as classes, so "
            "the class indices match the other splits)",
            stacklevel=3,
        )
    return listing


def list_classes(root: str, split: str) -> list[str]:
    """Sorted class names of ``<root>/<split>/<class>/`` (``root`` a folder or a ``.zip``), cheaply."""
    if not os.path.exists(root):
        raise DatasetNotFoundError(f"image folder or zip not found: {root!r}")
    if root.lower().endswith(".zip"):
        with _open_zip(root) as zf:
            prefix = split.strip("/") + "/"
            names = {
                n[len(prefix) :].split("/")[0]
                for n in zf.namelist()
                if n.startswith(prefix) and n.count("/") >= 2
            }
            classes = sorted(c for c in names if c and not _hidden(c))
    else:
        base = os.path.join(root, split)
        if not os.path.isdir(base):
            raise DatasetNotFoundError(
                f"image folder split not found: {base!r} (expected {root}/{split}/<class>/<image>)"
            )
        classes = sorted(
            d for d in os.listdir(base) if not _hidden(d) and os.path.isdir(os.path.join(base, d))
        )
    if not classes:
        raise DatasetNotFoundError(f"no class folders under {split!r} in {root!r}")
    return classes


def _take_per_class(items: list[tuple[str, int]], limit: int | None) -> list[tuple[str, int]]:
    if limit is None:
        return items
    counts: dict[int, int] = {}
    out = []
    for path, c in items:
        if counts.get(c, 0) < limit:
            counts[c] = counts.get(c, 0) + 1
            out.append((path, c))
    return out


def decode_image_bytes(data: bytes, name: str) -> Tensor:
    """Bytes of an image file -> uint8 (3, H, W) RGB; :class:`CorruptImageError` naming the file otherwise.

    Grayscale, palette and RGBA images become RGB (alpha dropped), CMYK JPEGs are converted; 16-bit PNGs keep
    their high byte (``v >> 8``, as PIL reads 16-bit RGB), so every file gives the same 0..255 scale."""
    import torchvision.io as tio
    import torchvision.transforms.v2.functional as TF

    try:
        img = tio.decode_image(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tio.ImageReadMode.RGB
        )
    except Exception as err:  # torchvision raises RuntimeError with libjpeg/libpng messages
        raise CorruptImageError(f"cannot decode image {name!r}: {err}") from err
    if img.dtype != torch.uint8:
        img = TF.to_dtype(img, torch.uint8, scale=True)
    return img


def fit_to_square(img: Tensor, size: int) -> Tensor:
    """Shorter side -> ``size`` (antialiased bilinear), then the centre ``size`` x ``size`` crop."""
    import torchvision.transforms.v2.functional as TF

    _, h, w = img.shape
    if (h, w) != (size, size):
        img = TF.resize(img, size, antialias=True)
        img = TF.center_crop(img, [size, size])
    return img


#: Seconds of decoding after which a progress bar appears (quick builds stay silent).
PROGRESS_DELAY_S = 3.0


def _progress(total: int, desc: str) -> Any:  # a tqdm bar (untyped), or None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc=desc, unit="img", delay=PROGRESS_DELAY_S, leave=False)


def _decode_all(
    items: Sequence[tuple[str, int]],
    read: Callable[[str], bytes],
    storage_size: int | None,
    on_corrupt: OnCorrupt,
    num_threads: int,
    desc: str,
) -> tuple[Tensor, Tensor, list[str]]:
    """Decode ``items`` in threads straight into one preallocated uint8 tensor (no stacking pass afterwards,
    no second copy in memory): ``(images, labels, skipped files)``."""
    if on_corrupt not in ("raise", "skip"):
        raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")

    def work(item: tuple[str, int]) -> Tensor | None:
        path, _ = item
        try:
            try:
                data = read(path)
            except OSError as err:  # unreadable (permissions, dangling link, I/O error): as a corrupt file
                raise CorruptImageError(f"cannot read image file {path!r}: {err}") from err
            img = decode_image_bytes(data, path)
        except CorruptImageError:
            if on_corrupt == "raise":
                raise
            return None
        return fit_to_square(img, storage_size) if storage_size is not None else img

    bar = _progress(len(items), desc)
    out: Tensor | None = None
    labels: list[int] = []
    skipped: list[str] = []
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        for (path, label), img in zip(items, pool.map(work, items)):
            if bar is not None:
                bar.update(1)
            if img is None:
                skipped.append(path)
                continue
            if out is None:
                out = torch.empty((len(items), *img.shape), dtype=torch.uint8)
            elif img.shape != out.shape[1:]:
                raise DatasetError(
                    f"{path!r} is {img.shape[2]}x{img.shape[1]} but the first image is {out.shape[3]}x"
                    f"{out.shape[2]}: images of different sizes need storage_size=<int> to store them at one "
                    "size"
                )
            out[len(labels)] = img
            labels.append(label)
    if bar is not None:
        bar.close()
    images = torch.empty((0, 3, 0, 0), dtype=torch.uint8) if out is None else out[: len(labels)]
    if skipped and out is not None:
        images = images.clone()  # release the rows reserved for the skipped files
    return images, torch.tensor(labels, dtype=torch.int64), skipped


def load_image_folder(
    root: str,
    split: str,
    storage_size: int | None = None,
    on_corrupt: OnCorrupt = "raise",
    limit_per_class: int | None = None,
    num_threads: int = 2,
    require_every_class: bool = False,
) -> ImageSet:
    """Decode ``<root>/<split>/<class>/**/*.{jpg,jpeg,png,gif,webp}`` (``root`` may be a ``.zip``) into an
    :class:`ImageSet`.

    Images in sub-folders of a class folder belong to that class (as in torchvision's ``ImageFolder``); hidden
    files (macOS ``._*``, ``.DS_Store``) are not images. ``storage_size`` resizes every image to a square of
    that side (needed when sizes differ). ``on_corrupt="skip"`` drops undecodable files and warns naming them;
    ``"raise"`` names the first one. A class folder without images is a warning, or an error with
    ``require_every_class``.
    """
    listing = _listing(root, split, require_every_class)
    items = _take_per_class(listing.items, limit_per_class)
    if root.lower().endswith(".zip"):
        with _open_zip(root) as zf:
            # ZipFile is not thread-safe for concurrent reads: read bytes serially, decode in threads.
            blobs = {name: zf.read(name) for name, _ in items}
        read: Callable[[str], bytes] = blobs.__getitem__
    else:

        def read(path: str) -> bytes:
            with open(path, "rb") as fh:
                return fh.read()

    images, labels, skipped = _decode_all(
        items, read, storage_size, on_corrupt, num_threads, f"decoding {os.path.basename(root)}/{split}"
    )
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} corrupt or unreadable image(s) in {root!r} ({split}): {_named(skipped)}",
            stacklevel=2,
        )
    if not len(labels):
        raise DatasetError(f"no decodable images in {root!r} ({split}); {len(skipped)} file(s) were corrupt")
    return ImageSet(images, labels, listing.classes, skipped)


def is_jpeg(data: bytes) -> bool:
    """JPEG files start with the SOI marker FF D8 FF (what nvJPEG can decode)."""
    return data[:3] == b"\xff\xd8\xff"


def decode_jpeg_batch(data: Sequence[bytes], device: torch.device | str = "cuda") -> RaggedBatch:
    """Batched JPEG decode (``torchvision.io.decode_jpeg(list, device=...)``, nvJPEG on CUDA) into a
    :class:`~lcv_vision.data.pipeline.RaggedBatch` that a resizing first op can augment directly."""
    import torchvision.io as tio

    from lcv_vision.data.ops import RaggedBatch

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    decoded = tio.decode_jpeg(tensors, mode=tio.ImageReadMode.RGB, device=device)
    return RaggedBatch.from_images(decoded if isinstance(decoded, list) else [decoded])


class EncodedImages:
    """Image files kept encoded (JPEG/PNG) and decoded one batch at a time by the loader.

    For ImageFolder data sets too large to hold decoded as uint8.  ``sources`` are file paths, or member
    names inside the zip ``zip_path`` (each reading thread opens its own handle: ``ZipFile`` reads are not
    thread-safe).
    """

    def __init__(
        self, sources: Sequence[str], targets: Tensor, class_names: list[str], zip_path: str | None = None
    ):
        if len(sources) != targets.shape[0]:
            raise ValueError(f"EncodedImages: {len(sources)} files but {targets.shape[0]} targets")
        self.sources = list(sources)
        self.targets = targets
        self.class_names = class_names
        self.zip_path = zip_path
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self.sources)

    def select(self, indices: Tensor) -> EncodedImages:
        """The samples at ``indices`` (e.g. one part of a split)."""
        return EncodedImages(
            [self.sources[i] for i in indices.tolist()],
            self.targets[indices],
            self.class_names,
            self.zip_path,
        )

    def name(self, i: int) -> str:
        """The file that sample ``i`` comes from (for error messages)."""
        return f"{self.zip_path}:{self.sources[i]}" if self.zip_path else self.sources[i]

    def read(self, i: int) -> bytes:
        """The encoded bytes of sample ``i``; :class:`CorruptImageError` naming the file when unreadable."""
        try:
            if self.zip_path is None:
                with open(self.sources[i], "rb") as fh:
                    return fh.read()
            zf = getattr(self._local, "zip", None)
            if zf is None:
                zf = self._local.zip = zipfile.ZipFile(self.zip_path)
            return zf.read(self.sources[i])
        except (OSError, KeyError, zipfile.BadZipFile) as err:
            raise CorruptImageError(f"cannot read image file {self.name(i)!r}: {err}") from err

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_local")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()


def list_image_folder(
    root: str, split: str, limit_per_class: int | None = None, require_every_class: bool = False
) -> EncodedImages:
    """The files of ``<root>/<split>/<class>/**`` (``root`` may be a ``.zip``), not decoded: see
    :class:`EncodedImages` (and :func:`load_image_folder` for what counts as an image)."""
    listing = _listing(root, split, require_every_class)
    items = _take_per_class(listing.items, limit_per_class)
    zip_path = root if root.lower().endswith(".zip") else None
    return EncodedImages(
        [p for p, _ in items],
        torch.tensor([c for _, c in items], dtype=torch.int64),
        listing.classes,
        zip_path,
    )


def stratified_split(targets: Tensor, fractions: Sequence[float], seed: int) -> list[Tensor]:
    """Deterministic per-class split of indices by ``fractions`` (summing to 1) with ``seed``."""
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must sum to 1, got {fractions}")
    g = torch.Generator().manual_seed(seed)
    parts: list[list[Tensor]] = [[] for _ in fractions]
    for c in torch.unique(targets).tolist():
        idx = (targets == c).nonzero().squeeze(1)
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        bounds = [0]
        acc = 0.0
        for f in fractions:
            acc += f
            bounds.append(int(round(acc * idx.numel())))
        for i in range(len(fractions)):
            parts[i].append(idx[bounds[i] : bounds[i + 1]])
    return [torch.sort(torch.cat(p)).values for p in parts]
