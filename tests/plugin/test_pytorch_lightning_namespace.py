"""The compiled strategies under the standalone ``pytorch_lightning`` package (when it is installed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boring import make_vector_loader

pl = pytest.importorskip(
    "pytorch_lightning", reason="pytorch_lightning is not installed; lightning.pytorch only"
)

import lightning_plugin  # noqa: E402
from lightning_plugin import pytorch_lightning_support  # noqa: E402

TRAINER_KWARGS = dict(
    accelerator="cpu",
    devices=1,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_train_batches=2,
)


class StandaloneModule(pl.LightningModule):
    """A module written against ``pytorch_lightning``, as older code bases are."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(6, 3)

    def forward(self, x):
        return F.relu(self.layer(x))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "strategy",
    [lambda: "compiled", lambda: pytorch_lightning_support.CompiledStrategy(backend="aot_eager")],
    ids=["by-name", "instance"],
)
def test_pytorch_lightning_trainer_fits_with_the_compiled_strategy(strategy):
    trainer = pl.Trainer(strategy=strategy(), **TRAINER_KWARGS)
    assert isinstance(trainer.strategy, pl.strategies.SingleDeviceStrategy)
    module = StandaloneModule()
    trainer.fit(module, make_vector_loader())
    assert trainer.global_step == 2
    assert trainer.strategy.compile_stats.graphs + trainer.strategy.compile_stats.reused_frames >= 1
    assert "forward" not in module.__dict__


def test_every_name_is_registered_in_both_namespaces():
    from lightning.pytorch.strategies import StrategyRegistry as UnifiedRegistry

    # compiled_fsdp is built on the `lightning` namespace's ModelParallelStrategy only.
    ours = sorted(
        n for n in UnifiedRegistry.available_strategies() if n.startswith("compiled") and "fsdp" not in n
    )
    standalone = pl.strategies.StrategyRegistry
    assert ours == sorted(n for n in standalone.available_strategies() if n.startswith("compiled"))
    for name in ours:
        assert standalone[name]["init_params"] == UnifiedRegistry[name]["init_params"]
        expected = (
            pytorch_lightning_support.CompiledDDPStrategy
            if "ddp" in name
            else pytorch_lightning_support.CompiledStrategy
        )
        assert standalone[name]["strategy"] is expected
    assert isinstance(
        pl.Trainer(strategy="compiled_ddp_spawn", accelerator="cpu", devices=2, logger=False).strategy,
        pl.strategies.DDPStrategy,
    )


def test_an_instance_of_the_other_namespace_is_refused_by_name():
    with pytest.raises(ValueError, match=r"instance of `pytorch_lightning\.strategies\.Strategy`"):
        pl.Trainer(strategy=lightning_plugin.CompiledStrategy(), **TRAINER_KWARGS)
