"""Mixup / CutMix on whole batches, with timm's ``batch`` / ``pair`` / ``elem`` modes.

Sample ``i`` is mixed with sample ``N - 1 - i`` (the batch reversed), as in timm; targets become soft
``(N, num_classes)`` float targets ``lam * onehot(y) + (1 - lam) * onehot(y reversed)`` with optional
label smoothing.  For CutMix, ``lam`` is corrected to the pasted box's true area (``correct_lam``).
The tensor work is in :mod:`lcv_vision.data.functional.mixing`.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lcv_vision.data.functional.mixing import cutmix_boxes, mix_images, mix_targets, one_hot_smooth
from lcv_vision.data.ops import BatchOp, Params

MixMode = Literal["batch", "pair", "elem"]


class MixupCutmix(BatchOp):
    """Mixup and/or CutMix with per-batch, per-pair or per-element parameters (timm ``Mixup`` semantics).

    Args:
        num_classes: number of classes for the soft targets.
        mixup_alpha, cutmix_alpha: Beta(alpha, alpha) concentration; 0 disables that kind.
        prob: probability that a batch (``batch`` mode) / pair / element is mixed at all.
        switch_prob: probability of CutMix instead of Mixup when both are enabled.
        mode: ``batch`` (one draw for the batch), ``pair`` (samples i and N-1-i share a draw; needs an even
            batch) or ``elem`` (every sample its own draw).
        label_smoothing: smoothing of the one-hot targets before mixing.
        correct_lam: use the clipped CutMix box's true area for ``lam``.
    """

    mixes_targets = True

    def __init__(
        self,
        num_classes: int,
        mixup_alpha: float = 0.8,
        cutmix_alpha: float = 1.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: MixMode = "batch",
        label_smoothing: float = 0.0,
        correct_lam: bool = True,
    ):
        if mode not in ("batch", "pair", "elem"):
            raise ValueError(f"MixupCutmix: mode must be 'batch', 'pair' or 'elem', got {mode!r}")
        if mixup_alpha < 0 or cutmix_alpha < 0 or mixup_alpha == cutmix_alpha == 0:
            raise ValueError(
                f"MixupCutmix: need mixup_alpha > 0 or cutmix_alpha > 0, got {mixup_alpha}, {cutmix_alpha}"
            )
        if num_classes < 1:
            raise ValueError(f"MixupCutmix: num_classes must be >= 1, got {num_classes}")
        for name, v in (("prob", prob), ("switch_prob", switch_prob), ("label_smoothing", label_smoothing)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"MixupCutmix: {name} must be in [0, 1], got {v}")
        self.num_classes = num_classes
        self.mixup_alpha = float(mixup_alpha)
        self.cutmix_alpha = float(cutmix_alpha)
        self.prob = prob
        self.switch_prob = switch_prob
        self.mode = mode
        self.label_smoothing = label_smoothing
        self.correct_lam = correct_lam

    def _draw(self, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            use_cutmix = rng.random(k) < self.switch_prob
            lam = np.where(
                use_cutmix,
                rng.beta(self.cutmix_alpha, self.cutmix_alpha, k),
                rng.beta(self.mixup_alpha, self.mixup_alpha, k),
            )
        elif self.mixup_alpha > 0:
            use_cutmix = np.zeros(k, dtype=bool)
            lam = rng.beta(self.mixup_alpha, self.mixup_alpha, k)
        else:
            use_cutmix = np.ones(k, dtype=bool)
            lam = rng.beta(self.cutmix_alpha, self.cutmix_alpha, k)
        lam = np.where(rng.random(k) < self.prob, lam, 1.0)
        return lam, use_cutmix

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> Params:
        if self.mode == "pair" and n % 2:
            raise ValueError(f"MixupCutmix(mode='pair') needs an even batch size, got {n}")
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
        k = {"batch": 1, "pair": n // 2, "elem": n}[self.mode]
        lam, use_cutmix = self._draw(k, rng)
        boxes, corrected = cutmix_boxes(lam, int(height), int(width), rng)
        if self.correct_lam:
            lam = np.where(use_cutmix, corrected, lam)
        boxes = boxes * use_cutmix[:, None]
        if self.mode == "batch":
            lam, use_cutmix, boxes = (np.repeat(a, n, axis=0) for a in (lam, use_cutmix, boxes))
        elif self.mode == "pair":
            lam, use_cutmix, boxes = (np.concatenate((a, a[::-1]), axis=0) for a in (lam, use_cutmix, boxes))
        return {
            "lam": torch.from_numpy(np.ascontiguousarray(lam)).float(),
            "cutmix": torch.from_numpy(np.ascontiguousarray(use_cutmix)),
            "boxes": torch.from_numpy(np.ascontiguousarray(boxes)).long(),
        }

    def apply(self, images: Tensor, params: Params) -> Tensor:
        return mix_images(images, *(params[k].to(images.device) for k in ("lam", "cutmix", "boxes")))

    def apply_targets(self, targets: Tensor, params: Params) -> Tensor:
        if targets.ndim == 1:
            if targets.dtype.is_floating_point:
                raise TypeError("MixupCutmix: 1-D targets must be integer class indices")
            soft = one_hot_smooth(targets, self.num_classes, self.label_smoothing)
        elif targets.ndim == 2 and targets.shape[1] == self.num_classes:
            soft = targets.float()
        else:
            raise ValueError(
                f"MixupCutmix: targets must be (N,) class indices or (N, {self.num_classes}), got "
                f"{tuple(targets.shape)}"
            )
        return mix_targets(soft, params["lam"])
