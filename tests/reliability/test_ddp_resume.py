"""`compiled_ddp` on 2 CPU processes (gloo): fit, interrupt with a checkpoint, resume, same weights.

The script half (``python test_ddp_resume.py OUT``) runs in the two DDP processes, on the
project's DigitsDataModule (each rank takes its own shard of the DeviceLoader's order):

1. an uninterrupted 2-epoch run (10 steps per epoch per rank), with a ``TrainingMonitor``
   writing to a logger that records on every rank, to check that only rank 0 logs;
2. a run that fails in ``training_step`` at global step 13 (mid epoch 1) on both ranks, with
   ``FaultTolerantCheckpoint``; then a resume from that checkpoint;
3. a run whose loss turns NaN at global step 2 on rank 1 only, with ``NonFiniteLossGuard``:
   both ranks must stop with the same error (rank 0 alone would wait in the all-reduce).

Rank 0 saves the final state_dicts of 1 and 2; the test compares them bit for bit (the same compiled steps
on the same data from an exactly restored state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_resume import DigitsNet  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
FAIL_AT = 13
STEPS = 20  # 1257 training images, sharded over 2 ranks, batch 64: 10 steps per epoch, 2 epochs
NAN_AT = 2


class NaNOnRankOne(DigitsNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == NAN_AT and self.global_rank == 1:
            loss = loss * float("nan")
        return loss


def _script(out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    import lightning_plugin
    from lcv_vision.data import DigitsDataModule
    from lightning_plugin.callbacks import (
        FaultTolerantCheckpoint,
        NonFiniteLossError,
        NonFiniteLossGuard,
        TrainingMonitor,
    )

    class EveryRankLogger(Logger):
        """Records on every rank (Lightning's loggers are rank_zero_only), to catch a monitor that doesn't."""

        def __init__(self) -> None:
            super().__init__()
            self.monitor_calls = 0

        name, version = "every_rank", 0

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            self.monitor_calls += "vitals/step_time_ms" in metrics  # one per logged window

    def fit(model, ckpt_path=None, callbacks=(), logger=False):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=lightning_plugin.CompiledDDPStrategy(backend="eager", timeout=timedelta(seconds=60)),
            max_epochs=2,
            callbacks=list(callbacks),
            logger=logger,
            log_every_n_steps=5,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=any(isinstance(c, FaultTolerantCheckpoint) for c in callbacks),
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
        )
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=64, image_size=8), ckpt_path=ckpt_path)
        return trainer

    import lcv_vision.data.compiled as compiled

    # Each fit builds a new DataModule, whose augmentation graph Inductor would compile anew on both ranks; the
    # resume is under test, not that code (tests/data/test_data_compiled.py): dynamo traces it, eager runs it.
    compiled.BACKEND = "eager"
    torch.manual_seed(0)
    full_model, logger = DigitsNet(), EveryRankLogger()
    full = fit(full_model, callbacks=[TrainingMonitor(measure_flops=False)], logger=logger)
    rank = full.global_rank

    torch.manual_seed(0)
    saver = FaultTolerantCheckpoint(out)
    interrupted = False
    try:
        fit(DigitsNet(fail_at_step=FAIL_AT), callbacks=[saver])
    except RuntimeError as err:
        interrupted = "injected failure" in str(err)

    torch.manual_seed(123)
    resumed_model = DigitsNet()
    resumed = fit(resumed_model, ckpt_path=saver.ckpt_path)

    torch.manual_seed(0)
    nan_error = None
    try:
        fit(NaNOnRankOne(), callbacks=[NonFiniteLossGuard()])
    except NonFiniteLossError as err:
        nan_error = str(err)

    result = {
        "world_size": resumed.world_size,
        "interrupted": interrupted,
        "full_steps": full.global_step,
        "resumed_steps": resumed.global_step,
        # A fit in the same process reuses the graphs an earlier fit with the same settings compiled.
        "graphs": resumed.strategy.compile_stats.graphs + resumed.strategy.compile_stats.reused_frames,
        "monitor_calls": logger.monitor_calls,
        "nan_error": nan_error,
    }
    if rank == 0:
        torch.save(full_model.state_dict(), out / "full.pt")
        torch.save(resumed_model.state_dict(), out / "resumed.pt")
        result["ckpt_step"] = torch.load(saver.ckpt_path, weights_only=False)["global_step"]
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(300)
def test_compiled_ddp_fit_checkpoint_resume(tmp_path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(tmp_path)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    ranks = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(WORLD)]
    info = ranks[0]
    assert info["world_size"] == WORLD and info["interrupted"]
    assert info["full_steps"] == info["resumed_steps"] == STEPS
    assert info["ckpt_step"] == FAIL_AT
    assert info["graphs"] >= 1  # the resumed run really ran compiled
    # TrainingMonitor logs from rank 0 only: one window record per 5 steps (log_every_n_steps=5).
    assert [r["monitor_calls"] for r in ranks] == [STEPS // 5, 0]
    # The NaN on rank 1 stops both ranks at the same step, with the same message naming the rank.
    for r in ranks:
        assert r["nan_error"] is not None and f"global step {NAN_AT} " in r["nan_error"], r["nan_error"]
        assert "on rank(s) [1]" in r["nan_error"], r["nan_error"]
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    for name, value in full.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


if __name__ == "__main__":
    _script(Path(sys.argv[1]))
