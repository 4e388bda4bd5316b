"""Ops against torchvision's functional references, batch-vs-single-sample contracts, and the CPU fast paths
(hue formula, fused flip, per-step colour maps) against the plain formulas they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

A = pytest.importorskip("albumentations", reason="albumentations (a dependency) is not installed here")
cv2 = pytest.importorskip("cv2")
import torchvision.transforms.v2.functional as TF

from lcv_kernels.tolerances import image_tolerance, resample_tolerance
from lcv_vision.data import (
    CenterCrop,
    CoarseDropout,
    ColorJitter,
    Erasing,
    HorizontalFlip,
    Normalize,
    Pad,
    Pipeline,
    RandomCrop,
    RandomResizedCrop,
    Resize,
    ResizeCenterCrop,
    ToGray,
    VerticalFlip,
    from_albumentations,
)
from lcv_vision.data.functional.color import (
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    color_jitter,
    hsv_to_rgb,
    jitter_planes,
    jitter_tables,
    rgb_to_hsv,
)
from lcv_vision.data.functional.geometry import resized_crop


def hwc(x: torch.Tensor) -> np.ndarray:
    return x.permute(1, 2, 0).contiguous().numpy()


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255.0


#: torchvision's red luma weight 0.2989 against OpenCV's (and ours) 0.299, on values up to 1: not rounding,
#: a difference of the formulas.
LUMA_DIFFERENCE = 0.299 - 0.2989
#: The hue round trip: ~20 elementwise operations; a rotation grows an error in its input by up to 3 (each
#: output is ``max - delta * ramp``, the ramp's slope 1 in sixths of a turn of ``num / delta``).
HUE_LENGTH, HUE_GAIN = 20, 3.0


# ------------------------------------------------------------------------------------------ torchvision refs
@pytest.mark.parametrize("mode", ["constant", "reflect", "symmetric", "edge"])
def test_pad_matches_torchvision(real_images, mode):
    x = real_images[:4]
    out = Pad((3, 1, 2, 4), mode, fill=9).apply(x, {})
    ref = TF.pad(x, [3, 1, 2, 4], fill=9, padding_mode=mode)
    assert out.dtype == torch.uint8 and torch.equal(out, ref)


def test_flips_and_center_crop_match_torchvision(real_images):
    x = real_images[:6]
    every = {"flip": torch.ones(6, dtype=torch.bool)}
    assert torch.equal(HorizontalFlip(1.0).apply(x, every), TF.horizontal_flip(x))
    assert torch.equal(VerticalFlip(1.0).apply(x, every), TF.vertical_flip(x))
    # Even margins: for odd ones torchvision rounds the offset half up, albumentations (and we) round down.
    out, _ = Pipeline([CenterCrop((20, 24))], channels_last=False, compile=False)(x)
    assert torch.equal(out, TF.center_crop(x, [20, 24]).float())


def test_resized_crop_upscale_matches_torchvision(real_images):
    """Bilinear, no antialias (upscaling): torchvision crops then interpolates with half-pixel centres."""
    x = real_images[:5]
    params = RandomResizedCrop(48, scale=(0.2, 0.9)).sample(5, 32, 32, torch.Generator().manual_seed(3))
    ours = resized_crop(x, params["top"], params["left"], params["height"], params["width"], (48, 48))
    for i in range(5):
        y0, x0, h, w = (int(params[k][i]) for k in ("top", "left", "height", "width"))
        ref = TF.resized_crop(x[i].float(), y0, x0, h, w, [48, 48], antialias=False)
        # Two bilinear taps per axis; the two libraries compute the source positions (up to 48 px) apart.
        torch.testing.assert_close(ours[i], ref, atol=resample_tolerance(4, 48, scale=255), rtol=0)


@pytest.mark.parametrize("factor", [0.25, 0.9, 1.7])
def test_brightness_contrast_saturation_match_torchvision(real_images, factor):
    x = real_images[:6].float()
    f = torch.full((6,), factor)
    # torchvision's luma weights are (0.2989, 0.587, 0.114), OpenCV's (0.299, ...): 1e-4 of a level apart.
    for ours_fn, ref_fn in (
        (adjust_brightness, TF.adjust_brightness),
        (adjust_contrast, TF.adjust_contrast),
        (adjust_saturation, TF.adjust_saturation),
    ):
        torch.testing.assert_close(
            ours_fn(x, f) / 255.0,
            ref_fn(_unit(real_images[:6]), factor),
            # the luma weights enter through the grey level, scaled by |1 - factor|; the contrast mean
            # sums 32*32*3 values; factors above 1 grow the rounding.
            atol=abs(1 - factor) * LUMA_DIFFERENCE + image_tolerance(32 * 32 * 3 + 4, gain=max(factor, 1)),
            rtol=0,
            msg=ours_fn.__name__,
        )


@pytest.mark.parametrize("shift", [-0.5, -0.2, 0.03, 0.31, 0.5])
def test_hue_matches_torchvision(real_images, shift):
    ours = adjust_hue(real_images[:8].float(), torch.full((8,), shift)) / 255.0
    atol = image_tolerance(HUE_LENGTH, gain=HUE_GAIN)
    torch.testing.assert_close(ours, TF.adjust_hue(_unit(real_images[:8]), shift), atol=atol, rtol=0)


def test_hue_fast_formula_equals_hsv_round_trip_on_edge_cases():
    """Gray pixels, black, white, ties between channels, every sextant, per-sample shifts."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (6, 3, 16, 16), generator=g).float()
    x[0] = 128.0  # gray everywhere
    x[1, :, :4] = 0.0  # black rows
    x[1, :, 4:8] = 255.0  # white rows
    x[2, 0] = x[2, 1]  # r == g ties
    x[3, 1] = x[3, 2]  # g == b ties
    x[4, 0] = x[4, 2]  # r == b ties
    shift = torch.tensor([0.2, -0.5, 0.5, 0.25, -0.1, 0.0])
    hue, sat, val = rgb_to_hsv(x / 255.0)
    ref = hsv_to_rgb((hue + shift.view(-1, 1, 1)).remainder(1.0), sat, val) * 255.0
    atol = image_tolerance(HUE_LENGTH, scale=255, gain=HUE_GAIN)
    torch.testing.assert_close(adjust_hue(x, shift), ref, atol=atol, rtol=0)
    assert torch.equal(adjust_hue(x, shift)[0], x[0])  # gray has no hue to rotate


def test_normalize_grayscale_erase_match_torchvision(real_images):
    x = real_images[:4]
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    torch.testing.assert_close(
        Normalize(mean, std).apply(x, {}),
        TF.normalize(_unit(x), mean, std),
        atol=image_tolerance(3, gain=1 / 0.2),  # scale, subtract, divide by std >= 0.2
        rtol=0,
    )
    gray = ToGray(1.0).apply(x.float(), {"gray": torch.ones(4, dtype=torch.bool)})
    torch.testing.assert_close(
        gray / 255.0,
        TF.rgb_to_grayscale(_unit(x), num_output_channels=3),
        atol=LUMA_DIFFERENCE + image_tolerance(3 + 1),  # three weighted channels, then the scale
        rtol=0,
    )
    holes = torch.tensor([[[3, 5, 13, 9]]] * 4)  # x0, y0, x1, y1
    erased = Erasing(fill=0.5, p=1.0).apply(_unit(x), {"holes": holes})
    assert torch.equal(erased, TF.erase(_unit(x), 5, 3, 4, 10, torch.tensor(0.5)))


# ------------------------------------------------------------------------------------------ albumentations
def test_vertical_flip_matches_albumentations(real_images):
    x = real_images[:4]
    out = VerticalFlip(1.0).apply(x, {"flip": torch.ones(4, dtype=torch.bool)})
    for i in range(4):
        assert np.array_equal(hwc(out[i]), A.VerticalFlip(p=1.0)(image=hwc(x[i]))["image"])


def test_translated_random_pipeline_equals_albumentations_given_the_same_params(real_images, compiled):
    """Pad + crop + flip + normalize + dropout, whole pipeline, fed the parameters we sampled."""
    compose = A.Compose(
        [
            A.Pad(4, border_mode=cv2.BORDER_REFLECT_101),
            A.RandomCrop(32, 32),
            A.HorizontalFlip(),
            A.Normalize(),
            A.CoarseDropout((1, 2), (4, 8), (4, 8), fill=0.0, p=0.5),
        ]
    )
    pipe = from_albumentations(compose, channels_last=False, compile=compiled)
    x = real_images[:16]
    params = pipe.sample(16, 32, 32, torch.Generator().manual_seed(7))
    ours, _ = pipe(x, params=params)
    pad, crop, flip, norm, drop = compose.transforms
    for i in range(16):
        img = pad.apply(hwc(x[i]), **pad.get_params_dependent_on_data({"shape": (32, 32)}, {}))
        y0, x0 = int(params[0]["top"][i]), int(params[0]["left"][i])
        img = crop.apply(img, crop_coords=(x0, y0, x0 + 32, y0 + 32))
        if params[1]["flip"][i]:
            img = flip.apply(img)
        img = norm.apply(img, **norm.get_params())
        holes = params[3]["holes"][i].numpy()
        holes = holes[holes[:, 2] > holes[:, 0]]
        if len(holes):
            img = drop.apply(img, holes=holes, seed=0)
        # Normalize's scale, subtract and divide by std >= 0.224 in both libraries (the rest moves pixels).
        atol = image_tolerance(3, gain=1 / 0.224)
        np.testing.assert_allclose(hwc(ours[i]), img, atol=atol, rtol=0, err_msg=f"sample {i}")


def test_erasing_params_match_albumentations_in_distribution():
    n = 4000
    ours = Erasing(scale=(0.05, 0.3), ratio=(0.4, 2.5), p=1.0).sample(
        n, 24, 40, torch.Generator().manual_seed(0)
    )
    h = ours["holes"][:, 0].double()
    ref_t = A.Erasing(scale=(0.05, 0.3), ratio=(0.4, 2.5), p=1.0)
    ref_t.set_random_seed(0)
    ref = np.stack(
        [ref_t.get_params_dependent_on_data({"shape": (24, 40)}, {})["holes"][0] for _ in range(n)]
    )
    for col, name in ((2, "width"), (3, "height")):
        ours_size = (h[:, col] - h[:, col - 2]).numpy()
        ref_size = ref[:, col] - ref[:, col - 2]
        assert abs(ours_size.mean() - ref_size.mean()) < 0.3, name
        assert abs(ours_size.std() - ref_size.std()) < 0.3, name
    assert abs(h[:, 0].mean().item() - ref[:, 0].mean()) < 0.6  # left offsets


# --------------------------------------------------------------------------------------- per-sample contracts
_RANDOM_OPS = [
    RandomCrop(24, padding=3, padding_mode="reflect"),
    RandomResizedCrop(20),
    HorizontalFlip(),
    VerticalFlip(),
    ColorJitter(0.4, 0.4, 0.4, 0.2, p=1.0),
    ToGray(),
    CoarseDropout((1, 3), (2, 6), (2, 6), fill=17, p=1.0),
    Erasing(p=1.0),
    Resize((20, 28)),
    ResizeCenterCrop(20, 24),
]


@pytest.mark.parametrize("op", _RANDOM_OPS, ids=lambda op: type(op).__name__)
def test_batched_op_equals_the_op_on_each_sample_alone(real_images, op):
    """A sample's result depends on its own image and parameters only (batched == unbatched)."""
    x = real_images[:12, :, :24, :24]
    params = op.sample(12, 24, 24, torch.Generator().manual_seed(1))
    batched = op.apply(x, params)
    # A batch is reduced in another order than one sample: at most the contrast mean over 24*24*3 levels
    # (up to 255) plus ~20 elementwise steps, grown by three blends of factors up to 1.4.
    atol = image_tolerance(24 * 24 * 3 + 20, scale=255, gain=1.4**3)
    for i in range(12):
        single = op.apply(x[i : i + 1], {k: v[i : i + 1] for k, v in params.items()})
        torch.testing.assert_close(batched[i : i + 1], single, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "op",
    [o for o in _RANDOM_OPS if not isinstance(o, (Resize, ResizeCenterCrop))],
    ids=lambda op: type(op).__name__,
)
def test_random_ops_draw_different_parameters_for_each_sample(op):
    """Identical images in, different results out: parameters are per sample, not one draw per batch."""
    x = torch.zeros(64, 3, 24, 24, dtype=torch.uint8)
    x[:, 0, :, :12] = 200  # asymmetric content so that flips and crops show
    x[:, 1, :8] = 90
    x[:, 2] = torch.arange(24, dtype=torch.uint8) * 5
    out = op.apply(x, op.sample(64, 24, 24, torch.Generator().manual_seed(2))).float()
    distinct = {tuple(o.flatten()[::7].tolist()) for o in out}
    assert len(distinct) > 1
    if not isinstance(op, (HorizontalFlip, VerticalFlip, ToGray)):  # binary choices give 2 outcomes
        assert len(distinct) > 16


# ------------------------------------------------------------------------------------------ fused fast paths
@pytest.mark.parametrize(
    "first",
    [
        RandomResizedCrop(40, scale=(0.3, 1.0)),
        RandomCrop(28, padding=4),
        RandomCrop(28, padding=4, padding_mode="symmetric"),
        CenterCrop(20),
        Resize((36, 30)),
        ResizeCenterCrop(24),
    ],
    ids=lambda op: type(op).__name__,
)
def test_flip_folded_into_the_previous_op_is_exact(real_images, first):
    pipe = Pipeline([first, HorizontalFlip(p=0.5)], channels_last=False, compile=False)
    x = real_images[:16]
    params = pipe.sample(16, 32, 32, torch.Generator().manual_seed(4))
    assert pipe._steps == [[0, 1]]  # the flip really was folded
    fused, _ = pipe(x, params=params)
    unfused = HorizontalFlip().apply(first.apply(x, params[0]), params[1]).float()
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("form", ["eager", "step_tables"])
def test_fused_colour_steps_equal_the_separate_ops(real_images, form):
    """Both jitter algorithms equal brightness/contrast/saturation/hue applied one by one in each sample's
    order: the eager one (per-step affine maps, hue on just its samples) and the compiled one (a fixed
    sequence of 3 blends, hue, 3 blends, with per-sample coefficients)."""
    op = ColorJitter(0.5, 0.5, 0.5, 0.2, p=0.8)
    x = real_images[:24]
    p = op.sample(24, 32, 32, torch.Generator().manual_seed(5))
    if form == "eager":
        ours = op.apply(x, p)
    else:
        tables = jitter_tables(*(p[k] for k in ("brightness", "contrast", "saturation", "hue", "order")))
        ours = torch.stack(jitter_planes(x.float().unbind(1), tables), dim=1)
    fns = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
    keys = ("brightness", "contrast", "saturation", "hue")
    # In levels: the contrast mean over 32*32*3 values and ~20 elementwise steps, three blends up to 1.5.
    atol = image_tolerance(32 * 32 * 3 + 20, scale=255, gain=1.5**3)
    for i in range(24):
        ref = x[i : i + 1].float()
        for step in p["order"][i].tolist():
            ref = fns[step](ref, p[keys[step]][i : i + 1])
        torch.testing.assert_close(ours[i : i + 1], ref, atol=atol, rtol=0, msg=f"sample {i}")
    gray = x[:, :1]  # one channel: saturation and hue have nothing to change
    out = color_jitter(gray, p["brightness"], p["contrast"], p["saturation"], p["hue"], p["order"])
    assert out.shape == gray.shape


# ------------------------------------------------------------------------------------------ bad input
def test_bad_images_and_params_have_clear_errors():
    with pytest.raises(ValueError, match="1 or 3 channels"):
        Pipeline([HorizontalFlip()], compile=False)(torch.zeros(2, 4, 8, 8, dtype=torch.uint8))
    with pytest.raises(TypeError, match="tensor of images"):
        Pipeline([HorizontalFlip()], compile=False)(np.zeros((2, 3, 8, 8), np.uint8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="param dicts"):
        Pipeline([HorizontalFlip(), Normalize()], compile=False)(
            torch.zeros(2, 3, 8, 8, dtype=torch.uint8), params=[{}]
        )
    with pytest.raises(ValueError, match="2 mean values for images with 3 channels"):
        Normalize((0.5, 0.5), (0.5, 0.5)).apply(torch.zeros(1, 3, 4, 4), {})
    with pytest.raises(TypeError, match="floating point"):
        Pipeline([HorizontalFlip()], dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCrop(8, scale=(0.9, 0.1))
    with pytest.raises(ValueError, match="hue"):
        ColorJitter(hue=0.7)
    with pytest.raises(ValueError, match="padding_mode"):
        RandomCrop(8, padding=2, padding_mode="wrap")  # type: ignore[arg-type]


def test_folded_flip_composes_with_a_subclass_that_sets_its_own_flip(real_images):
    """A RandomCrop subclass setting its own ``flip`` in ``prepare`` (like the alternating flip) keeps a
    following flip."""

    class AlwaysMirrorCrop(RandomCrop):
        def prepare(self, params, shape, index=None):
            return super().prepare(
                {**params, "flip": torch.ones(len(params["top"]), dtype=torch.bool)}, shape, index
            )

    first = AlwaysMirrorCrop(28, padding=2)
    pipe = Pipeline([first, HorizontalFlip()], channels_last=False, compile=False)
    x = real_images[:16]
    params = pipe.sample(16, 32, 32, torch.Generator().manual_seed(6))
    fused, _ = pipe(x, params=params)
    unfused = HorizontalFlip().apply(first.apply(x, params[0]), params[1]).float()
    assert torch.equal(fused, unfused) and 0 < int(params[1]["flip"].sum()) < 16
