"""An ImageFolder tree of real photographs in every file format users have, built from the two photos that
ship inside scikit-learn (``china.jpg``, ``flower.jpg``: one class each).

Crops of varied sizes (odd sides, a 5-pixel-tall strip) are saved as JPEG, 8-bit PNG, 16-bit RGB PNG, 16-bit
grayscale PNG, RGBA PNG, grayscale PNG and JPEG, CMYK JPEG, GIF and WebP; one image per class sits in a
sub-folder of its class folder. :func:`reference_rgb` decodes a file with PIL (independently of torchvision)
for comparisons. Building it takes well under a second; tests copy it and add the bad file they are about.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

CLASSES = ("china", "flower")
#: (name, height, width, format) of every training image of a class; "more/" is a sub-folder.
TRAIN_FILES = (
    ("0.jpg", 61, 83, "jpeg"),
    ("1.png", 47, 47, "png8"),
    ("2.png", 70, 53, "png16"),
    ("3.png", 39, 90, "gray16"),
    ("4.png", 55, 41, "rgba"),
    ("5.png", 66, 66, "gray_png"),
    ("6.jpg", 52, 77, "gray_jpeg"),
    ("7.jpg", 80, 60, "cmyk"),
    ("8.gif", 45, 58, "gif"),
    ("more/9.webp", 5, 61, "webp"),
)
VAL_FILES = (
    ("0.jpg", 58, 72, "jpeg"),
    ("1.png", 64, 49, "png16"),
    ("2.jpg", 43, 43, "cmyk"),
)


def _crop(photo: np.ndarray, index: int, height: int, width: int) -> np.ndarray:
    """A ``height`` x ``width`` crop at a position that moves with ``index`` (different content per file)."""
    top = (37 * index) % (photo.shape[0] - height)
    left = (91 * index) % (photo.shape[1] - width)
    return np.ascontiguousarray(photo[top : top + height, left : left + width])


def encode(pixels: np.ndarray, kind: str) -> bytes:
    """``pixels`` (uint8 HxWx3) as a file of ``kind`` (see :data:`TRAIN_FILES`)."""
    image = Image.fromarray(pixels)
    out = io.BytesIO()
    if kind == "jpeg":
        image.save(out, format="JPEG", quality=90)
    elif kind == "png8":
        image.save(out, format="PNG")
    elif kind == "png16":  # PIL cannot write 16-bit RGB; OpenCV (an albumentations dependency) can
        import cv2

        wide = (
            pixels.astype(np.uint16) * 257
            + np.arange(pixels.size, dtype=np.uint16).reshape(pixels.shape) % 251
        )
        ok, encoded = cv2.imencode(".png", np.ascontiguousarray(wide[..., ::-1]))
        assert ok
        return encoded.tobytes()
    elif kind == "gray16":
        gray = np.asarray(image.convert("L"), dtype=np.uint16) * 257
        Image.fromarray(gray).save(out, format="PNG")  # mode I;16
    elif kind == "rgba":
        rgba = np.dstack(
            [pixels, np.linspace(0, 255, pixels.shape[1], dtype=np.uint8)[None].repeat(pixels.shape[0], 0)]
        )
        Image.fromarray(rgba).save(out, format="PNG")
    elif kind == "gray_png":
        image.convert("L").save(out, format="PNG")
    elif kind == "gray_jpeg":
        image.convert("L").save(out, format="JPEG", quality=90)
    elif kind == "cmyk":
        image.convert("CMYK").save(out, format="JPEG", quality=90)
    elif kind == "gif":
        image.save(out, format="GIF")
    elif kind == "webp":
        image.save(out, format="WEBP", lossless=True)
    else:
        raise ValueError(kind)
    return out.getvalue()


def write_photo_folder(root: Path) -> Path:
    """``root/{train,val}/{china,flower}/...`` as described in the module docstring; returns ``root``."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images  # two (427, 640, 3) uint8 photographs
    for split, files in (("train", TRAIN_FILES), ("val", VAL_FILES)):
        for c, (name, photo) in enumerate(zip(CLASSES, photos)):
            for i, (file, height, width, kind) in enumerate(files):
                path = root / split / name / file
                path.parent.mkdir(parents=True, exist_ok=True)
                offset = 0 if split == "train" else 50
                path.write_bytes(encode(_crop(photo, i + offset + 7 * c, height, width), kind))
    return root


def reference_rgb(path: Path | str) -> torch.Tensor:
    """The file decoded by PIL as uint8 (3, H, W) RGB. 16-bit images keep their high byte (PIL's own reading
    of 16-bit RGB; for 16-bit grayscale PIL's ``convert("RGB")`` clips to 255, so the shift is done here)."""
    image = Image.open(path)
    if image.mode.startswith("I;16") or image.mode == "I":
        gray = (np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8)
        array = np.repeat(gray[..., None], 3, axis=2)
    else:
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(np.array(array)).permute(2, 0, 1).contiguous()


def image_files(root: Path | str, split: str) -> list[Path]:
    """Every image file of a split, sorted as the loaders sort them (class, then path)."""
    base = Path(root) / split
    return [p for c in CLASSES for p in sorted((base / c).rglob("*")) if p.is_file()]
