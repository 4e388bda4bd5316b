"""`ImageGrid`: the first training batch of each epoch as an image grid, as the model sees it but with the
normalisation undone, so a wrong augmentation is seen rather than guessed from the loss.

Where the normalisation comes from is declared, not guessed: a train loader that implements
:class:`NormalizedBatches` (``lcv_vision.data.DeviceLoader`` does) says what its batches were normalised with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.callbacks._options import check_normalization, check_options
from lightning_plugin.callbacks._trainer_lookup import first_tensor, flush_tensorboard, tensorboard_writer
from lightning_plugin.step_meter import StepMeter
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = ["ImageGrid", "NormalizedBatches"]

#: Datamodule attribute pairs searched (in order) when the loader does not say.
_NORMALIZATION_ATTRS: tuple[tuple[str, str], ...] = (("mean", "std"), ("normalize_mean", "normalize_std"))


@runtime_checkable
class NormalizedBatches(Protocol):
    """A train loader whose image batches are normalised, and which says with what."""

    def batch_normalization(self) -> tuple[Sequence[float], Sequence[float]] | None:
        """Per-channel ``(mean, std)`` in 0..1 pixel units that ``x = (pixel - mean) / std`` used; None when
        the batches are not normalised."""
        ...


class ImageGrid(Callback):
    """Logs ``vitals/train_batch`` at the first training batch of each epoch (global rank zero only).

    Args:
        num_images: how many images the grid shows.
        mean, std: per-channel normalisation to undo; ``None`` asks the train loader
            (:class:`NormalizedBatches`), then ``trainer.datamodule.mean``/``std`` (or
            ``normalize_mean``/``normalize_std``), and failing both rescales each image to [0, 1]. uint8
            images are shown as they are.
        meter: a :class:`StepMeter` not to charge with the time spent writing the grid
            (``StepMonitor.meter``).
    """

    def __init__(
        self,
        num_images: int = 16,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        meter: StepMeter | None = None,
    ) -> None:
        super().__init__()
        check_options(type(self).__name__, num_images=num_images)
        normalization = check_normalization(type(self).__name__, mean, std)
        self.num_images = num_images
        self.mean: list[float] | None
        self.std: list[float] | None
        self.mean, self.std = normalization if normalization is not None else (None, None)
        self.meter = meter
        self._pending = False

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = trainer.is_global_zero

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._pending:
            return
        self._pending = False
        self._log(trainer, batch)
        if self.meter is not None:
            self.meter.discard()  # writing the grid is neither data wait nor step time

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            flush_tensorboard(trainer)

    def _log(self, trainer: pl.Trainer, batch: Any) -> None:
        writer = tensorboard_writer(trainer)
        images = first_tensor(batch)
        if writer is None or images is None or images.dim() != 4 or images.shape[1] not in (1, 3):
            return
        images = images[: self.num_images].detach().cpu()
        if images.dtype == torch.uint8:
            shown = images.float() / 255.0  # not normalised yet: the pixels as they are
        elif images.is_floating_point():
            shown = _denormalize(images.float(), *self._normalization(trainer))
        else:
            return
        from torchvision.utils import make_grid

        grid = make_grid(shown.clamp(0.0, 1.0), nrow=max(1, math.ceil(math.sqrt(shown.shape[0]))), padding=1)
        writer.add_image("vitals/train_batch", grid, trainer.global_step)

    def _normalization(self, trainer: pl.Trainer) -> tuple[list[float] | None, list[float] | None]:
        if self.mean is not None:
            return self.mean, self.std
        declared = _loader_normalization(trainer)
        return declared if declared[0] is not None else _datamodule_normalization(trainer)


def _loader_normalization(trainer: pl.Trainer) -> tuple[list[float] | None, list[float] | None]:
    try:
        loader = trainer.train_dataloader
    except Exception:  # no fit loop / loader yet
        return None, None
    if not isinstance(loader, NormalizedBatches):
        return None, None
    declared = loader.batch_normalization()
    if declared is None:
        return None, None
    mean, std = declared
    return [float(m) for m in mean], [float(s) for s in std]


def _datamodule_normalization(trainer: pl.Trainer) -> tuple[list[float] | None, list[float] | None]:
    datamodule = runtime_attributes(trainer).datamodule
    for mean_attr, std_attr in _NORMALIZATION_ATTRS:
        mean, std = getattr(datamodule, mean_attr, None), getattr(datamodule, std_attr, None)
        if mean is not None and std is not None:
            return [float(m) for m in mean], [float(s) for s in std]
    return None, None


def _denormalize(images: torch.Tensor, mean: list[float] | None, std: list[float] | None) -> torch.Tensor:
    """``x * std + mean`` (in [0, 1] units); without a usable mean/std, each image rescaled to [0, 1]."""
    if mean is None or std is None or len(mean) not in (1, images.shape[1]) or len(std) != len(mean):
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        high = images.amax(dim=(1, 2, 3), keepdim=True)
        return (images - low) / (high - low).clamp_min(1e-12)
    images = images * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
    return images / 255.0 if max(mean) > 1.5 else images  # a mean above 1.5 is in 0-255 units
