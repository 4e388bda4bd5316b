"""Interrupted runs (exception mid-step, SIGTERM) resume to the same final weights as an uninterrupted run.

Tolerance: none where both runs are eager, bit-identical weights on every state_dict entry: the resumed
run computes the same steps through the same code on the same data from the restored state (a round trip
of exact values), so nothing can reorder a sum. A resumed run under the compiled strategy (its traced
graph sums in another order than eager) is held to ``trajectory_tolerance`` of the 12 steps. The loader
position is part of the checkpoint, so a wrong position (a skipped or repeated batch) shows up as different
weights.

Run as a script (``python test_resume.py ROOT``) it is the SIGTERM test's child process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, OnExceptionCheckpoint
from torch import nn

import lightning_plugin  # noqa: F401  (registers "compiled" for the child process)
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from lightning_plugin.callbacks import FaultTolerantCheckpoint

# One xdist worker runs the whole file (`make test` uses --dist loadgroup): its module fixtures train
# the uninterrupted runs every resume is compared with, once.
pytestmark = pytest.mark.xdist_group("test_resume")

SAMPLES, BATCH, EPOCHS = 48, 8, 2  # 6 steps per epoch, 12 in all
REPO_ROOT = Path(__file__).resolve().parents[2]


class ResumableBatches:
    """A sized, resumable loader: a seeded permutation per epoch, position saved in ``state_dict``."""

    def __init__(self, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
        self.seed, self.epoch, self.position = seed, 0, 0

    def __len__(self) -> int:
        return SAMPLES // BATCH

    def __iter__(self):
        if self.position >= len(self):  # the previous epoch was used up: start the next one
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < len(self):
            index = order[self.position * BATCH : (self.position + 1) * BATCH]
            self.position += 1  # counted when handed out, so state_dict() after a step includes it
            yield self.x[index], self.y[index]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class Regressor(pl.LightningModule):
    """MLP with BatchNorm (buffers), SGD momentum (optimizer state) and a per-step LR schedule."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.fail_at_step = fail_at_step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError(f"injected failure at global step {self.global_step}")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_trainer(
    root: Path, callbacks: list[Callback], strategy: Any = "auto", **overrides: Any
) -> pl.Trainer:
    kwargs: dict[str, Any] = dict(
        default_root_dir=str(root),
        accelerator="cpu",
        strategy=strategy,
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**kwargs, **overrides})


def fresh_model(seed: int = 0, **kw: Any) -> Regressor:
    torch.manual_seed(seed)
    return Regressor(**kw)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: tuple[float, float] = (0.0, 0.0)
) -> None:
    assert got.keys() == want.keys()
    for name in want:
        atol = bound(tol, want[name])
        torch.testing.assert_close(
            got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    model = fresh_model()
    make_trainer(tmp_path_factory.mktemp("full"), []).fit(model, ResumableBatches())
    return _state(model)


def _resume(ckpt: str, root: Path, strategy: Any = "auto", lost_batches: int = 0) -> dict[str, torch.Tensor]:
    model = fresh_model(seed=123)  # different init: the checkpoint must supply everything
    trainer = make_trainer(root, [], strategy)
    trainer.fit(model, ResumableBatches(), ckpt_path=ckpt)
    assert trainer.global_step == EPOCHS * SAMPLES // BATCH - lost_batches
    return _state(model)


@pytest.mark.parametrize("strategy", ["auto", "compiled"])
@pytest.mark.parametrize("fail_at", [3, 7])  # mid epoch 0, mid epoch 1
def test_exception_mid_step_resumes_to_same_weights(tmp_path, uninterrupted, strategy, fail_at) -> None:
    if strategy == "compiled":
        strategy = lightning_plugin.CompiledStrategy(backend="eager")
    saver = FaultTolerantCheckpoint(tmp_path)
    with pytest.raises(RuntimeError, match=f"injected failure at global step {fail_at}"):
        make_trainer(tmp_path, [saver], strategy).fit(fresh_model(fail_at_step=fail_at), ResumableBatches())
    ckpt = torch.load(saver.ckpt_path, weights_only=False)
    assert ckpt["global_step"] == fail_at
    steps_per_epoch = SAMPLES // BATCH
    # The loader position is that of the last finished step, so the failed batch is replayed.
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": fail_at // steps_per_epoch, "position": fail_at % steps_per_epoch}
    ]
    tol = (0.0, 0.0)  # eager on both sides: the same code
    if isinstance(strategy, str):
        strategy = "auto"
    else:
        strategy = lightning_plugin.CompiledStrategy(backend="eager")
        network = fresh_model().net
        tol = trajectory_tolerance(
            torch.float32, network_length(network, (BATCH, 6)), EPOCHS * SAMPLES // BATCH
        )
    _assert_same_weights(_resume(saver.ckpt_path, tmp_path, strategy), uninterrupted, tol)


def test_plain_on_exception_checkpoint_skips_the_failed_batch(tmp_path, uninterrupted) -> None:
    """Why FaultTolerantCheckpoint exists: Lightning's callback saves the loader one batch ahead."""
    saver = OnExceptionCheckpoint(tmp_path)
    with pytest.raises(RuntimeError):
        make_trainer(tmp_path, [saver]).fit(fresh_model(fail_at_step=3), ResumableBatches())
    ckpt = torch.load(saver.ckpt_path, weights_only=False)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 4}]
    resumed = _resume(saver.ckpt_path, tmp_path, lost_batches=1)  # the batch of step 3 is never trained on
    assert not torch.allclose(resumed["net.0.weight"], uninterrupted["net.0.weight"], atol=1e-6)


def test_clean_finish_removes_the_interrupt_checkpoint(tmp_path) -> None:
    saver = FaultTolerantCheckpoint(tmp_path)
    make_trainer(tmp_path, [saver]).fit(fresh_model(), ResumableBatches())
    assert not os.path.exists(saver.ckpt_path)


def test_rerun_without_ckpt_path_resumes_from_the_interrupt_checkpoint(tmp_path, uninterrupted) -> None:
    """Lightning resumes from an OnExceptionCheckpoint's file when ``fit`` gets no ``ckpt_path``: rerunning
    the same command after a crash continues where it stopped; the file goes after the clean finish."""
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [FaultTolerantCheckpoint(tmp_path)]).fit(
            fresh_model(fail_at_step=7), ResumableBatches()
        )
    saver = FaultTolerantCheckpoint(tmp_path)
    assert os.path.exists(saver.ckpt_path)
    model = fresh_model(seed=123)  # a fresh start from this init would end with other weights
    make_trainer(tmp_path, [saver]).fit(model, ResumableBatches())
    _assert_same_weights(_state(model), uninterrupted)
    assert not os.path.exists(saver.ckpt_path)


def test_default_dirpath_is_the_runs_checkpoint_folder(tmp_path, uninterrupted) -> None:
    """``FaultTolerantCheckpoint()`` (as ``lcv fit`` adds it) writes next to ModelCheckpoint's files."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    saver = FaultTolerantCheckpoint()
    assert saver.ckpt_path is None  # nothing to auto-resume from before the run's folder is known
    trainer = make_trainer(
        tmp_path, [saver, ModelCheckpoint()], logger=TensorBoardLogger(str(tmp_path), name="run")
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(fresh_model(fail_at_step=7), ResumableBatches())
    expected = tmp_path / "run" / "version_0" / "checkpoints" / "interrupted.ckpt"
    assert saver.ckpt_path == str(expected) and expected.exists()
    assert trainer.checkpoint_callback.dirpath == str(expected.parent)
    _assert_same_weights(_resume(str(expected), tmp_path / "resume"), uninterrupted)


class _FailsBeforeTraining(Regressor):
    def configure_optimizers(self):
        raise ValueError("bad option before the first step")


def test_failure_before_the_first_step_saves_nothing(tmp_path) -> None:
    """A checkpoint of untrained weights with "resume from ..." advice would bury the real error."""
    saver = FaultTolerantCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="bad option before the first step"):
        make_trainer(tmp_path, [saver]).fit(_FailsBeforeTraining(), ResumableBatches())
    assert not os.path.exists(saver.ckpt_path)
    unresolved = FaultTolerantCheckpoint()  # dirpath still unknown when the error comes (lcv's data errors)
    with pytest.raises(ValueError, match="bad option before the first step"):
        make_trainer(tmp_path, [unresolved]).fit(_FailsBeforeTraining(), ResumableBatches())
    assert not list(tmp_path.rglob("*.ckpt"))


def test_clean_finish_in_another_folder_removes_the_checkpoint_it_resumed_from(
    tmp_path, uninterrupted
) -> None:
    """lcv gives a resumed run a new version folder: the interrupted checkpoint of the first folder must go
    when the run it holds has finished."""
    first, second = tmp_path / "version_0", tmp_path / "version_1"
    saver = FaultTolerantCheckpoint(first)
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(first, [saver]).fit(fresh_model(fail_at_step=7), ResumableBatches())
    assert os.path.exists(saver.ckpt_path)
    model = fresh_model(seed=123)
    make_trainer(second, [FaultTolerantCheckpoint(second)]).fit(
        model, ResumableBatches(), ckpt_path=saver.ckpt_path
    )
    _assert_same_weights(_state(model), uninterrupted)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_resumed_checkpoint_that_is_not_an_interrupt_checkpoint_stays(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    keeper = ModelCheckpoint(tmp_path / "kept", save_last=True)
    make_trainer(tmp_path, [keeper, FaultTolerantCheckpoint(tmp_path)], max_epochs=1).fit(
        fresh_model(), ResumableBatches()
    )
    last = keeper.last_model_path
    make_trainer(tmp_path / "more", [FaultTolerantCheckpoint(tmp_path / "more")]).fit(
        fresh_model(), ResumableBatches(), ckpt_path=last
    )
    assert os.path.exists(last)


def test_warns_when_the_loader_cannot_resume_mid_epoch(tmp_path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(16, 6), torch.randn(16, 1)), batch_size=8)
    trainer = make_trainer(tmp_path, [FaultTolerantCheckpoint(tmp_path)])
    with pytest.warns(UserWarning, match=r"the train loader \(DataLoader\) has no state_dict\(\)"):
        trainer.fit(fresh_model(), loader)


class DigitsNet(pl.LightningModule):
    """Conv + BatchNorm classifier for the project's DigitsDataModule (8x8 images, 10 classes), SGD with
    momentum, a per-step LR schedule: buffers, optimizer and scheduler state all go through the checkpoint."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 8 * 8, 10),
        )
        self.fail_at_step = fail_at_step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError(f"injected failure at global step {self.global_step}")
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def digits_fit(
    model: pl.LightningModule, callbacks: list[Callback] = (), ckpt_path: str | None = None
) -> pl.Trainer:
    """2 epochs of the real DigitsDataModule (augmented DeviceLoader, resumable state), 'compiled'."""
    from lcv_vision.data import DigitsDataModule

    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=lightning_plugin.CompiledStrategy(backend="eager"),
        max_epochs=2,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=128, image_size=8), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def digits_uninterrupted() -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = DigitsNet()
    steps = digits_fit(model).global_step
    return steps, _state(model)


def test_real_datamodule_resumes_mid_epoch(tmp_path, digits_uninterrupted) -> None:
    """The project's DigitsDataModule (augmented DeviceLoader, resumable state) through the same fault."""
    steps, full = digits_uninterrupted
    assert steps == 20  # 1257 training images / 128 = 10 batches per epoch
    torch.manual_seed(0)
    saver = FaultTolerantCheckpoint(tmp_path)
    with pytest.raises(RuntimeError, match="injected failure at global step 13"):
        digits_fit(DigitsNet(fail_at_step=13), [saver])
    loader_state = torch.load(saver.ckpt_path, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert [(s["epoch"], s["position"]) for s in loader_state["combined_loader"]] == [(1, 3)]
    torch.manual_seed(123)
    resumed = DigitsNet()
    assert digits_fit(resumed, ckpt_path=saver.ckpt_path).global_step == steps
    _assert_same_weights(_state(resumed), full)


class _SlowStepsReportingProgress(Callback):
    """Child side: make each step slow, inside the step (between forward and backward), so the
    SIGTERM lands mid-step; report the progress to the parent."""

    def __init__(self, progress: Path) -> None:
        self.progress = progress

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.progress.write_text(json.dumps({"global_step": trainer.global_step}))
        time.sleep(0.25)


def _child_main(root: Path) -> None:
    torch.manual_seed(0)
    digits_fit(
        DigitsNet(), [FaultTolerantCheckpoint(root), _SlowStepsReportingProgress(root / "progress.json")]
    )


def test_sigterm_mid_epoch_leaves_a_resumable_checkpoint(tmp_path, digits_uninterrupted) -> None:
    """SIGTERM to a real training process (strategy='compiled', DigitsDataModule) in the middle of a step."""
    steps, full = digits_uninterrupted
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, __file__, str(tmp_path)],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    progress = tmp_path / "progress.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            text = progress.read_text() if progress.exists() else ""
            if text and json.loads(text)["global_step"] >= 2:
                break
            time.sleep(0.05)
        assert child.poll() is None, child.stdout.read().decode()[-3000:]
        child.send_signal(signal.SIGTERM)
        output = child.communicate(timeout=60)[0].decode()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    ckpt_path = tmp_path / "interrupted.ckpt"
    assert ckpt_path.exists(), output[-3000:]
    step = torch.load(ckpt_path, weights_only=False)["global_step"]
    # Lightning stops after the step in flight: the checkpoint is mid epoch 0 (10 steps), not at its end.
    assert 3 <= step < steps // 2, f"stopped at step {step}: not mid-epoch\n{output[-3000:]}"
    assert f"Interrupted (SIGTERMException) at global step {step}" in output, output[-3000:]
    torch.manual_seed(123)
    resumed = DigitsNet()
    assert digits_fit(resumed, ckpt_path=str(ckpt_path)).global_step == steps
    _assert_same_weights(_state(resumed), full)


if __name__ == "__main__":
    _child_main(Path(sys.argv[1]))
