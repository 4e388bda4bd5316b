"""Build uint8 ``(N, C, H, W)`` image tensors + int64 labels from the data sets we support.

- :func:`load_digits_images`: scikit-learn's bundled ``load_digits`` (1797 real 8x8 digits), no download.
- :func:`load_cifar10`: torchvision's CIFAR-10 (downloads when asked).
- :func:`load_image_folder`: an ImageFolder tree ``<root>/<split>/<class>/<file>`` of JPEG/PNG files, or the
  same layout inside a ``.zip`` (read member by member, never extracted).

Images are decoded once, in a thread pool, with a progress bar when it takes more than a few seconds.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
OnCorrupt = Literal["raise", "skip"]


class CorruptImageError(RuntimeError):
    """An image file could not be decoded."""


@dataclass
class ImageSet:
    """uint8 images ``(N, C, H, W)``, int64 targets ``(N,)`` and the class names."""

    images: Tensor
    targets: Tensor
    class_names: list[str]
    skipped: int = 0

    def __len__(self) -> int:
        return int(self.images.shape[0])


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
        raise ValueError("CIFAR-10: no root given; pass root='<dir>' (and download=True to fetch it) or zip_path=")
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
def _list_folder(root: str, split: str) -> tuple[list[tuple[str, int]], list[str]]:
    base = os.path.join(root, split)
    if not os.path.isdir(base):
        raise FileNotFoundError(f"image folder split not found: {base!r} (expected {root}/{split}/<class>/<image>)")
    classes = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    items = []
    for c, name in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(base, name))):
            if f.lower().endswith(IMAGE_EXTENSIONS):
                items.append((os.path.join(base, name, f), c))
    return items, classes


def _list_zip(zf: zipfile.ZipFile, split: str) -> tuple[list[tuple[str, int]], list[str]]:
    prefix = split.strip("/") + "/"
    members = []
    for name in zf.namelist():
        if name.startswith(prefix) and name.lower().endswith(IMAGE_EXTENSIONS):
            parts = name[len(prefix):].split("/")
            if len(parts) == 2:
                members.append((parts[0], name))
    classes = sorted({c for c, _ in members})
    index = {c: i for i, c in enumerate(classes)}
    return [(name, index[c]) for c, name in sorted(members, key=lambda m: m[1])], classes


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise ValueError(f"{path!r} is not a zip file ({err}); pass a folder or a zip of <split>/<class>/<image>") \
            from err


def list_classes(root: str, split: str) -> list[str]:
    """Sorted class names of ``<root>/<split>/<class>/`` (``root`` a folder or a ``.zip``), cheaply."""
    if not os.path.exists(root):
        raise FileNotFoundError(f"image folder or zip not found: {root!r}")
    if root.lower().endswith(".zip"):
        with _open_zip(root) as zf:
            prefix = split.strip("/") + "/"
            names = {n[len(prefix):].split("/")[0] for n in zf.namelist() if n.startswith(prefix) and
                     n.count("/") >= 2}
            classes = sorted(c for c in names if c)
    else:
        base = os.path.join(root, split)
        if not os.path.isdir(base):
            raise FileNotFoundError(
                f"image folder split not found: {base!r} (expected {root}/{split}/<class>/<image>)"
            )
        classes = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    if not classes:
        raise FileNotFoundError(f"no class folders under {split!r} in {root!r}")
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
    """Bytes of a JPEG/PNG -> uint8 (3, H, W) RGB; :class:`CorruptImageError` naming the file otherwise."""
    import torchvision.io as tio

    try:
        img = tio.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tio.ImageReadMode.RGB)
    except Exception as err:  # torchvision raises RuntimeError with libjpeg/libpng messages
        raise CorruptImageError(f"cannot decode image {name!r}: {err}") from err
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


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc=desc, unit="img", delay=PROGRESS_DELAY_S, leave=False)


def _decode_all(
    items: Sequence[tuple[str, int]], read: Callable[[str], bytes], storage_size: int | None,
    on_corrupt: OnCorrupt, num_threads: int, desc: str,
) -> tuple[list[Tensor], list[int], int]:
    if on_corrupt not in ("raise", "skip"):
        raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")

    def work(item: tuple[str, int]) -> Tensor | None:
        path, _ = item
        try:
            try:
                data = read(path)
            except OSError as err:  # unreadable (permissions, I/O error): handled like a corrupt file
                raise CorruptImageError(f"cannot read image file {path!r}: {err}") from err
            img = decode_image_bytes(data, path)
        except CorruptImageError:
            if on_corrupt == "raise":
                raise
            return None
        return fit_to_square(img, storage_size) if storage_size is not None else img

    bar = _progress(len(items), desc)
    images, labels, skipped = [], [], 0
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        for (path, label), img in zip(items, pool.map(work, items)):
            if bar is not None:
                bar.update(1)
            if img is None:
                skipped += 1
                continue
            images.append(img)
            labels.append(label)
    if bar is not None:
        bar.close()
    return images, labels, skipped


def load_image_folder(
    root: str,
    split: str,
    storage_size: int | None = None,
    on_corrupt: OnCorrupt = "raise",
    limit_per_class: int | None = None,
    num_threads: int = 2,
) -> ImageSet:
    """Decode ``<root>/<split>/<class>/*.{jpg,jpeg,png}`` (``root`` may be a ``.zip``) into an :class:`ImageSet`.

    ``storage_size`` resizes every image to a square of that side (needed when sizes differ).
    ``on_corrupt="skip"`` drops undecodable files and warns how many; ``"raise"`` names the first one.
    """
    if not os.path.exists(root):
        raise FileNotFoundError(f"image folder or zip not found: {root!r}")
    if root.lower().endswith(".zip"):
        with _open_zip(root) as zf:
            items, classes = _list_zip(zf, split)
            if not items:
                raise FileNotFoundError(f"no images under '{split}/<class>/' in zip {root!r}")
            items = _take_per_class(items, limit_per_class)
            # ZipFile is not thread-safe for concurrent reads: read bytes serially, decode in threads.
            blobs = {name: zf.read(name) for name, _ in items}
        read: Callable[[str], bytes] = blobs.__getitem__
    else:
        items, classes = _list_folder(root, split)
        if not items:
            raise FileNotFoundError(f"no {'/'.join(IMAGE_EXTENSIONS)} images under {os.path.join(root, split)!r}")
        items = _take_per_class(items, limit_per_class)

        def read(path: str) -> bytes:
            with open(path, "rb") as fh:
                return fh.read()

    images, labels, skipped = _decode_all(items, read, storage_size, on_corrupt, num_threads,
                                          f"decoding {os.path.basename(root)}/{split}")
    if skipped:
        warnings.warn(f"skipped {skipped} corrupt or unreadable image(s) in {root!r} ({split})", stacklevel=2)
    if not images:
        raise ValueError(f"no decodable images in {root!r} ({split}); {skipped} file(s) were corrupt")
    sizes = {tuple(im.shape[-2:]) for im in images}
    if len(sizes) > 1:
        raise ValueError(
            f"images in {root!r} ({split}) have {len(sizes)} different sizes (e.g. {sorted(sizes)[:3]}); "
            "pass storage_size=<int> to store them at one size"
        )
    return ImageSet(torch.stack(images), torch.tensor(labels, dtype=torch.int64), classes, skipped)


def is_jpeg(data: bytes) -> bool:
    """JPEG files start with the SOI marker FF D8 FF (what nvJPEG can decode)."""
    return data[:3] == b"\xff\xd8\xff"


def decode_jpeg_batch(data: Sequence[bytes], device: torch.device | str = "cuda"):
    """Batched JPEG decode (``torchvision.io.decode_jpeg(list, device=...)``, nvJPEG on CUDA) into a
    :class:`~vision.data.pipeline.RaggedBatch` that a resizing first op can augment directly."""
    import torchvision.io as tio

    from vision.data.pipeline import RaggedBatch

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    decoded = tio.decode_jpeg(tensors, mode=tio.ImageReadMode.RGB, device=device)
    return RaggedBatch.from_images(decoded if isinstance(decoded, list) else [decoded])


class EncodedImages:
    """Image files kept encoded (JPEG/PNG) and decoded one batch at a time by the loader.

    For ImageFolder data sets too large to hold decoded as uint8.  ``sources`` are file paths, or member
    names inside the zip ``zip_path`` (each reading thread opens its own handle: ``ZipFile`` reads are not
    thread-safe).
    """

    def __init__(self, sources: Sequence[str], targets: Tensor, class_names: list[str],
                 zip_path: str | None = None):
        if len(sources) != targets.shape[0]:
            raise ValueError(f"EncodedImages: {len(sources)} files but {targets.shape[0]} targets")
        self.sources = list(sources)
        self.targets = targets
        self.class_names = class_names
        self.zip_path = zip_path
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self.sources)

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


def list_image_folder(root: str, split: str, limit_per_class: int | None = None) -> EncodedImages:
    """The files of ``<root>/<split>/<class>/*`` (``root`` may be a ``.zip``), not decoded: see
    :class:`EncodedImages`."""
    if not os.path.exists(root):
        raise FileNotFoundError(f"image folder or zip not found: {root!r}")
    if root.lower().endswith(".zip"):
        with _open_zip(root) as zf:
            items, classes = _list_zip(zf, split)
        if not items:
            raise FileNotFoundError(f"no images under '{split}/<class>/' in zip {root!r}")
        zip_path: str | None = root
    else:
        items, classes = _list_folder(root, split)
        if not items:
            raise FileNotFoundError(f"no {'/'.join(IMAGE_EXTENSIONS)} images under {os.path.join(root, split)!r}")
        zip_path = None
    items = _take_per_class(items, limit_per_class)
    return EncodedImages([p for p, _ in items], torch.tensor([c for _, c in items], dtype=torch.int64), classes,
                         zip_path)


def stratified_split(
    targets: Tensor, fractions: Sequence[float], seed: int
) -> list[Tensor]:
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
            parts[i].append(idx[bounds[i]: bounds[i + 1]])
    return [torch.sort(torch.cat(p)).values for p in parts]
