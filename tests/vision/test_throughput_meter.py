"""``lcv``'s ThroughputMeter runs on the same StepMeter as TrainingMonitor's vitals/samples_per_sec; and the
``first_images`` helper the whitening init and ``sample_train_images`` share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lightning_plugin.step_meter as step_meter
from lcv_vision.callbacks import ThroughputMeter
from lcv_vision.data.loader import first_images


def test_epochs_with_a_mocked_clock(monkeypatch):
    """Epoch time = data wait + steps; a mid-epoch validation is not counted (it used to be); the first epoch
    can be left out."""
    ticks = iter([0.0, 1.0, 2.0, 10.0, 10.5, 11.0, 20.0, 21.0, 21.5])
    monkeypatch.setattr(step_meter, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    meter = ThroughputMeter()
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    trainer = SimpleNamespace(strategy=strategy, sanity_checking=False)
    batch = (torch.zeros(4, 3, 2, 2), torch.zeros(4))
    meter.on_fit_start(trainer, None)
    # epoch 0: start 0, batch 1..2, validation 2..10, batch 10.5..11
    meter.on_train_epoch_start(trainer, None)
    meter.on_train_batch_start(trainer, None, batch, 0)
    meter.on_train_batch_end(trainer, None, None, batch, 0)
    meter.on_validation_end(trainer, None)
    meter.on_train_batch_start(trainer, None, batch, 1)
    meter.on_train_batch_end(trainer, None, None, batch, 1)
    meter.on_train_epoch_end(trainer, None)
    # epoch 1: start 20, batch 21..21.5
    meter.on_train_epoch_start(trainer, None)
    meter.on_train_batch_start(trainer, None, batch, 0)
    meter.on_train_batch_end(trainer, None, None, batch, 0)
    meter.on_train_epoch_end(trainer, None)
    assert [e.busy_s for e in meter.epochs] == [1.0 + 1.0 + 0.5 + 0.5, 1.0 + 0.5]
    assert meter.samples == 12 and meter.seconds == pytest.approx(4.5)
    assert meter.images_per_second() == pytest.approx(12 / 4.5)
    assert meter.images_per_second(skip_first_epoch=True) == pytest.approx(4 / 1.5)


def test_no_epochs_no_rate():
    assert ThroughputMeter().images_per_second() is None


def test_first_images_reads_only_the_batches_it_needs():
    read = []

    def batches():
        for i in range(4):
            read.append(i)
            yield torch.full((3, 1, 2, 2), float(i)), torch.zeros(3)

    images = first_images(batches(), 5)
    assert images.shape == (5, 1, 2, 2) and read == [0, 1]
    assert images[:, 0, 0, 0].tolist() == [0, 0, 0, 1, 1]
    assert first_images(batches(), 100).shape[0] == 12  # fewer when the batches run out
    assert first_images(iter([]), 3) is None
