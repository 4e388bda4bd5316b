"""What ``lcv fit`` adds around Lightning: last.ckpt as the last state, a throughput meter that survives a
mid-epoch resume, a 1-based progress bar, and an EMA that moves on short runs (BN buffers included)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lcv_kernels.tolerances import bound, reduction_tolerance
from lcv_vision.callbacks import BestAndLastCheckpoint, LcvProgressBar, ThroughputMeter
from lcv_vision.ema import ema_warmup_decay


class _ConstantScore(pl.LightningModule):
    """Trains a tiny regression; validation always reports the same ``val/acc`` (it never improves)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", 0.5)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _fit_three_epochs(tmp_path, checkpoint) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(_ConstantScore(), _loader(), _loader())
    return trainer


def test_last_checkpoint_is_the_last_state_when_the_metric_stops_improving(tmp_path):
    checkpoint = BestAndLastCheckpoint(tmp_path / "a", monitor="val/acc", mode="max", filename="best-{epoch}")
    trainer = _fit_three_epochs(tmp_path, checkpoint)
    last = torch.load(checkpoint.last_model_path, weights_only=False)
    assert (last["epoch"], last["global_step"]) == (2, trainer.global_step) == (2, 6)
    assert checkpoint.best_model_path.endswith(
        "best-epoch=0.ckpt"
    )  # the first of equal scores stays the best
    assert checkpoint.best() == (0.5, checkpoint.best_model_path)


def test_lightning_alone_leaves_an_early_last_checkpoint(tmp_path):
    """Why BestAndLastCheckpoint exists (Lightning 2.6): last.ckpt is rewritten only with a new best."""
    checkpoint = ModelCheckpoint(tmp_path / "b", monitor="val/acc", mode="max", save_last=True)
    _fit_three_epochs(tmp_path, checkpoint)
    assert torch.load(checkpoint.last_model_path, weights_only=False)["global_step"] == 2


def test_throughput_of_an_epoch_resumed_mid_way(monkeypatch):
    """Lightning calls no ``on_train_epoch_start`` for an epoch resumed mid-way: the clock starts at its first
    batch (it used to start at 0.0, giving '0 images/s'). The clock is virtual: one second a read."""
    import itertools

    import lightning_plugin.step_meter as step_meter

    ticks = itertools.count(100.0)  # a start at 0.0 would count 100 s more
    monkeypatch.setattr(step_meter, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    meter = ThroughputMeter()
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    batch = (torch.zeros(16, 3, 2, 2), torch.zeros(16))
    for i in range(3):
        meter.on_train_batch_start(trainer, None, batch, i)
        meter.on_train_batch_end(trainer, None, None, batch, i)
    meter.on_train_epoch_end(trainer, None)
    assert meter.samples == 48 and 0 < meter.seconds < 10, meter.seconds
    assert meter.images_per_second() == pytest.approx(48 / meter.seconds)


def test_progress_bar_counts_epochs_from_one_and_hides_v_num():
    bar = LcvProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=2)
    assert bar._get_train_description(1).strip() == "Epoch 2/2"
    assert bar._get_train_description(0).strip() == "Epoch 1/2"


def test_ema_warmup_decay():
    assert ema_warmup_decay(0.99986, 0) == pytest.approx(0.1)
    assert ema_warmup_decay(0.99986, 90) == pytest.approx(0.91)
    assert ema_warmup_decay(0.9, 10**6) == 0.9


def test_recipe_ema_moves_on_a_run_shorter_than_its_update_interval():
    """imagefolder-resnet50's EMA (decay 0.99986 every 32 steps) on a 6-step run: the last step updates it
    with the warm-up decay 0.1, parameters and BN running statistics alike (it used to keep the initial
    weights)."""
    from lcv_vision.data import DigitsDataModule
    from lcv_vision.module import ClassificationModule

    torch.manual_seed(0)
    module = ClassificationModule(
        "resnet18",
        num_classes=10,
        model_kwargs={"width": 4, "stem": "cifar"},
        ema_decay=0.99986,
        ema_every_n_steps=32,
        channels_last=False,
    )
    initial = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = pl.Trainer(
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=32, image_size=8))
    final = module.model.state_dict()
    for name, average in module.ema.module.state_dict().items():
        if average.is_floating_point():
            want = 0.1 * initial[name].double() + 0.9 * final[name].double()
            # float32: a blend of two terms by a decay itself rounded to float32
            atol = bound(reduction_tolerance(torch.float32, 2 + 1), want)
            torch.testing.assert_close(average.double(), want, atol=atol, rtol=0, msg=name)
    bn = module.ema.module.bn1
    assert bn.running_mean.abs().sum() > 0  # followed the data's statistics, not the initial zeros
    assert module.evaluation_weights() == ["EMA", "final"]
    x = torch.randn(2, 3, 8, 8)
    module.eval()
    with module.evaluating_with("final"):
        torch.testing.assert_close(module(x), module.model(x))
    torch.testing.assert_close(module(x), module.ema.module(x))


def test_best_of_a_run_resumed_into_another_folder_is_kept(tmp_path):
    """A resumed lcv run writes to a new version folder; Lightning then drops the interrupted run's best
    score, and the summary lost its "best val/acc" line."""
    checkpoint = BestAndLastCheckpoint(tmp_path / "version_1", monitor="val/acc", mode="max")
    earlier = str(tmp_path / "version_0" / "best.ckpt")
    checkpoint.load_state_dict(
        {
            "dirpath": str(tmp_path / "version_0"),
            "best_model_score": torch.tensor(0.75),
            "best_model_path": earlier,
            "monitor": "val/acc",
        }
    )
    assert checkpoint.best() == (0.75, earlier)
    checkpoint.best_model_score, checkpoint.best_model_path = torch.tensor(0.5), "new.ckpt"
    assert checkpoint.best() == (0.75, earlier)
    checkpoint.best_model_score = torch.tensor(0.8)
    assert checkpoint.best() == (pytest.approx(0.8), "new.ckpt")
