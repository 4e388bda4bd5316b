"""NonFiniteLossGuard: a NaN/Inf loss stops the run, names the step, and leaves the last good weights."""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_plugin import CompiledStrategy
from lightning_plugin.callbacks import NonFiniteLossError, NonFiniteLossGuard


class Poisoned(pl.LightningModule):
    """A Linear classifier whose loss is poisoned (``nan``/``inf``/a NaN gradient) at one global step."""

    def __init__(self, bad_step: int | None = None, poison: str = "nan") -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.bad_step, self.poison = bad_step, poison

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.global_step == self.bad_step:
            if self.poison == "grad":  # finite loss (0), NaN gradient (d sqrt(0) * 0)
                loss = loss + torch.sqrt((self.net.weight * 0.0).sum())
            else:
                loss = loss * float(self.poison)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    return DataLoader(data, batch_size=8)


def _trainer(callbacks=(), strategy="auto", **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
        **kw,
    )


def _weights_after(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Poisoned()
    _trainer(max_steps=steps).fit(model, _loader())
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


@pytest.mark.parametrize(("poison", "shown"), [("nan", "nan"), ("inf", "+inf"), ("-inf", "-inf")])
def test_raise_names_step_and_value_and_keeps_last_good_weights(poison: str, shown: str) -> None:
    torch.manual_seed(0)
    model = Poisoned(bad_step=3, poison=poison)
    expected = rf"global step 3 \(epoch 0, batch 3\): the training loss is {re.escape(shown)}"
    with pytest.raises(NonFiniteLossError, match=expected):
        # tune_cpu=False: the reference trains with SGD's default step, bit for bit (fused rounds apart)
        strategy = CompiledStrategy(backend="eager", tune_cpu=False)
        _trainer([NonFiniteLossGuard()], strategy=strategy).fit(model, _loader())
    _assert_same(model, _weights_after(3))


def test_without_the_guard_training_diverges_silently() -> None:
    """The failure the guard prevents: fit 'succeeds' and every weight is NaN."""
    torch.manual_seed(0)
    model = Poisoned(bad_step=3)
    _trainer().fit(model, _loader())
    assert all(torch.isnan(p).all() for p in model.parameters())


def test_stop_skips_the_bad_update_and_ends_fit() -> None:
    torch.manual_seed(0)
    model = Poisoned(bad_step=3)
    guard = NonFiniteLossGuard(action="stop")
    trainer = _trainer([guard])
    with pytest.warns(UserWarning, match=r"global step 3 .*training loss is nan.*Stopping"):
        trainer.fit(model, _loader())
    assert trainer.global_step == 4 < len(_loader())  # stopped right after the bad step
    assert guard.last_detection is not None and "global step 3" in guard.last_detection
    _assert_same(model, _weights_after(3))


def test_gradient_check_names_the_parameter() -> None:
    torch.manual_seed(0)
    model = Poisoned(bad_step=2, poison="grad")
    with pytest.raises(NonFiniteLossError, match=r"global step 2 .*gradient of 'net\.weight' contains nan"):
        _trainer([NonFiniteLossGuard(check_grads=True)]).fit(model, _loader())
    _assert_same(model, _weights_after(2))


def test_sparse_checks_catch_it_at_the_next_checked_step() -> None:
    torch.manual_seed(0)
    model = Poisoned(bad_step=3)
    with pytest.raises(NonFiniteLossError, match=r"global step 4 "):
        _trainer([NonFiniteLossGuard(check_every_n_steps=2)]).fit(model, _loader())
    assert math.isnan(
        float(model.net.weight[0, 0].detach())
    )  # step 3 was not checked, so its update went through


def test_raise_with_fault_tolerant_checkpoint_saves_the_last_finite_weights(tmp_path) -> None:
    from lightning_plugin.callbacks import FaultTolerantCheckpoint

    torch.manual_seed(0)
    saver = FaultTolerantCheckpoint(tmp_path)
    trainer = pl.Trainer(
        accelerator="cpu",
        callbacks=[NonFiniteLossGuard(), saver],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
    )
    with pytest.raises(NonFiniteLossError):
        trainer.fit(Poisoned(bad_step=3), _loader())
    checkpoint = torch.load(saver.ckpt_path, weights_only=False)
    assert checkpoint["global_step"] == 3
    reference = _weights_after(3)
    for name, value in checkpoint["state_dict"].items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)
