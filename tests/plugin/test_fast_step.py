"""The strategy's lean ``self.log`` (``lightning_plugin.fast_step``) records what Lightning's records.

Three fits of the same seeded module and data, with the same Trainer: Lightning's default strategy, the
compiled strategy on Lightning's own logging path (``fast_step=False``) and the compiled strategy's fast
path. Every logged number (TensorBoard's events), ``callback_metrics`` (what ModelCheckpoint and
EarlyStopping monitor), ``logged_metrics`` and ``progress_bar_metrics`` must be the same: exactly, since the
fast path runs Lightning's own reductions on the same tensors.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_plugin
from lightning_plugin import fast_step
from lightning_plugin.fast_step import LeanLog

pytestmark = pytest.mark.xdist_group("test_fast_step")


class Logging(L.LightningModule):
    """Every kind of ``self.log`` a module uses: step and epoch values, a Metric, a float, max, log_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)
        self.acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.log_kinds: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log_kinds.append(type(self.__dict__.get("log", self.log)).__name__)
        self.lean = self.__dict__.get("log")
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/loss_epoch_mean", loss.detach(), on_step=False, on_epoch=True)  # batch-size weighted
        self.log("train/logit_max", logits.detach().max(), on_step=True, on_epoch=True, reduce_fx="max")
        self.acc(logits.detach(), y)
        self.log("train/acc", self.acc, on_step=True, on_epoch=True)
        self.log("train/lr", 0.5 * batch_idx)  # a float: Lightning's path every time
        self.log_dict({"train/a": loss.detach() * 2, "train/b": logits.detach().mean()})
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val/acc", self.val_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=4)  # n not a multiple of 4: a smaller last batch


class TrainingStates(L.Callback):
    """Each training ``_ResultMetric``'s states after every batch (an epoch's end resets them)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(
            {
                key: (
                    metric.value.item()
                    if isinstance(metric.value, torch.Tensor)
                    else type(metric.value).__name__,
                    None if metric._forward_cache is None else float(metric._forward_cache),
                    metric._update_count,
                    metric._computed is None,
                )
                for key, metric in trainer.fit_loop.epoch_loop._results.items()
            }
        )


def _fit(strategy, root) -> tuple[L.Trainer, Logging, dict[str, list[tuple[int, float]]]]:
    torch.manual_seed(0)
    module = Logging()
    checkpoint = ModelCheckpoint(monitor="val/acc", mode="max", dirpath=root / "ckpt")
    stop = EarlyStopping(monitor="train/loss_epoch_mean", patience=5)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=2,
        log_every_n_steps=2,
        logger=TensorBoardLogger(root, name="tb"),
        callbacks=[checkpoint, stop, TrainingStates()],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, _data(22, 1), _data(10, 2))
    events = EventAccumulator(str(root / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    trainer.checkpoint_score = checkpoint.best_model_score  # type: ignore[attr-defined]
    return trainer, module, scalars


def _compiled(fast: bool):
    return lightning_plugin.CompiledStrategy(
        backend="eager", compile="always", tune_cpu=False, fast_step=fast
    )


def _quiet_trainer(fast: bool, **kwargs) -> L.Trainer:
    """A one-device CPU Trainer on the compiled strategy (eager backend), without logger, checkpoints,
    progress bar or model summary."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=_compiled(fast),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    return {
        name: _fit(strategy, tmp_path_factory.mktemp(name))
        for name, strategy in (
            ("lightning", "auto"),
            ("lightning_path", _compiled(False)),
            ("fast", _compiled(True)),
        )
    }


def _plain(metrics: dict) -> dict:
    return {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}


def test_the_fast_path_ran(fits):
    _, fast_module, _ = fits["fast"]
    _, slow_module, _ = fits["lightning_path"]
    assert set(fast_module.log_kinds) == {"LeanLog"}
    assert set(slow_module.log_kinds) == {"method"}
    assert "log" not in fast_module.__dict__  # taken off again when the fit ended
    # 12 training steps; the first of each hook and key goes through Lightning (the float always does)
    shortcuts = fast_module.lean.shortcuts
    assert shortcuts["train/acc"] == shortcuts["train/loss"] == shortcuts["train/a"] == 11
    assert "train/lr" not in shortcuts and shortcuts["val/acc"] >= 4


@pytest.mark.parametrize("reference", ["lightning", "lightning_path"])
def test_same_records_as_lightning(fits, reference):
    fast_trainer, _, fast_scalars = fits["fast"]
    ref_trainer, _, ref_scalars = fits[reference]
    assert fast_scalars == ref_scalars
    assert {"train/loss", "train/acc_step", "train/acc_epoch", "train/logit_max_epoch", "val/acc"} <= set(
        fast_scalars
    )
    assert _plain(fast_trainer.callback_metrics) == _plain(ref_trainer.callback_metrics)
    assert _plain(fast_trainer.logged_metrics) == _plain(ref_trainer.logged_metrics)
    assert fast_trainer.progress_bar_metrics == ref_trainer.progress_bar_metrics
    assert fast_trainer.checkpoint_score == ref_trainer.checkpoint_score


def test_the_stored_training_metrics_hold_lightnings_states(fits):
    """Each training ``_ResultMetric`` after every batch: the same value, forward cache, update count and
    cached result as Lightning's own path left (the on-step values take ``_set_step_value``, not ``forward``)."""

    def states(name):
        trainer = fits[name][0]
        return next(cb for cb in trainer.callbacks if isinstance(cb, TrainingStates)).seen

    fast = states("fast")
    assert fast == states("lightning_path")
    assert len(fast) == 12  # 6 batches, 2 epochs
    counts = [batch["training_step.train/loss"][2] for batch in fast[:6]]
    assert counts == [1, 2, 3, 4, 5, 6]  # one update a step; the shortcut's are counted too


def test_an_untested_lightning_keeps_lightnings_log(monkeypatch, caplog):
    monkeypatch.setattr(fast_step.lightning, "__version__", "2.7.0")
    ok, why = fast_step.lean_log_supported()
    assert not ok and "2.7.0" in why
    module = Logging()
    with caplog.at_level("INFO"):
        assert fast_step.install_lean_log(module) is False
    assert "log" not in module.__dict__ and "outside the tested range" in caplog.text
    monkeypatch.setattr(fast_step, "_private_api_present", lambda: False)
    monkeypatch.setattr(fast_step.lightning, "__version__", "2.6.6")
    ok, why = fast_step.lean_log_supported()
    assert not ok and "internals" in why


def test_a_module_with_its_own_log_is_left_alone():
    class OwnLog(Logging):
        def log(self, *args, **kwargs):  # type: ignore[override]
            super().log(*args, **kwargs)

    module = OwnLog()
    assert fast_step.install_lean_log(module) is False and "log" not in module.__dict__
    plain = Logging()
    assert fast_step.install_lean_log(plain) is True and isinstance(plain.__dict__["log"], LeanLog)
    fast_step.remove_lean_log(plain)
    assert "log" not in plain.__dict__


HOOKS = (
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_batch_end",
)


class Recorder(L.Callback):
    """Records each per-step callback hook with the module's ``_current_fx_name`` at that moment."""

    def __init__(self, calls: list) -> None:
        self.calls = calls


class RecordingModule(Logging):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def on_after_backward(self) -> None:  # one module hook overridden, the others left to the base class
        self.calls.append(("module", "on_after_backward", self._current_fx_name))

    def on_after_batch_transfer(self, batch, dataloader_idx):  # an overridden batch hook still runs
        self.calls.append(("module", "on_after_batch_transfer", self._current_fx_name))
        return batch


def _recording_hook(name):
    def hook(self, trainer, pl_module, *args, **kwargs):
        self.calls.append(("callback", name, pl_module._current_fx_name))

    return hook


for _name in HOOKS:
    setattr(Recorder, _name, _recording_hook(_name))


def _hook_calls(fast: bool, root) -> list:
    calls: list = []
    torch.manual_seed(0)
    trainer = _quiet_trainer(fast, max_epochs=1, callbacks=[Recorder(calls)], num_sanity_val_steps=0)
    trainer.fit(RecordingModule(calls), _data(10, 1), _data(5, 2))
    return calls


def test_lean_hook_calls_call_the_same_hooks_in_the_same_order(tmp_path):
    from lightning.pytorch.trainer import call

    before = (call._call_callback_hooks, call._call_lightning_module_hook)
    fast, lightning_path = _hook_calls(True, tmp_path), _hook_calls(False, tmp_path)
    assert fast == lightning_path
    assert ("module", "on_after_backward", "on_after_backward") in fast
    assert ("module", "on_after_batch_transfer", "on_after_batch_transfer") in fast
    assert ("callback", "on_before_optimizer_step", "on_before_optimizer_step") in fast
    assert (call._call_callback_hooks, call._call_lightning_module_hook) == before  # Lightning's again


class LeanHooksSeen(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen = trainer.strategy.lean_hooks


@pytest.mark.parametrize("profiler", [None, "simple"])
def test_a_profiler_keeps_lightnings_hook_calls(profiler, tmp_path):
    seen = LeanHooksSeen()
    trainer = _quiet_trainer(
        True, default_root_dir=tmp_path, max_steps=2, profiler=profiler, callbacks=[seen]
    )
    trainer.fit(Logging(), _data(8, 1))
    assert seen.seen is (profiler is None)  # a profiler's records stay complete
    assert not trainer.strategy.lean_hooks and "_lcv_lean_hook_calls" not in trainer.__dict__


class OwnClipping(Logging):
    """Clips in its own ``configure_gradient_clipping``: the lean hook calls must still call it."""

    def __init__(self) -> None:
        super().__init__()
        self.clip_calls = 0

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_calls += 1
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")


def _weights_after(fast: bool, module: Logging, tmp_path, **trainer_kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    module.net.reset_parameters()
    trainer = _quiet_trainer(fast, default_root_dir=tmp_path, max_steps=4, **trainer_kwargs)
    trainer.fit(module, _data(16, 1))
    return module.net.weight.detach().clone()


@pytest.mark.parametrize(
    ("make", "trainer_kwargs"),
    [
        (Logging, {}),
        (Logging, {"gradient_clip_val": 0.01}),
        (Logging, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
        (OwnClipping, {}),
    ],
    ids=["no-clipping", "trainer-norm", "trainer-value", "module-hook"],
)
def test_gradient_clipping_is_lightnings_on_the_lean_hook_calls(make, trainer_kwargs, tmp_path):
    """The lean hook calls skip ``configure_gradient_clipping`` only where it would clip nothing: a Trainer's
    clip value and a module's own hook give the weights of Lightning's own hook calls (``fast_step=False``)."""
    fast_module, lightning_module = make(), make()
    fast = _weights_after(True, fast_module, tmp_path, **trainer_kwargs)
    lightning_path = _weights_after(False, lightning_module, tmp_path, **trainer_kwargs)
    torch.testing.assert_close(fast, lightning_path, rtol=0, atol=0)
    unclipped = _weights_after(False, Logging(), tmp_path)
    clipped = bool(trainer_kwargs) or make is OwnClipping
    assert torch.equal(fast, unclipped) is not clipped  # the clipping cases did change the weights
    if make is OwnClipping:
        assert fast_module.clip_calls == lightning_module.clip_calls == 4


class StageComparisons(L.Callback):
    """What the trainer-state enums answer in the middle of a lean fit."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning.pytorch.trainer.states import RunningStage, TrainerFn

        self.patched = "__eq__" in RunningStage.__dict__ and "__eq__" in TrainerFn.__dict__
        stage = trainer.state.stage
        self.answers = [
            stage == RunningStage.TRAINING,
            stage == "train",
            stage == "TRAIN",  # StrEnum compares without case
            stage == RunningStage.VALIDATING,
            stage != RunningStage.TRAINING,
            trainer.state.fn == TrainerFn.FITTING,
            trainer.state.fn == "fit",
            hash(stage) == hash("train"),
            {RunningStage.TRAINING: 1}.get("train"),
        ]


def test_the_state_enums_compare_as_lightnings_and_are_lightnings_again_after_the_fit(tmp_path):
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus

    before = {enum: enum.__dict__.get("__eq__") for enum in (RunningStage, TrainerFn, TrainerStatus)}
    seen = StageComparisons()
    trainer = _quiet_trainer(True, default_root_dir=tmp_path, max_steps=1, callbacks=[seen])
    trainer.fit(Logging(), _data(8, 1))
    assert seen.patched  # the identity-first comparison was in place
    assert seen.answers == [True, True, True, False, False, True, True, True, 1]
    assert {enum: enum.__dict__.get("__eq__") for enum in before} == before


@pytest.mark.parametrize(
    ("version", "tested"), [("1.9.0", True), ("1.0.0", True), ("0.11.4", False), ("2.0.0", False)]
)
def test_the_step_value_shortcut_only_under_tested_torchmetrics(monkeypatch, version, tested):
    import torchmetrics

    monkeypatch.setattr(torchmetrics, "__version__", version)
    assert fast_step._torchmetrics_tested() is tested
