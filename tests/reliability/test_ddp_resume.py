"""`compiled_ddp` on 2 CPU processes (gloo): fit, interrupt with a checkpoint, resume, same weights.

The script half (``python test_ddp_resume.py OUT``) runs in the two DDP processes: an
uninterrupted 2-epoch run, then a run that fails in ``training_step`` at global step 4
(mid epoch 1 of 3-step epochs) with ``FaultTolerantCheckpoint``, then a resume from that checkpoint. Rank 0
saves both final state_dicts; the test compares them (``atol=1e-6, rtol=0``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_resume import BATCH, EPOCHS, SAMPLES, Regressor, ResumableBatches  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
FAIL_AT = 4
STEPS = EPOCHS * SAMPLES // (BATCH * WORLD)  # each rank takes every other batch: 3 steps per epoch


class ShardedBatches(ResumableBatches):
    """`ResumableBatches` where rank r takes batches r, r + world, ... of each epoch's permutation."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world

    def __len__(self) -> int:
        return SAMPLES // BATCH // self.world

    def __iter__(self):
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < len(self):
            start = (self.position * self.world + self.rank) * BATCH
            self.position += 1
            yield self.x[order[start : start + BATCH]], self.y[order[start : start + BATCH]]


def _script(out: Path) -> None:
    import lightning.pytorch as pl

    import lightning_plugin
    from lightning_plugin.callbacks import FaultTolerantCheckpoint

    def trainer(callbacks):
        return pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=lightning_plugin.CompiledDDPStrategy(backend="eager"),
            max_epochs=EPOCHS,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(callbacks),
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
        )

    def fit(model, ckpt_path=None, callbacks=()):
        t = trainer(list(callbacks))
        t.fit(model, ShardedBatches(t.global_rank, t.world_size), ckpt_path=ckpt_path)
        return t

    torch.manual_seed(0)
    full_model = Regressor()
    full = fit(full_model)

    torch.manual_seed(0)
    saver = FaultTolerantCheckpoint(out)
    interrupted = False
    try:
        fit(Regressor(fail_at_step=FAIL_AT), callbacks=[saver])
    except RuntimeError as err:
        interrupted = "injected failure" in str(err)

    torch.manual_seed(123)
    resumed_model = Regressor()
    resumed = fit(resumed_model, ckpt_path=saver.ckpt_path)
    if resumed.global_rank == 0:
        torch.save(full_model.state_dict(), out / "full.pt")
        torch.save(resumed_model.state_dict(), out / "resumed.pt")
        stats = resumed.strategy.compile_stats
        (out / "result.json").write_text(
            json.dumps(
                {
                    "world_size": resumed.world_size,
                    "interrupted": interrupted,
                    "full_steps": full.global_step,
                    "resumed_steps": resumed.global_step,
                    "graphs": stats.graphs,
                    "ckpt_step": torch.load(saver.ckpt_path, weights_only=False)["global_step"],
                }
            )
        )


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
    info = json.loads((tmp_path / "result.json").read_text())
    assert info["world_size"] == WORLD and info["interrupted"]
    assert info["full_steps"] == info["resumed_steps"] == STEPS
    assert info["ckpt_step"] == FAIL_AT
    assert info["graphs"] >= 1  # the resumed run really ran compiled
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    for name, value in full.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


if __name__ == "__main__":
    _script(Path(sys.argv[1]))
