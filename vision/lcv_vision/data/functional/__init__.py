"""The tensor functions behind the ops: geometry, colour, erasing, mixing (no parameter drawing here)."""

from lcv_vision.data.functional.color import (
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    color_jitter,
    hsv_to_rgb,
    jitter_planes,
    jitter_tables,
    normalize,
    rgb_to_gray,
    rgb_to_hsv,
)
from lcv_vision.data.functional.erasing import fill_holes
from lcv_vision.data.functional.geometry import (
    crop_tables,
    crop_with_padding,
    gather_crop,
    resample,
    resample_tables,
    resized_crop,
)
from lcv_vision.data.functional.mixing import mix_images, mix_targets, one_hot_smooth

__all__ = [
    "adjust_brightness",
    "adjust_contrast",
    "adjust_hue",
    "adjust_saturation",
    "color_jitter",
    "crop_tables",
    "crop_with_padding",
    "fill_holes",
    "gather_crop",
    "hsv_to_rgb",
    "jitter_planes",
    "jitter_tables",
    "mix_images",
    "mix_targets",
    "normalize",
    "one_hot_smooth",
    "resample",
    "resample_tables",
    "resized_crop",
    "rgb_to_gray",
    "rgb_to_hsv",
]
