"""The compiled colour jitter (fixed step sequence, a contrast mean per half) against the separate ops, in
every one of the 24 orders, eagerly and compiled: the contrast mean is the one of the image as that step
sees it, wherever the step falls (before the hue step, after it, first, last).  And a normalize folded into
the jitter against the two ops run one after the other."""

from __future__ import annotations

import itertools

import pytest
import torch

from lcv_kernels.tolerances import image_tolerance
from lcv_vision.data import ColorJitter, Normalize, Pipeline
from lcv_vision.data.functional.color import (
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    jitter_planes,
    jitter_tables,
)

#: Every order of (0 brightness, 1 contrast, 2 saturation, 3 hue), one sample each.
ORDERS = torch.tensor(list(itertools.permutations(range(4))))
#: In 0..255 levels: float rounding of the same arithmetic on one 16x20 image: the contrast mean over
#: 16*20*3 values and ~20 elementwise steps (the hue round trip's included), magnified by later blends of
#: factors up to 1.5 (brightness), 1.8 (contrast) and 1.8 (saturation). Far below the whole levels by which
#: a contrast mean taken at the wrong step shows.
TOLERANCE = image_tolerance(16 * 20 * 3 + 20, scale=255, gain=1.5 * 1.8 * 1.8)
#: The folded Normalize on 32x32 images, in normalized units: the jitter's chain (factors up to 1.4) then
#: Normalize's 1/0.224 (or 1/0.7 * 255/200 for the one-value case, smaller).
FOLDED_TOLERANCE = image_tolerance(32 * 32 * 3 + 20, gain=1.4**3 / 0.224)


def _factors(n: int) -> tuple[torch.Tensor, ...]:
    """Strong factors, so that a contrast mean taken at the wrong step shows by whole levels."""
    g = torch.Generator().manual_seed(0)
    brightness = 0.5 + torch.rand(n, generator=g)
    contrast = torch.where(torch.arange(n) % 2 == 0, 0.3, 1.7) + 0.1 * torch.rand(n, generator=g)
    saturation = 0.2 + 1.6 * torch.rand(n, generator=g)
    hue = 0.4 * torch.rand(n, generator=g) - 0.2
    return brightness, contrast, saturation, hue


def _one_by_one(x: torch.Tensor, factors: tuple[torch.Tensor, ...], order: torch.Tensor) -> torch.Tensor:
    fns = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
    out = []
    for i in range(x.shape[0]):
        ref = x[i : i + 1].float()
        for step in order[i].tolist():
            ref = fns[step](ref, factors[step][i : i + 1])
        out.append(ref)
    return torch.cat(out)


def _jitter(x: torch.Tensor, tables: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack(jitter_planes(x.float().unbind(1), tables), dim=1)


@pytest.mark.parametrize("form", ["eager", "compiled"])
def test_step_sequence_equals_the_separate_ops_in_every_order(real_images, form):
    x = real_images[:24, :, :16, :20]
    factors = _factors(24)
    tables = jitter_tables(*factors, ORDERS)
    run = torch.compile(_jitter, dynamic=False, fullgraph=True) if form == "compiled" else _jitter
    ours = run(x, tables)
    ref = _one_by_one(x, factors, ORDERS)
    for i in range(24):
        torch.testing.assert_close(
            ours[i], ref[i], atol=TOLERANCE, rtol=0, msg=f"order {ORDERS[i].tolist()} (sample {i})"
        )


def test_a_gray_batch_runs_the_blends_without_hue(real_images):
    """One channel: saturation is the identity, there is no hue step, contrast uses the plane's mean."""
    x = real_images[:24, :1, :12, :12]
    factors = _factors(24)
    ours = torch.stack(jitter_planes(x.float().unbind(1), jitter_tables(*factors, ORDERS)), dim=1)
    assert ours.shape == x.shape
    for i in range(24):
        ref = x[i : i + 1].float()
        for step in ORDERS[i].tolist():
            if step == 0:
                ref = (ref * factors[0][i]).clamp(0, 255)
            elif step == 1:
                ref = (ref * factors[1][i] + ref.mean() * (1 - factors[1][i])).clamp(0, 255)
        torch.testing.assert_close(ours[i : i + 1], ref, atol=TOLERANCE, rtol=0, msg=f"sample {i}")


# ------------------------------------------------------------------------------------- normalize folded in
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "normalize, hue",
    [(Normalize(), 0.1), (Normalize((0.3,), (0.7,), max_pixel_value=200.0), 0.1), (Normalize(), 0.0)],
    ids=["per-channel", "one-value", "no-hue-step"],
)
def test_normalize_folded_into_the_jitter_equals_the_two_ops(real_images, compile_, normalize, hue):
    jitter = ColorJitter(0.4, 0.4, 0.4, hue, p=0.8)
    pipe = Pipeline([jitter, normalize], channels_last=False, compile=compile_)
    assert pipe._steps == [[0, 1]]  # the normalize really was folded
    x = real_images[:8]
    params = pipe.sample(8, 32, 32, torch.Generator().manual_seed(3))
    ours, _ = pipe(x, params=params)
    ref = normalize.apply(jitter.apply(x, params[0]), {})
    torch.testing.assert_close(ours, ref, atol=FOLDED_TOLERANCE, rtol=0)


def test_a_folded_normalize_keeps_its_channel_check():
    pipe = Pipeline([ColorJitter(p=1.0), Normalize((0.5, 0.5), (0.2, 0.2))], compile=False)
    with pytest.raises(ValueError, match="2 mean values for images with 3 channels"):
        pipe(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
