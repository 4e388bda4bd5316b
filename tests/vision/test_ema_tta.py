"""EMA, airbench's lookahead schedule and test-time augmentation on cases small enough to work out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lcv_kernels.tolerances import bound, reduction_tolerance, trajectory_tolerance
from lcv_vision.ema import ModelEMA, lookahead_decay
from lcv_vision.tta import predict_with_tta


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def test_ema_follows_the_recurrence_on_parameters_and_buffers():
    live = _net()
    ema = ModelEMA(live, decay=0.75)
    expected = {k: v.clone().double() for k, v in live.state_dict().items() if v.is_floating_point()}
    for step in range(4):
        with torch.no_grad():
            for p in live.parameters():
                p.add_(float(step + 1))
        live.train()(torch.randn(8, 3))  # moves the BN running statistics too
        ema.update(live)
        for k, v in live.state_dict().items():
            if v.is_floating_point():
                expected[k] = 0.75 * expected[k] + 0.25 * v.double()
    for k, v in ema.module.state_dict().items():
        if v.is_floating_point():
            # float32 against float64: each of the 4 updates rounds a blend of two terms
            atol = bound(trajectory_tolerance(torch.float32, 2, 4), expected[k])
            torch.testing.assert_close(v.double(), expected[k], atol=atol, rtol=0)
    # integer buffers are copied, not averaged
    assert ema.module[1].num_batches_tracked.item() == live[1].num_batches_tracked.item() == 4


def test_ema_is_frozen_in_eval_and_copy_to_resets_the_live_model():
    live = _net()
    ema = ModelEMA(live, decay=0.5)
    assert all(not p.requires_grad for p in ema.parameters())
    ema.train()
    assert not ema.module.training  # always evaluated with its averaged statistics
    with torch.no_grad():
        live[0].weight.add_(2.0)
    ema.update(live, decay=0.0)  # decay 0 copies
    torch.testing.assert_close(ema.module[0].weight, live[0].weight)
    with torch.no_grad():
        live[0].weight.zero_()
    ema.copy_to(live)
    torch.testing.assert_close(live[0].weight, ema.module[0].weight)
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        ema.update(live, decay=1.0)


def test_lookahead_decay_schedule():
    assert lookahead_decay(0, 100) == 0.0
    assert lookahead_decay(100, 100) == pytest.approx(0.95**5)
    assert lookahead_decay(50, 100) == pytest.approx(0.95**5 * 0.125)
    assert lookahead_decay(500, 100) == pytest.approx(0.95**5)  # clamped
    assert lookahead_decay(100, 100) == pytest.approx(0.7737809375)  # "reaches 0.77 at the end"
    with pytest.raises(ValueError):
        lookahead_decay(1, 0)


class _Recorder(nn.Module):
    """A linear 'classifier' (logits = W @ pixels) that records the views it was shown."""

    def __init__(self, pixels: int) -> None:
        super().__init__()
        self.weight = torch.randn(2, pixels, dtype=torch.float64)
        self.views: list[np.ndarray] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.views.append(x.numpy().copy())
        return x.flatten(1) @ self.weight.T


def test_tta_flip_translate_against_numpy_views():
    torch.manual_seed(0)
    images = torch.randn(2, 1, 4, 5, dtype=torch.float64)
    model = _Recorder(20)
    logits = predict_with_tta(model, images, "flip_translate")
    x = images.numpy()
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect")
    up_left, down_right = padded[:, :, 0:4, 0:5], padded[:, :, 2:6, 2:7]
    views = [x, x[..., ::-1], up_left, up_left[..., ::-1], down_right, down_right[..., ::-1]]
    weights = [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    w = model.weight.numpy()
    expected = sum(wt * (v.reshape(2, -1) @ w.T) for wt, v in zip(weights, views))
    # float64: six weighted views of a 20-term product each
    atol = bound(reduction_tolerance(torch.float64, 6 * 20), torch.from_numpy(expected))
    np.testing.assert_allclose(logits.numpy(), expected, rtol=0, atol=atol)
    seen = sorted(v.tobytes() for v in model.views)
    assert seen == sorted(np.ascontiguousarray(v).tobytes() for v in views)


def test_tta_modes_none_and_flip():
    images = torch.arange(12, dtype=torch.float64).view(1, 1, 3, 4)
    model = _Recorder(12)
    torch.testing.assert_close(predict_with_tta(model, images, "none"), images.flatten(1) @ model.weight.T)
    flipped = images[..., [3, 2, 1, 0]]
    expected = 0.5 * (images.flatten(1) + flipped.flatten(1)) @ model.weight.T
    torch.testing.assert_close(predict_with_tta(model, images, "flip"), expected)


def test_tta_keeps_channels_last_and_rejects_bad_input():
    images = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    formats = []

    def model(x):
        formats.append(x.is_contiguous(memory_format=torch.channels_last))
        return x.mean(dim=(1, 2, 3)).unsqueeze(1)

    predict_with_tta(model, images, "flip_translate")
    assert formats[2:] == [True] * 4  # the shifted views (slices) stay channels_last
    with pytest.raises(ValueError, match="unknown TTA mode"):
        predict_with_tta(model, images, "rotate")
    with pytest.raises(ValueError, match=r"batch of images \(N, C, H, W\)"):
        predict_with_tta(model, images[0], "flip")
