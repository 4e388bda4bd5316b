"""TrainingMonitor: read the event files back, check tags and values; serve them with a real TensorBoard."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision.utils import make_grid

from lcv_kernels.tolerances import uint8_tolerance
from lightning_plugin import CompiledStrategy
from lightning_plugin.callbacks import TrainingMonitor
from lightning_plugin.flops import peak_flops

# One xdist worker runs the whole file (`make test` uses --dist loadgroup): its module fixture trains
# the two logged runs the tests read, once.
pytestmark = pytest.mark.xdist_group("test_monitor")

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
BATCH, SAMPLES, SIDE = 8, 36, 8  # 4 full batches + one of 4 (forces a recompile)
DATA_DELAY_S = 0.004  # per sample: ~32 ms of data wait per batch
STEP_SLEEP_S = 0.010
PEAK = 1e12
#: A float image through TensorBoard's PNG: normalised and denormalised (4 roundings, the std's division
#: undone by its product), then ``(x * 255).astype(uint8)`` truncates: up to one level below.
GRID_TOLERANCE = uint8_tolerance(1.0, 4 + 1)


class SlowImages(Dataset):
    """Normalised random images whose loading takes a known time."""

    def __init__(self, n: int, delay: float) -> None:
        g = torch.Generator().manual_seed(1)
        self.raw = torch.rand(n, 3, SIDE, SIDE, generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        x = (self.raw[i] - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
        return x, self.labels[i]


class ImageData(pl.LightningDataModule):
    mean, std = MEAN, STD

    def __init__(self, delay: float = DATA_DELAY_S) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set = SlowImages(SAMPLES, delay)
        self.val_set = SlowImages(16, 0.0)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=BATCH, shuffle=False)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=BATCH)


class TinyCNN(pl.LightningModule):
    def __init__(self, lr: float = 0.1, step_sleep: float = STEP_SLEEP_S) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.example_input_array = torch.zeros(2, 3, SIDE, SIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        time.sleep(self.hparams.step_sleep)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _fit(root: Path, strategy, name: str, **monitor_kwargs) -> Path:
    logger = TensorBoardLogger(str(root), name=name, version=0)
    monitor = TrainingMonitor(peak_flops=PEAK, num_images=4, **monitor_kwargs)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        strategy=strategy,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=1,
        num_sanity_val_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyCNN(), datamodule=ImageData())
    return Path(logger.log_dir)


def _events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def _values(acc: EventAccumulator, tag: str) -> list[float]:
    return [e.value for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tb")
    return {
        "root": root,
        "compiled": _fit(root, CompiledStrategy(backend="eager"), "compiled"),
        "plain": _fit(root, "auto", "plain"),
    }


def test_perf_scalars_are_plausible(runs) -> None:
    acc = _events(runs["compiled"])
    step_ms = _values(acc, "vitals/step_time_ms")
    wait = _values(acc, "vitals/data_wait_fraction")
    speed = _values(acc, "vitals/samples_per_sec")
    assert len(step_ms) == len(wait) == len(speed) == 10  # 5 batches x 2 epochs, logged every step
    # Training steps 1..10 only: the sanity check (num_sanity_val_steps=1) logs nothing.
    assert [e.step for e in acc.Scalars("vitals/step_time_ms")] == list(range(1, 11))
    assert all(ms >= 1e3 * STEP_SLEEP_S for ms in step_ms)  # the sleep inside training_step is in the step
    # Full batches sleep BATCH x DATA_DELAY_S = 32 ms in the loader, so the data wait the fraction implies
    # (wait / (1 - wait) x step time) is at least that. A ratio bound (e.g. "wait > 30%") would depend on how
    # fast the step runs, i.e. on the machine's load; a sleep only ever lasts longer under load.
    steady = [i for i in range(len(wait)) if i not in (0, 4, 5, 9)]
    implied_wait_ms = [wait[i] / (1 - wait[i]) * step_ms[i] for i in steady]
    assert min(implied_wait_ms) >= 1e3 * BATCH * DATA_DELAY_S, (implied_wait_ms, wait, step_ms)
    # Physical bound: a batch cannot be faster than its data delay + the step sleep.
    bound = BATCH / (BATCH * DATA_DELAY_S + STEP_SLEEP_S)
    assert all(0 < s <= bound for s in speed), (speed, bound)


def test_mfu_uses_independently_counted_flops(runs) -> None:
    acc = _events(runs["compiled"])
    # Analytic forward FLOPs per sample: 3x3 conv 3->4 on 8x8 (padding 1) + Linear 4->2, 2 FLOPs per MAC.
    forward = 2 * 4 * 3 * 9 * SIDE * SIDE + 2 * 4 * 2
    speed = _values(acc, "vitals/samples_per_sec")
    flops = _values(acc, "vitals/flops_per_sec")
    mfu = _values(acc, "vitals/mfu")
    assert len(speed) == len(flops) == len(mfu) == 10
    for s, f, m in zip(speed, flops, mfu, strict=True):
        assert f == pytest.approx(3 * forward * s, rel=1e-4)
        assert m == pytest.approx(f / PEAK, rel=1e-4)


def test_learning_rate_follows_the_schedule(runs) -> None:
    acc = _events(runs["compiled"])
    points = [(e.step, e.value) for e in acc.Scalars("vitals/lr")]
    # StepLR(step_size=1 epoch, gamma=0.5), halved when each epoch's last batch (steps 5, 10) ends. The rate is
    # logged where it changes: the last point of each value and the first of the next, so a step is a step.
    assert [step for step, _ in points] == [1, 4, 5, 9, 10]
    assert [lr for _, lr in points] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])


def _card(acc: EventAccumulator) -> str:
    return acc.Tensors("compile/report/text_summary")[-1].tensor_proto.string_val[0].decode()


def test_compile_card_has_counts_and_reasons(runs) -> None:
    acc = _events(runs["compiled"])
    tags = acc.Tags()
    assert not [t for t in tags["scalars"] if t.startswith("compile/")]  # the counters are in the card
    card = _card(acc)
    # validation + training graphs, and the smaller last batch's recompile, with dynamo's reason
    graphs = re.search(r"\| graphs \| (\d+) \((\d+) of them recompiles\) \|", card)
    assert graphs is not None and int(graphs[1]) >= 2 and int(graphs[2]) >= 1, card
    assert "| graph breaks | 0 |" in card
    recompiles = card.split("### Recompiles")[1].split("###")[0]
    assert "forward" in recompiles and ("size" in recompiles or "grad_mode" in recompiles), card
    assert "vitals/samples_per_sec" in tags["scalars"]


def test_plain_strategy_has_no_compile_metrics(runs) -> None:
    tags = _events(runs["plain"]).Tags()["scalars"]
    assert "vitals/samples_per_sec" in tags and "vitals/lr" in tags
    assert not [t for t in tags if t.startswith("compile/")]
    assert not [t for t in tags if "memory" in t]  # CPU run: no CUDA memory
    assert "compile/report/text_summary" not in _events(runs["plain"]).Tags()["tensors"]


def test_image_grid_is_denormalised(runs) -> None:
    acc = _events(runs["compiled"])
    images = acc.Images("vitals/train_batch")
    assert len(images) == 2  # one per epoch
    grid = torch.from_numpy(__import__("numpy").array(Image.open(io.BytesIO(images[0].encoded_image_string))))
    grid = grid.permute(2, 0, 1).float()[:3] / 255.0
    expected = make_grid(SlowImages(SAMPLES, 0.0).raw[:4], nrow=2, padding=1)
    assert grid.shape == expected.shape
    torch.testing.assert_close(grid, expected, atol=GRID_TOLERANCE, rtol=0)


def test_hparams_tab_has_params_and_run_metrics(runs) -> None:
    acc = _events(runs["compiled"])
    content = acc.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = session.session_start_info.hparams
    assert hparams["lr"].number_value == pytest.approx(0.1)
    assert hparams["compile/backend"].string_value == "eager"
    assert hparams["data/delay"].number_value == pytest.approx(DATA_DELAY_S)
    assert hparams["trainer/batch_size"].number_value == BATCH  # not the smaller last batch (4)
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    metric_tags = {m.name.tag for m in experiment.experiment.metric_infos}
    assert {"val_loss", "train_loss", "whole_run/compile_s", "whole_run/samples_per_sec"} <= metric_tags
    assert acc.Scalars("whole_run/compile_s")[-1].value > 0


def test_peak_flops_knows_the_h200(monkeypatch) -> None:
    """Lightning's table misses "NVIDIA H200"; ours must not (dense bf16 = 989.5 TFLOP/s, NVL 835.5)."""
    from lightning.fabric.utilities.throughput import get_available_flops

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    assert get_available_flops(cuda, torch.bfloat16) is None  # the gap we fill
    assert peak_flops(cuda, torch.bfloat16) == pytest.approx(989.5e12)
    assert peak_flops(cuda, torch.bfloat16, device_name="NVIDIA H200 NVL") == pytest.approx(835.5e12)
    assert peak_flops(cuda, torch.bfloat16, device_name="NVIDIA H100 80GB HBM3") == pytest.approx(989.5e12)
    assert peak_flops(torch.device("cpu"), torch.float32) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_tensorboard_server_lists_runs_and_scalars(runs, tmp_path) -> None:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(runs["root"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load_fast",
        "false",
        "--reload_interval",
        "1",
    ]
    log = open(tmp_path / "tensorboard.log", "wb")  # noqa: SIM115  (closed in finally)
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, tags, run_names = time.monotonic() + 90, {}, []
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()[-2000:]
            try:
                run_names = _get_json(f"{base}/data/runs")
                tags = _get_json(f"{base}/data/plugin/scalars/tags")
                if {"compiled/version_0", "plain/version_0"} <= set(tags):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert {"compiled/version_0", "plain/version_0"} <= set(run_names), run_names
        assert "vitals/samples_per_sec" in tags["compiled/version_0"]
        assert "whole_run/compile_s" in tags["compiled/version_0"]
        series = _get_json(
            f"{base}/data/plugin/scalars/scalars?run=compiled/version_0&tag=vitals/step_time_ms"
        )
        assert len(series) == 10 and all(point[2] > 0 for point in series)  # [wall_time, step, value]
        local = [e.value for e in _events(runs["compiled"]).Scalars("vitals/step_time_ms")]
        assert [point[2] for point in series] == pytest.approx(local)  # the server serves our event file
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert server.returncode is not None  # the server is gone: nothing left listening on the port


def test_compile_metrics_from_the_torch_compile_callback(tmp_path) -> None:
    """Plain strategy + the TorchCompile callback: the monitor finds the callback's compile_stats."""
    from lightning_plugin.callbacks import TorchCompile

    logger = TensorBoardLogger(str(tmp_path), name="cb", version=0)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[TorchCompile(backend="eager"), TrainingMonitor(log_images=False)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyCNN(step_sleep=0.0), datamodule=ImageData(delay=0.0))
    acc = _events(Path(logger.log_dir))
    assert re.search(r"\| graphs \| [1-9]", _card(acc))
    assert not acc.Tags()["images"]  # log_images=False


# ----------------------------------------------------------------------------- exact metrics, mocked clock


class _RecordingLogger:
    """Stands in for a Lightning logger: keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))


def _fake_trainer(is_global_zero: bool = True, device: str = "cuda") -> SimpleNamespace:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    return SimpleNamespace(
        is_global_zero=is_global_zero,
        loggers=[_RecordingLogger()],
        log_every_n_steps=50,
        global_step=0,
        optimizers=[optimizer],
        strategy=SimpleNamespace(
            root_device=torch.device(device, 0) if device == "cuda" else torch.device(device)
        ),
        callbacks=[],
        precision_plugin=None,
        datamodule=None,
        sanity_checking=False,
        callback_metrics={},
    )


class _FakeCudaEvent:
    """A CUDA timing event on a fake clock: records the time when recorded, says when the host waited."""

    def __init__(self, clock, events: list[str], enable_timing: bool = False) -> None:
        assert enable_timing
        self.clock, self.events, self.time = clock, events, None

    def record(self, stream=None) -> None:
        self.events.append("record")
        self.time = self.clock()

    def synchronize(self) -> None:
        self.events.append("sync")

    def elapsed_time(self, end: _FakeCudaEvent) -> float:
        return 1e3 * (end.time - self.time)


@pytest.mark.parametrize("rank_zero", [True, False])
def test_exact_metrics_with_cuda_events_and_no_sync_per_step(monkeypatch, rank_zero: bool) -> None:
    """On CUDA the steps are timed with events; the host waits for them only when a window is logged, and the
    window averages are exact."""
    events: list[str] = []
    ticks = iter([0.0, 1.0, 1.5, 1.75, 2.5, 2.6, 9.0])
    clock = lambda: next(ticks)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _FakeCudaEvent(clock, events, **kw))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1 << 31)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset"))

    flops_per_sample, peak = 5e9, 1e11
    monitor = TrainingMonitor(
        log_every_n_steps=2, flops_per_sample=flops_per_sample, peak_flops=peak, log_images=False
    )
    trainer, module = _fake_trainer(is_global_zero=rank_zero), nn.Linear(1, 1)
    batch = (torch.zeros(4, 3, 2, 2), torch.zeros(4))
    monitor.setup(trainer, module, "fit")
    monitor.on_fit_start(trainer, module)
    monitor.on_train_epoch_start(trainer, module)  # 0.0: the epoch's first fetch starts
    for step in (1, 2):  # start/end at 1.0/1.5, then 1.75/2.5; 2.6 after the window is logged
        monitor.on_train_batch_start(trainer, module, batch, step - 1)
        trainer.global_step = step
        if step == 2 and rank_zero:
            assert events == ["record"] * 4  # no host sync in a step
        monitor.on_train_batch_end(trainer, module, None, batch, step - 1)
    calls = trainer.loggers[0].calls
    if not rank_zero:
        assert calls == [] and events == []  # other ranks neither log nor record
        return
    # the fifth event ends the window; the host waits only now, then the peak is reset, then a new mark
    assert (
        events[:5] == ["record"] * 5 and set(events[5:-2]) == {"sync"} and events[-2:] == ["reset", "record"]
    )
    assert len(calls) == 1 and calls[0][0] == 2
    metrics = calls[0][1]
    step_s, wait_s = 0.5 + 0.75, 1.0 + 0.25
    assert metrics["vitals/step_time_ms"] == pytest.approx(1e3 * step_s / 2)
    assert metrics["vitals/data_wait_fraction"] == pytest.approx(wait_s / (step_s + wait_s))
    assert metrics["vitals/samples_per_sec"] == pytest.approx(8 / (step_s + wait_s))
    assert metrics["vitals/flops_per_sec"] == pytest.approx(flops_per_sample * 8 / (step_s + wait_s))
    assert metrics["vitals/mfu"] == pytest.approx(flops_per_sample * 8 / (step_s + wait_s) / peak)
    assert metrics["vitals/peak_memory_gib"] == 2.0 and "vitals/allocated_memory_gib" not in metrics
    assert metrics["vitals/lr"] == pytest.approx(0.01)
    assert monitor.steps.fit_totals.samples == 8


def test_uint8_batches_are_shown_as_they_are(tmp_path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="u8", version=0)
    trainer = _fake_trainer(device="cpu")
    trainer.loggers = [logger]
    images = torch.randint(
        0, 256, (4, 3, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    monitor = TrainingMonitor(num_images=4)
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_train_batch_start(trainer, None, (images, torch.zeros(4)), 0)
    logger.experiment.flush()
    grid = _decode(_events(Path(logger.log_dir)).Images("vitals/train_batch")[0])
    # exact: level k / 255 * 255 rounds back to k in IEEE float32 (correctly rounded on any CPU), so
    # TensorBoard's truncation keeps every level, and _decode divides by 255 the same way
    assert torch.equal(grid, make_grid(images.float() / 255, nrow=2, padding=1))


def _decode(image_event) -> torch.Tensor:
    import numpy as np

    array = np.array(Image.open(io.BytesIO(image_event.encoded_image_string)))
    return torch.from_numpy(array).permute(2, 0, 1).float()[:3] / 255.0


# ----------------------------------------------------------------------------- real runs: edge cases


def _quick_fit(
    tmp_path: Path, module: pl.LightningModule, strategy="auto", datamodule=None, **monitor_kwargs
):
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="cpu",
        strategy=strategy,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[TrainingMonitor(**monitor_kwargs)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=datamodule or ImageData(delay=0.0))
    return _events(Path(logger.log_dir))


class WithGraphBreak(TinyCNN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x)).mean(dim=(2, 3))
        torch._dynamo.graph_break()
        return self.head(features)


def test_graph_breaks_and_their_reasons_are_logged(tmp_path) -> None:
    acc = _quick_fit(
        tmp_path, WithGraphBreak(step_sleep=0.0), CompiledStrategy(backend="eager"), log_images=False
    )
    card = _card(acc)
    assert re.search(r"\| graph breaks \| [1-9]", card), card
    assert re.search(r"\| graphs \| ([2-9]|\d\d)", card), card  # the break splits forward in two
    breaks = card.split("### Graph breaks\n\n")[1]
    assert breaks.startswith("- ") and "torch._dynamo.graph_break()" in breaks.split("###")[0], card


class BadExample(TinyCNN):
    def __init__(self) -> None:
        super().__init__(step_sleep=0.0)
        self.example_input_array = torch.zeros(2, 5, SIDE, SIDE)  # 5 channels: the conv wants 3


def test_flop_measurement_failure_warns_and_training_goes_on(tmp_path) -> None:
    with pytest.warns(
        UserWarning, match=r"could not count FLOPs on BadExample.example_input_array \(RuntimeError"
    ):
        acc = _quick_fit(tmp_path, BadExample(), log_images=False)
    tags = acc.Tags()["scalars"]
    assert (
        "vitals/samples_per_sec" in tags and "vitals/mfu" not in tags and "vitals/flops_per_sec" not in tags
    )


class DigitsCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_grid_is_denormalised_with_the_loader_pipeline(tmp_path) -> None:
    """The grid undoes the DeviceLoader pipeline's Normalize, not the datamodule's default mean/std."""
    from lcv_vision.data import DigitsDataModule, Normalize, Pipeline, RandomTranslate

    mean, std = (0.2, 0.3, 0.4), (0.5, 0.6, 0.7)

    def datamodule() -> DigitsDataModule:
        pipeline = Pipeline([RandomTranslate(1), Normalize(mean, std)])
        return DigitsDataModule(batch_size=16, image_size=8, train_pipeline=pipeline)

    assert datamodule().mean != mean  # the datamodule's class attribute would give a different picture
    acc = _quick_fit(tmp_path, DigitsCNN(), datamodule=datamodule(), num_images=4, measure_flops=False)
    reference = datamodule()
    loader = reference.train_dataloader()
    loader.set_epoch(0)
    first = next(iter(loader))[0][:4]
    expected = first * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    grid = _decode(acc.Images("vitals/train_batch")[0])
    torch.testing.assert_close(
        grid, make_grid(expected.clamp(0, 1), nrow=2, padding=1), atol=GRID_TOLERANCE, rtol=0
    )
