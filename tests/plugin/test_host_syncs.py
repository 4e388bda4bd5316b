"""No host-device sync in a training step under ``strategy="compiled"``, outside the logging interval.

Every way a step could wait for the device is counted (``Tensor.item``, ``Tensor.__bool__``, ``Tensor.cpu``,
``Tensor.tolist``, ``torch.cuda.synchronize``) from one batch's start to the next, so Lightning's own
bookkeeping after ``on_train_batch_end`` is inside. On a CPU nothing waits, but the same calls would wait on a
GPU. Counted for the recipes' module (airbench at tiny widths, its recipe's settings: lookahead, whitening,
the epoch accuracy) and for a user module logging tensors with ``prog_bar=True``, each with the forward
compiled and with the whole step as one graph (``compile_step=True``). The logging steps do sync
(TensorBoard is written as numbers): the counter sees them, and it sees the per-step sync of Lightning's own
path (``fast_step=False``, whose progress-bar values are converted every step).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_plugin

pytestmark = pytest.mark.xdist_group("test_host_syncs")

STEPS, LOG_EVERY, WARM = 14, 5, 2
SYNCS = ("item", "__bool__", "cpu", "tolist")
trainer_stats: list = []  # each fit's compile stats (the one-graph cases check that no step fell back)


class SyncCounter(L.Callback):
    """Counts the sync entry points per training step, after the first ``WARM`` (compiling) steps."""

    def __init__(self) -> None:
        self.at_start: list[int] = []
        self.calls = 0
        self._saved: dict[str, object] = {}
        #: compile_step's learning-rate scalars: CPU tensors on any device, read by dynamo's guards each step
        #: without waiting for the device (``WholeStep.host_scalars``), so not counted
        self.host_scalars: tuple[torch.Tensor, ...] = ()

    def _count(self, original):
        def counted(*args, **kwargs):
            if not any(args[0] is t for t in self.host_scalars):
                self.calls += 1
            return original(*args, **kwargs)

        return counted

    def _patch(self) -> None:
        for name in SYNCS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._count(self._saved[name]))
        self._saved["synchronize"] = torch.cuda.synchronize
        torch.cuda.synchronize = self._count(torch.cuda.synchronize)

    def unpatch(self) -> None:
        for name, original in self._saved.items():
            if name == "synchronize":
                torch.cuda.synchronize = original
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        whole_step = trainer.strategy.whole_step
        self.host_scalars = whole_step.host_scalars if whole_step is not None else ()
        if batch_idx == WARM:
            self._patch()
        if batch_idx >= WARM:
            self.at_start.append(self.calls)

    def on_train_epoch_end(self, trainer, pl_module):
        self.at_start.append(self.calls)  # closes the last step
        self.unpatch()

    def per_step(self) -> dict[int, int]:
        """Batch index -> syncs from its start to the next batch's start."""
        return {WARM + i: b - a for i, (a, b) in enumerate(zip(self.at_start, self.at_start[1:]))}


class UserModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(1) == y).float().mean(), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _user() -> tuple[L.LightningModule, DataLoader]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4 * STEPS, 8, generator=g), torch.randint(0, 3, (4 * STEPS,), generator=g)
    )
    return UserModule(), DataLoader(data, batch_size=4)


def _recipe() -> tuple[L.LightningModule, DataLoader]:
    from lcv_vision.recipes import build_module

    module = build_module("cifar10-airbench", 3, model_kwargs={"widths": [8, 8, 8]}, whitening_images=0)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(4 * STEPS, 3, 32, 32, generator=g)
    return module, DataLoader(
        TensorDataset(images, torch.randint(0, 3, (4 * STEPS,), generator=g)), batch_size=4
    )


def _syncs(make, fast: bool, root, compile_step: bool = False) -> dict[int, int]:
    torch.manual_seed(0)
    module, loader = make()
    counter = SyncCounter()
    trainer = L.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        strategy=lightning_plugin.CompiledStrategy(
            backend="eager", compile="always", fast_step=fast, compile_step=compile_step
        ),
        max_epochs=1,
        log_every_n_steps=LOG_EVERY,
        callbacks=[counter],
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        trainer.fit(module, loader)
    finally:
        counter.unpatch()
    trainer_stats.append(trainer.strategy.compile_stats)
    return counter.per_step()


def _logging_steps() -> set[int]:
    return {i for i in range(STEPS) if (i + 1) % LOG_EVERY == 0} | {STEPS - 1}  # and the epoch's last batch


@pytest.mark.parametrize("compile_step", [False, True], ids=["forward", "one_graph"])
@pytest.mark.parametrize("make", [_recipe, _user], ids=["recipe_module", "user_module"])
def test_no_sync_outside_the_logging_interval(make, compile_step, tmp_path):
    per_step = _syncs(make, fast=True, root=tmp_path, compile_step=compile_step)
    if compile_step:
        assert trainer_stats[-1].one_graph_fallback is None and trainer_stats[-1].one_graph_steps == STEPS
    assert sorted(per_step) == list(range(WARM, STEPS))
    assert {i: n for i, n in per_step.items() if i not in _logging_steps()} == {}.fromkeys(
        set(per_step) - _logging_steps(), 0
    )
    assert any(per_step[i] > 0 for i in _logging_steps() if i in per_step)  # the counter does count


def test_lightnings_own_path_syncs_every_step(tmp_path):
    per_step = _syncs(_user, fast=False, root=tmp_path)
    assert all(n > 0 for i, n in per_step.items() if i not in _logging_steps())
