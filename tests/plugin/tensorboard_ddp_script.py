"""Run by test_tensorboard_plugin.py: a two-process (gloo) compiled DDP fit with the monitor and a
TensorBoardLogger into the folder given; only rank 0 may write events."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, __import__("os").path.dirname(__file__))
import lightning_plugin  # noqa: E402
from boring import TinyModule, make_loader  # noqa: E402
from lightning_plugin.callbacks import TrainingMonitor  # noqa: E402


def main(out: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_plugin.CompiledDDPStrategy(backend="eager", start_method="popen"),
        max_epochs=1,
        logger=TensorBoardLogger(out, name="ddp", version=0),
        callbacks=[TrainingMonitor(log_every_n_steps=1, log_images=False)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(), make_loader(n=32, batch_size=4), make_loader(n=8, batch_size=4))


if __name__ == "__main__":
    main(sys.argv[1])
