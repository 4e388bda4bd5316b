"""``StepMeter`` (framework-free step time / data wait accounting) and the declared loader interface of the
monitor's image grid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_plugin.callbacks.image_grid import NormalizedBatches
from lightning_plugin.step_meter import StepMeter, StepTotals

ROOT = Path(__file__).resolve().parents[2]


def _meter(ticks: list[float]) -> StepMeter:
    it = iter(ticks)
    return StepMeter(clock=lambda: next(it))


def test_steps_and_waits_add_up_exactly():
    meter = _meter([0.0, 1.0, 1.5, 1.75, 2.5])
    meter.discard()  # epoch start at 0
    meter.step_started()  # waited 1.0
    meter.step_ended(4)  # stepped 0.5
    meter.step_started()  # waited 0.25
    meter.step_ended(3)  # stepped 0.75
    span = meter.take()
    assert span == StepTotals(steps=2, samples=7, step_s=1.25, wait_s=1.25)
    assert span.samples_per_sec == pytest.approx(7 / 2.5)
    assert span.data_wait_fraction == pytest.approx(0.5)
    assert span.mean_step_s == pytest.approx(0.625)
    assert meter.take() == StepTotals()  # take starts a new span


def test_discarded_time_is_neither_step_nor_wait():
    meter = _meter([0.0, 1.0, 5.0, 6.0, 10.0, 10.5])
    meter.discard()
    meter.step_started()  # wait 1.0
    meter.discard()  # 4 s of someone else's writing inside the step: dropped
    meter.step_ended(1)  # step 1.0
    meter.discard()  # 4 s of validation after the step: dropped
    meter.step_started()  # wait 0.5
    assert meter.span == StepTotals(steps=1, samples=1, step_s=1.0, wait_s=1.5)


def test_a_run_resumed_mid_epoch_counts_no_wait_before_its_first_step():
    meter = _meter([100.0, 100.5])
    meter.step_started()
    meter.step_ended(2)
    assert meter.take() == StepTotals(steps=1, samples=2, step_s=0.5, wait_s=0.0)


def test_every_reading_follows_a_synchronisation():
    events: list[str] = []
    clock = iter(range(10))
    meter = StepMeter(
        clock=lambda: (events.append("clock"), next(clock))[1], synchronize=lambda: events.append("sync")
    )
    meter.discard()
    meter.step_started()
    meter.step_ended(1)
    assert events == ["sync", "clock"] * 3


def test_empty_totals_have_no_rates():
    assert StepTotals().samples_per_sec is None and StepTotals().data_wait_fraction is None
    assert StepTotals().mean_step_s is None


def test_the_meter_module_imports_no_framework():
    from import_layers import imports

    meter_imports = [i for i in imports(ROOT) if i.importer == "lightning_plugin.step_meter"]
    imported = {i.imported.split(".")[0] for i in meter_imports}
    frameworks = {"lightning", "pytorch_lightning", "lightning_plugin", "lcv_vision"}
    assert imported and not imported & frameworks, imported


def test_the_device_loader_declares_its_normalization():
    """The image grid asks a declared interface, not ``pipeline.ops``: DeviceLoader implements it."""
    from lcv_vision.data import DeviceLoader, Normalize, Pipeline, RandomTranslate

    images, targets = torch.zeros(4, 3, 6, 6, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)
    normalized = Pipeline([Normalize((0.1, 0.2, 0.3), (0.4, 0.5, 0.6)), RandomTranslate(1)], compile=False)
    loader = DeviceLoader(images, targets, 2, normalized)
    assert isinstance(loader, NormalizedBatches)
    assert loader.batch_normalization() == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    plain = DeviceLoader(images, targets, 2, Pipeline([RandomTranslate(1)], compile=False))
    assert plain.batch_normalization() is None


def test_a_loader_that_declares_nothing_is_not_searched():
    """Before the split the grid searched ``loader.pipeline.ops`` for any op with ``mean``/``std``."""
    from types import SimpleNamespace

    from lightning_plugin.callbacks.image_grid import _loader_normalization

    op = SimpleNamespace(mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6))
    trainer = SimpleNamespace(train_dataloader=SimpleNamespace(pipeline=SimpleNamespace(ops=[op])))
    assert _loader_normalization(trainer) == (None, None)


class _Event:
    """A fake CUDA timing event: the time it was recorded at, and whether the host waited for it."""

    def __init__(self, clock, log: list[str]) -> None:
        self.clock, self.log, self.time = clock, log, None

    def record(self, stream=None) -> None:
        self.time = self.clock()

    def synchronize(self) -> None:
        self.log.append("wait")

    def elapsed_time(self, end: _Event) -> float:
        return 1e3 * (end.time - self.time)  # milliseconds, as CUDA's


def test_cuda_events_are_read_only_when_the_span_is(monkeypatch):
    from lightning_plugin.step_meter import CudaEventClock

    ticks, log = iter([0.0, 1.0, 1.5, 1.75, 2.5]), []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    timeline = CudaEventClock(torch.device("cuda", 0), event_factory=lambda: _Event(lambda: next(ticks), log))
    meter = StepMeter(timeline=timeline)
    meter.discard()
    meter.step_started()
    meter.step_ended(4)
    meter.step_started()
    meter.step_ended(3)
    assert meter.steps == 2 and log == []  # counting steps reads no time: no host wait in a step
    assert meter.take() == StepTotals(steps=2, samples=7, step_s=1.25, wait_s=1.25)
    assert log and set(log) == {"wait"}
    assert meter.take() == StepTotals()
