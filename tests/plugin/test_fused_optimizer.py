"""The fused optimizer step on a CPU (``lightning_plugin.cpu.fused_optimizer``): the same updates as PyTorch's
default step (float64 as the truth), taken only where the LightningModule left the choice open, and in place
after a resume restored the optimizer's state."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn

import lightning_plugin
from lightning_plugin.cpu.fused_optimizer import can_fuse, fuse_optimizer_steps


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(2, 3, 6, 5, generator=g, dtype=dtype)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return [p.detach().double() for p in model.parameters()]


OPTIMIZERS = {
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_updates_match_the_default_step_against_float64(name):
    make = OPTIMIZERS[name]
    base = _net()
    base(torch.zeros(1, 3, 6, 5))  # materialise the lazy layer
    truth_model = copy.deepcopy(base).double()
    truth = _steps(truth_model, make(truth_model.parameters()), torch.float64)
    default_model, fused_model = copy.deepcopy(base), copy.deepcopy(base)
    default = _steps(default_model, make(default_model.parameters()), torch.float32)
    fused_optimizer = make(fused_model.parameters())
    assert fuse_optimizer_steps([fused_optimizer], fused_model) == [type(fused_optimizer).__name__]
    fused = _steps(fused_model, fused_optimizer, torch.float32)
    assert all(group["fused"] for group in fused_optimizer.param_groups)
    for t, d, f in zip(truth, default, fused):
        default_error = (d - t).abs().max().item()
        assert (f - t).abs().max().item() <= 2 * default_error + 1e-6


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=False),
        lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True),
        lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False),
        lambda ps: torch.optim.SGD(ps, lr=0.1, differentiable=True),
        lambda ps: torch.optim.RMSprop(ps, lr=0.1),  # no fused step
        lambda ps: type("MySGD", (torch.optim.SGD,), {})(ps, lr=0.1),  # a subclass may change step()
    ],
    ids=["fused_false", "foreach_true", "adam_foreach_false", "differentiable", "rmsprop", "subclass"],
)
def test_a_choice_made_by_the_module_is_kept(make):
    model = nn.Linear(3, 2)
    optimizer = make(model.parameters())
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    assert not can_fuse(optimizer)
    assert fuse_optimizer_steps([optimizer], model) == []
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups


def test_parameters_it_cannot_fuse_are_left_alone():
    assert not can_fuse(torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.complex64))], lr=0.1))
    assert not can_fuse(torch.optim.SGD([nn.Parameter(torch.zeros(2, device="meta"))], lr=0.1))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(sparse.parameters(), lr=0.1)
    assert can_fuse(optimizer)  # the parameters alone do not tell ...
    assert fuse_optimizer_steps([optimizer], sparse) == []  # ... the module does: its gradients are sparse


# ---------------------------------------------------------------------------------------------- in a fit
class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 3, 3))
        self.fused_at_step: list[bool] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.fused_at_step.append(bool(self.optimizers().optimizer.param_groups[0]["fused"]))
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(strategy, tmp_path, max_steps: int, ckpt_path=None, callbacks=()) -> _Module:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(8, 3, 6, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    )
    module = _Module()
    L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=list(callbacks),
        max_steps=max_steps,
        logger=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    return module


def _strategy(**settings):
    return lightning_plugin.CompiledStrategy(backend="eager", compile="always", **settings)


def _settings_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "CPU training settings" in r.getMessage()]


def test_the_strategy_fuses_the_step_on_cpu_and_again_after_a_resume(tmp_path, caplog):
    caplog.set_level("INFO")
    first = _fit(_strategy(), tmp_path, max_steps=2)
    assert first.fused_at_step == [True, True]
    assert any("fused SGD step" in line for line in _settings_lines(caplog))
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    # A resume restores the groups' settings after the strategy's setup, so the strategy must switch to the
    # fused step after that, not before: make the checkpoint say fused=None, as an eager run writes it.
    state = torch.load(checkpoint, weights_only=False)
    for group in state["optimizer_states"][0]["param_groups"]:
        assert group["fused"] is True
        group["fused"] = None
    torch.save(state, checkpoint)
    resumed = _fit(_strategy(), tmp_path / "resumed", max_steps=4, ckpt_path=checkpoint)
    assert resumed.fused_at_step == [True, True]


def test_tune_cpu_false_keeps_the_modules_optimizer(tmp_path, caplog):
    caplog.set_level("INFO")
    module = _fit(_strategy(tune_cpu=False), tmp_path, max_steps=1)
    assert module.fused_at_step == [False]
    assert _settings_lines(caplog) == []


def test_the_torch_compile_callback_fuses_the_step_too(tmp_path):
    from lightning_plugin.callbacks import TorchCompile

    module = _fit("auto", tmp_path, max_steps=1, callbacks=[TorchCompile(backend="eager")])
    assert module.fused_at_step == [True]
