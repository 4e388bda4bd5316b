"""A recipe is plain, typed data: which model, data, augmentation, optimizer, schedule and runtime.

Keeping it data (dataclasses, no behaviour beyond `validate`/`replace`) is what lets the CLI
print it, diff it and override any field, and the builders in ``lcv_vision.recipes._build`` be
the only place that knows how a recipe becomes Lightning objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from lcv_vision.tta import TTA_MODES

__all__ = ["AugmentConfig", "OptimConfig", "Recipe", "DATASETS"]

#: Data sets a recipe can name, each backed by a ``lcv_vision.data`` DataModule.
DATASETS: tuple[str, ...] = ("digits", "cifar10", "imagefolder")


@dataclass
class AugmentConfig:
    """Training augmentation knobs, translated into a ``lcv_vision.data`` pipeline by ``build_train_pipeline``.

    Args:
        crop_padding: random translate by up to this many pixels (pad + random crop; 0 = off).
        padding_mode: ``"reflect"`` or ``"constant"`` padding for the translate.
        flip: ``"none"``, ``"random"`` (p = 0.5 per image) or ``"alternating"`` (airbench: a random half
            in epoch 0, exactly the complement every other epoch).
        rrc_scale: RandomResizedCrop area range, e.g. ``(0.08, 1.0)``; ``None`` = no resized crop.
        cutout: side of a zeroed square (0 = off).
        color_jitter: brightness/contrast/saturation strength (0 = off).
        trivial_augment: TrivialAugmentWide (torchvision's ``ta_wide``).
        random_erase: probability of random erasing (0 = off).
        mixup_alpha: mixup Beta(alpha, alpha) (0 = off); targets become soft.
        cutmix_alpha: cutmix Beta(alpha, alpha) (0 = off); with mixup, one of the two per batch.
    """

    crop_padding: int = 0
    padding_mode: Literal["reflect", "constant"] = "reflect"
    flip: Literal["none", "random", "alternating"] = "random"
    rrc_scale: tuple[float, float] | None = None
    cutout: int = 0
    color_jitter: float = 0.0
    trivial_augment: bool = False
    random_erase: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def validate(self) -> None:
        if self.crop_padding < 0 or self.cutout < 0:
            raise ValueError(
                f"augment: crop_padding and cutout must be >= 0, got {self.crop_padding}, {self.cutout}"
            )
        if self.padding_mode not in ("reflect", "constant"):
            raise ValueError(
                f"augment.padding_mode must be 'reflect' or 'constant', got {self.padding_mode!r}"
            )
        if self.flip not in ("none", "random", "alternating"):
            raise ValueError(f"augment.flip must be 'none', 'random' or 'alternating', got {self.flip!r}")
        if self.rrc_scale is not None:
            low, high = self.rrc_scale
            if not 0.0 < low <= high <= 1.0:
                raise ValueError(
                    f"augment.rrc_scale must satisfy 0 < low <= high <= 1, got {self.rrc_scale!r}"
                )
        for name in ("color_jitter", "random_erase", "mixup_alpha", "cutmix_alpha"):
            if getattr(self, name) < 0:
                raise ValueError(f"augment.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.random_erase > 1:
            raise ValueError(f"augment.random_erase is a probability, got {self.random_erase!r}")


@dataclass
class OptimConfig:
    """Optimizer and per-step learning-rate schedule (the fields of ``ClassificationModule`` of the same
    names)."""

    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    norm_weight_decay: float | None = None
    bias_lr_scale: float = 1.0
    schedule: Literal["cosine", "triangle", "step", "constant"] = "cosine"
    warmup_fraction: float = 0.0
    warmup_start_factor: float = 0.01
    final_lr_factor: float = 0.0
    step_epochs: int = 30
    step_gamma: float = 0.1


@dataclass
class Recipe:
    """Everything needed to train one model on one data set.

    Args:
        name: registry key, e.g. ``"cifar10-airbench"``.
        description: one line shown by ``lcv recipes``.
        model: a ``lcv_vision.models.create_model`` name (ours, torchvision's or timm's).
        model_kwargs: architecture arguments, e.g. ``{"widths": [64, 256, 256]}``.
        dataset: one of :data:`DATASETS`.
        data_kwargs: extra DataModule arguments (e.g. ``{"image_size": 176}`` for ImageFolder).
        augment: training augmentation.
        optim: optimizer and schedule.
        epochs: training epochs.
        batch_size: training batch size (per device).
        precision: Lightning precision on a GPU; CPU runs always use ``"32-true"``.
        label_smoothing: cross-entropy label smoothing.
        ema_decay, ema_every_n_steps, lookahead: weight averaging (see ``ClassificationModule``).
        tta: test-time augmentation mode.
        whitening_images, whitening_bias_epochs: airbench's data-dependent first layer.
        compile: ``CompileConfig`` fields for the ``"compiled"`` strategy.
        seed: seed for ``seed_everything`` and the data pipeline.
        reference: where the hyperparameters come from.
    """

    name: str
    description: str
    model: str
    dataset: Literal["digits", "cifar10", "imagefolder"]
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 10
    batch_size: int = 256
    precision: str = "bf16-mixed"
    label_smoothing: float = 0.0
    ema_decay: float | None = None
    ema_every_n_steps: int = 1
    lookahead: bool = False
    tta: Literal["none", "flip", "flip_translate"] = "none"
    whitening_images: int = 0
    whitening_bias_epochs: int | None = None
    compile: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    reference: str = ""

    def validate(self) -> Recipe:
        """Raise a ``ValueError`` naming the first inconsistent field; return ``self`` when all is well."""
        if self.dataset not in DATASETS:
            raise ValueError(
                f"recipe {self.name!r}: dataset must be one of {list(DATASETS)}, got {self.dataset!r}"
            )
        if self.epochs < 1:
            raise ValueError(f"recipe {self.name!r}: epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"recipe {self.name!r}: batch_size must be >= 1, got {self.batch_size}")
        if self.tta not in TTA_MODES:
            raise ValueError(f"recipe {self.name!r}: tta must be one of {list(TTA_MODES)}, got {self.tta!r}")
        if self.ema_decay is not None and self.lookahead:
            raise ValueError(
                f"recipe {self.name!r}: ema_decay and lookahead both set; choose one weight average"
            )
        if self.whitening_images and not self.model.startswith("airbench"):
            raise ValueError(
                f"recipe {self.name!r}: whitening_images needs a model with a whitening layer (airbench*), "
                f"got model {self.model!r}"
            )
        self.augment.validate()
        if set(self.compile) - _compile_fields():
            unknown = sorted(set(self.compile) - _compile_fields())
            raise ValueError(
                f"recipe {self.name!r}: unknown compile settings {unknown}; known: "
                f"{sorted(_compile_fields())}"
            )
        return self

    def replace(self, **overrides: Any) -> Recipe:
        """A copy with ``overrides`` applied; ``None`` values are ignored, nested dicts update
        ``augment``/``optim``/``model_kwargs``/``data_kwargs``/``compile`` field by field."""
        changes: dict[str, Any] = {}
        known = {f.name for f in dataclasses.fields(self)}
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in known:
                raise ValueError(f"recipe {self.name!r} has no field {key!r}; fields: {sorted(known)}")
            current = getattr(self, key)
            if dataclasses.is_dataclass(current) and isinstance(value, dict):
                value = _replace_dataclass(current, value, f"{self.name}.{key}")
            elif isinstance(current, dict) and isinstance(value, dict):
                value = {**current, **{k: v for k, v in value.items() if v is not None}}
            changes[key] = value
        return dataclasses.replace(self, **changes).validate()

    def module_kwargs(self) -> dict[str, Any]:
        """``ClassificationModule`` arguments for this recipe."""
        return {
            "model": self.model,
            "model_kwargs": dict(self.model_kwargs),
            **dataclasses.asdict(self.optim),
            "label_smoothing": self.label_smoothing,
            "ema_decay": self.ema_decay,
            "ema_every_n_steps": self.ema_every_n_steps,
            "lookahead": self.lookahead,
            "tta": self.tta,
            "whitening_images": self.whitening_images,
            "whitening_bias_epochs": self.whitening_bias_epochs,
        }


def _replace_dataclass(current: Any, changes: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(current)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; fields: {sorted(known)}")
    return dataclasses.replace(current, **{k: v for k, v in changes.items() if v is not None})


def _compile_fields() -> set[str]:
    from lightning_plugin.config import CompileConfig

    return {f.name for f in dataclasses.fields(CompileConfig) if f.init}
