"""Image files from users (uploads, paths): decode or refuse, with the HTTP status a server answers.

Why strict: the model was trained on 8-bit RGB stills; a 16-bit, CMYK or animated file would be converted in a
way nobody chose (clipped, colour-managed or first-frame-only), so it is refused with a message instead.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from lcv_vision.deploy.errors import ImageRejectedError

__all__ = ["ACCEPTED_FORMATS", "DEFAULT_MAX_BYTES", "decode_image"]

ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP")

#: Largest accepted file (bytes); a server can lower or raise it (``lcv serve --max-image-bytes``).
DEFAULT_MAX_BYTES = 10 * 1024 * 1024

#: 8-bit modes converted to RGB as the data sets are (grey, palette, alpha dropped).
_EIGHT_BIT_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "RGBa", "La", "1")


def decode_image(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES, name: str = "the image") -> Image.Image:
    """An 8-bit RGB still (JPEG, PNG or WebP) from ``data``, or :class:`ImageRejectedError`."""
    if not data:
        raise ImageRejectedError(f"{name} is empty: send the bytes of a JPEG, PNG or WebP file", 400)
    if len(data) > max_bytes:
        raise ImageRejectedError(f"{name} has {len(data):,} bytes, more than the limit of {max_bytes:,}", 413)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageRejectedError(f"{name} has too many pixels ({err})", 413) from err
    except UnidentifiedImageError as err:
        raise ImageRejectedError(f"{name} is not an image: send a JPEG, PNG or WebP file", 415) from err
    except (OSError, SyntaxError, ValueError) as err:  # truncated or corrupt data
        raise ImageRejectedError(f"{name} is truncated or corrupt ({err})", 400) from err
    if image.format not in ACCEPTED_FORMATS:
        raise ImageRejectedError(f"{name} is {image.format}; send JPEG, PNG or WebP", 415)
    frames = int(getattr(image, "n_frames", 1))
    if frames > 1:
        raise ImageRejectedError(f"{name} is animated ({frames} frames); send a still image", 415)
    if image.mode == "CMYK":
        raise ImageRejectedError(f"{name} is CMYK; send an RGB image (the model was trained on RGB)", 415)
    if image.mode not in _EIGHT_BIT_MODES:
        raise ImageRejectedError(
            f"{name} has mode {image.mode} (16-bit or float samples); send an 8-bit image", 415
        )
    return image.convert("RGB")
