"""A lean ``self.log`` for the compiled strategies: the same records for a fraction of Lightning's host time.

Lightning's ``LightningModule.log`` re-validates every call (nested dicts, allowed types, the hook's logging
levels, the ``training_step`` signature), builds and compares a ``_Metadata`` dataclass, and moves the
stored ``_ResultMetric`` to the value's device with ``apply_to_collection`` over its whole ``__dict__``
(deep-copying the metadata on the way). On a 2-core CPU that is ~1 ms of a step's host time for two logged
values (``benchmarks/step_overhead.py``); on a GPU step of ~8 ms it is more than 10%.

:class:`LeanLog` is installed on the module (an instance attribute shadowing ``LightningModule.log``) while
the strategy trains. The first call of each distinct ``self.log(...)`` goes through Lightning's own ``log``,
which validates it and creates the stored ``_ResultMetric``; the calls after that, with the same arguments,
the same hook, a tensor or the same ``torchmetrics.Metric`` on the device the stored metric is on, update
that ``_ResultMetric`` directly (``_ResultMetric.forward``: the same reduction, sync and step cache as
Lightning's path). Anything else (a float, a new key, other arguments, a moved device, a results collection
replaced by a new loop) takes Lightning's path again. So what ``self.log`` records, the logger's values, the
progress bar and ``callback_metrics`` (what checkpoint and early-stopping callbacks monitor) are Lightning's
own.

The shortcut reads private Lightning state (``trainer._results``, ``_ResultMetric``), so it is used only on the
Lightning versions it was tested on (:data:`TESTED_LIGHTNING`, also pinned in ``pyproject.toml``) and only
where that state looks as expected; elsewhere the strategy keeps Lightning's ``log`` and says so once.
"""

from __future__ import annotations

from typing import Any, cast

import lightning
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from packaging.version import Version
from torchmetrics import Metric
from typing_extensions import override

try:
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
except ImportError:  # pragma: no cover - another Lightning layout: lean_log_supported() says no
    _LoggerConnector = object  # type: ignore[assignment,misc]
    _ResultMetric = None  # type: ignore[assignment,misc]

__all__ = [
    "TESTED_LIGHTNING",
    "LeanLog",
    "LeanLoggerConnector",
    "install_lean_log",
    "install_lean_progress_metrics",
    "lean_log_supported",
    "remove_lean_log",
    "remove_lean_progress_metrics",
]

#: ``[lowest, first untested)`` Lightning versions whose private logging state :class:`LeanLog` reads.
TESTED_LIGHTNING = ("2.6.0", "2.7.0")

_FLOAT_DTYPES = (torch.float32, torch.float64)


def _private_api_present() -> bool:
    try:
        from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
        from lightning.pytorch.trainer.connectors.logger_connector.result import (
            _ResultCollection,
            _ResultMetric,
        )
    except ImportError:
        return False
    return (
        callable(getattr(_ResultMetric, "forward", None))
        and callable(getattr(_ResultCollection, "_extract_batch_size", None))
        and callable(getattr(_ResultCollection, "log", None))
        and callable(getattr(_LoggerConnector, "on_batch_end", None))
        and isinstance(getattr(_LoggerConnector, "progress_bar_metrics", None), property)
    )


def _in_range(version: str, tested: tuple[str, str]) -> bool:
    """Whether ``version`` lies in ``[tested[0], tested[1])``."""
    low, high = tested
    return Version(low) <= Version(version) < Version(high)


def lean_log_supported(version: str | None = None) -> tuple[bool, str]:
    """Whether :class:`LeanLog` may be used with this Lightning (``version``: the installed one), and why not."""
    version = lightning.__version__ if version is None else version
    if not _in_range(version, TESTED_LIGHTNING):
        low, high = TESTED_LIGHTNING
        return False, f"Lightning {version} is outside the tested range [{low}, {high})"
    if not _private_api_present():
        return False, "Lightning's logging internals (_ResultCollection/_ResultMetric) are not as tested"
    return True, ""


class LeanLog:
    """Stands in for ``module.log``: Lightning's ``log`` the first time, a direct metric update after."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self._lightning_log = LightningModule.log.__get__(module)
        # call signature -> (results collection, its key, the stored _ResultMetric)
        self._known: dict[tuple[Any, ...], tuple[Any, str, Any]] = {}
        self.shortcuts: dict[str, int] = {}  # name -> calls that took the direct update

    def __call__(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any | None = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        module = self.module
        trainer = module._trainer
        fx = module._current_fx_name
        results = trainer._results if trainer is not None else None
        is_tensor = isinstance(value, torch.Tensor)
        signature: tuple[Any, ...] | None = None
        if results is not None and fx is not None and not enable_graph and (is_tensor or _is_metric(value)):
            signature = (
                fx,
                name,
                results.dataloader_idx,
                prog_bar,
                logger,
                on_step,
                on_epoch,
                reduce_fx,
                sync_dist,
                sync_dist_group,
                add_dataloader_idx,
                batch_size,
                metric_attribute,
                rank_zero_only,
                is_tensor,
            )
            try:
                known = self._known.get(signature)
            except TypeError:  # an unhashable argument (a process group object, say): Lightning's path
                known, signature = None, None
            if known is not None and known[0] is results and results.get(known[1]) is known[2]:
                stored = known[2]
                if is_tensor:
                    if (
                        value.numel() == 1
                        and value.dtype in _FLOAT_DTYPES
                        and stored.value.device == value.device
                    ):
                        self._update(trainer, results, fx, stored, value.detach().squeeze(), batch_size)
                        self.shortcuts[name] = self.shortcuts.get(name, 0) + 1
                        return
                elif stored.value is value:
                    self._update(trainer, results, fx, stored, value, batch_size)
                    self.shortcuts[name] = self.shortcuts.get(name, 0) + 1
                    return
        self._lightning_log(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx,
            enable_graph=enable_graph,
            sync_dist=sync_dist,
            sync_dist_group=sync_dist_group,
            add_dataloader_idx=add_dataloader_idx,
            batch_size=batch_size,
            metric_attribute=metric_attribute,
            rank_zero_only=rank_zero_only,
        )
        if signature is not None and fx is not None:
            self._remember(signature, results, fx, name)

    def _remember(self, signature: tuple[Any, ...], results: Any, fx: str, name: str) -> None:
        key = f"{fx}.{name}"
        if results.dataloader_idx is not None and signature[10]:  # add_dataloader_idx
            key += f".{results.dataloader_idx}"
        stored = results.get(key)
        if stored is not None:
            self._known[signature] = (results, key, stored)

    @staticmethod
    def _update(trainer: Any, results: Any, fx: str, stored: Any, value: Any, batch_size: int | None) -> None:
        """What Lightning's ``_ResultCollection.log`` does once the metric exists and sits on the value's device."""
        connector = trainer._logger_connector
        if connector.should_reset_tensors(fx):  # the first batch of a new epoch: Lightning resets this hook's
            results.reset(metrics=False, fx=fx)
        meta = stored.meta
        if meta.on_step and not meta.on_epoch and _step_value_shortcut(stored):
            _set_step_value(stored, value)
        else:
            size = results._extract_batch_size(stored, batch_size, meta)
            stored.forward(value, size)
        stored.has_reset = False
        connector._current_fx = fx


#: ``[lowest, first untested)`` torchmetrics versions whose ``Metric.update`` wrapper :func:`_set_step_value`
#: does the bookkeeping of.
TESTED_TORCHMETRICS = ("1.0.0", "2.0.0")


def _torchmetrics_tested() -> bool:
    import torchmetrics

    return _in_range(torchmetrics.__version__, TESTED_TORCHMETRICS)


_TORCHMETRICS_TESTED = _torchmetrics_tested()


def _step_value_shortcut(stored: Any) -> bool:
    """Whether :func:`_set_step_value` may stand in for ``stored.forward``: Lightning's own ``_ResultMetric``
    holding a tensor, with no CPU offload of its states, under a torchmetrics version it was tested with."""
    return (
        _TORCHMETRICS_TESTED
        and type(stored) is _ResultMetric
        and stored.is_tensor
        and not stored.compute_on_cpu
    )


def _set_step_value(stored: Any, value: torch.Tensor) -> None:
    """``_ResultMetric.forward`` for a value logged on step only (``training_step``'s default): its ``update``
    keeps the synced clone as the value (no accumulation), inside torchmetrics' update wrapper, which clears
    the computed cache and counts the update. The same states, without the wrapper's grad-mode context and
    the dtype checks (:class:`LeanLog` passes only detached float32/float64 scalars here): ~10 us a call."""
    stored._computed = None
    stored._update_count += 1
    cached = stored.meta.sync(value.clone())  # `clone`: the sync is in place
    stored._forward_cache = cached
    stored.value = cached


def _is_metric(value: Any) -> bool:
    return isinstance(value, Metric)


def install_lean_log(module: LightningModule) -> bool:
    """Put a :class:`LeanLog` on ``module`` where Lightning's version allows it; True when installed."""
    if isinstance(module.__dict__.get("log"), LeanLog):
        return True
    if type(module).log is not LightningModule.log:
        return False  # the module defines its own `log`: leave it
    ok, why = lean_log_supported()
    if not ok:
        rank_zero_info(f"fast_step: using Lightning's own self.log ({why})")
        return False
    module.__dict__["log"] = LeanLog(module)
    return True


def remove_lean_log(module: LightningModule | None) -> None:
    """Undo :func:`install_lean_log` (the module's ``log`` is Lightning's again)."""
    if module is not None and isinstance(module.__dict__.get("log"), LeanLog):
        del module.__dict__["log"]


# ------------------------------------------------------------------------------------------ progress-bar values
class LeanLoggerConnector(_LoggerConnector):
    """``_LoggerConnector`` with the progress-bar values refreshed at the logging interval while training.

    Lightning converts every ``prog_bar=True`` value to a Python number (``.item()``, a host-device sync) at
    the end of every training batch, and again each time the progress bar reads ``progress_bar_metrics``.
    Here, during training, they are converted on the steps that log (``log_every_n_steps``), on the last
    batch of an epoch and when the run stops; between those the progress bar shows the last converted
    values. Callback and logger metrics are updated every batch exactly as Lightning does (tensors, no sync).
    A module-level class so that a trainer holding it pickles.
    """

    def _progress_values_due(self) -> bool:
        trainer = self.trainer
        if not trainer.training or self._first_loop_iter is None or getattr(trainer, "fast_dev_run", False):
            return True
        return bool(
            self.should_update_logs
            or trainer.should_stop
            or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        )

    @override
    def on_batch_end(self) -> None:
        if self._progress_values_due():
            super().on_batch_end()
            return
        results = self.trainer._results
        shown = [metric.meta for metric in results.values() if metric.meta.prog_bar] if results else []
        for meta in shown:  # left out of this batch's progress-bar values (no .item())
            meta.prog_bar = False
        try:
            super().on_batch_end()
        finally:
            for meta in shown:
                meta.prog_bar = True

    @property
    @override
    def progress_bar_metrics(self) -> dict[str, float]:
        if self.trainer._results and self._progress_values_due():
            self._progress_bar_metrics.update(self.metrics["pbar"])
        return self._progress_bar_metrics


def install_lean_progress_metrics(trainer: Any) -> bool:
    """Give ``trainer``'s logger connector the lean progress-bar values (:class:`LeanLoggerConnector`)
    where Lightning's version allows it; True when installed."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None or not lean_log_supported()[0]:
        return False
    if type(connector) is LeanLoggerConnector:
        return True
    if type(connector) is not _LoggerConnector:
        return False  # someone else's connector subclass: leave it
    connector.__class__ = LeanLoggerConnector
    return True


def remove_lean_progress_metrics(trainer: Any) -> None:
    """Undo :func:`install_lean_progress_metrics`."""
    connector: Any = getattr(trainer, "_logger_connector", None)
    if type(connector) is LeanLoggerConnector:
        cast(Any, connector).__class__ = _LoggerConnector


# ------------------------------------------------------------------------------------------------- hook calls
#: LightningModule hooks whose base implementation does nothing and returns None (``ModelHooks``): when the
#: module does not override one, calling it is skipped.
_NO_OP_MODULE_HOOKS = frozenset(
    {
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_validation_batch_start",
        "on_validation_batch_end",
    }
)

#: LightningModule hooks whose base implementation returns the batch unchanged (``DataHooks``).
_IDENTITY_MODULE_HOOKS = frozenset({"on_before_batch_transfer", "on_after_batch_transfer"})

_hook_users = 0
_lightning_hooks: dict[str, Any] = {}


#: Set in a trainer's ``__dict__`` by :func:`install_lean_hook_calls` (read on every hook call: one dict look-up).
_LEAN_FLAG = "_lcv_lean_hook_calls"


def _overrides(obj: Any, base: type, hook_name: str) -> bool:
    return hook_name in obj.__dict__ or getattr(type(obj), hook_name, None) is not getattr(
        base, hook_name, None
    )


def _call_callback_hooks(
    trainer: Any, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
) -> None:
    """Lightning's ``call._call_callback_hooks`` without the callbacks that do not define ``hook_name`` (the
    base ``Callback``'s hooks do nothing) and without the no-op profiler's per-callback context."""
    if not trainer.__dict__.get(_LEAN_FLAG):
        _lightning_hooks["_call_callback_hooks"](
            trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs
        )
        return
    callbacks = [cb for cb in trainer.callbacks if _overrides(cb, Callback, hook_name)]
    if monitoring_callbacks is True:
        callbacks = [cb for cb in callbacks if isinstance(cb, (EarlyStopping, Checkpoint))]
    elif monitoring_callbacks is False:
        callbacks = [cb for cb in callbacks if not isinstance(cb, (EarlyStopping, Checkpoint))]
    if not callbacks:
        return
    pl_module = trainer.lightning_module
    if pl_module:
        previous = pl_module._current_fx_name
        _set_fx_name(pl_module, hook_name)
    for callback in callbacks:
        fn = getattr(callback, hook_name)
        if callable(fn):
            fn(trainer, trainer.lightning_module, *args, **kwargs)
    if pl_module:
        _set_fx_name(pl_module, previous)


def _call_lightning_module_hook(
    trainer: Any, hook_name: str, *args: Any, pl_module: Any = None, **kwargs: Any
) -> Any:
    """Lightning's ``call._call_lightning_module_hook`` without the no-op profiler's context, skipping the
    no-op hooks the module leaves alone and passing the batch through the identity hooks it leaves alone."""
    module = pl_module or trainer.lightning_module
    if module is None or not trainer.__dict__.get(_LEAN_FLAG):
        return _lightning_hooks["_call_lightning_module_hook"](
            trainer, hook_name, *args, pl_module=pl_module, **kwargs
        )
    if hook_name in _NO_OP_MODULE_HOOKS and not _overrides(module, LightningModule, hook_name):
        return None
    if hook_name in _IDENTITY_MODULE_HOOKS and not _overrides(module, LightningModule, hook_name):
        return args[0] if args else kwargs["batch"]
    if hook_name == "configure_gradient_clipping" and _clips_nothing(trainer, module, kwargs):
        return None
    fn = getattr(module, hook_name)
    if not callable(fn):
        return None
    previous = module._current_fx_name
    _set_fx_name(module, hook_name)
    output = fn(*args, **kwargs)
    _set_fx_name(module, previous)
    return output


def _clips_nothing(trainer: Any, module: Any, kwargs: dict[str, Any]) -> bool:
    """Whether Lightning's ``configure_gradient_clipping`` call (made after every closure) would do nothing:
    the module keeps Lightning's clipping hooks, no clip value is set (the precision plugin returns at a value
    of 0), and the plugin's ``clip_gradients`` is Lightning's own. Its validation costs ~15 us a step."""
    return (
        kwargs.get("gradient_clip_val") in (None, 0)
        and not _overrides(module, LightningModule, "configure_gradient_clipping")
        and not _overrides(module, LightningModule, "clip_gradients")
        and getattr(module, "_fabric", None) is None
        and type(trainer.precision_plugin).clip_gradients is Precision.clip_gradients
    )


def _set_fx_name(module: Any, name: str | None) -> None:
    """``module._current_fx_name = name``; without ``nn.Module.__setattr__``'s parameter/buffer/submodule
    checks (a string is none of them) where the class keeps ``nn.Module``'s ``__setattr__``."""
    if getattr(type(module), "__setattr__", None) is torch.nn.Module.__setattr__:
        object.__setattr__(module, "_current_fx_name", name)
    else:
        module._current_fx_name = name


def _call_strategy_hook(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
    """Lightning's ``call._call_strategy_hook`` without the no-op profiler's context."""
    if not trainer.__dict__.get(_LEAN_FLAG):
        return _lightning_hooks["_call_strategy_hook"](trainer, hook_name, *args, **kwargs)
    pl_module = trainer.lightning_module
    previous = pl_module._current_fx_name
    _set_fx_name(pl_module, hook_name)
    fn = getattr(trainer.strategy, hook_name)
    if not callable(fn):
        return None
    output = fn(*args, **kwargs)
    _set_fx_name(pl_module, previous)
    return output


_signature_answers: dict[tuple[Any, ...], bool] = {}


def _is_param_in_hook_signature(
    hook_fx: Any, param: str, explicit: bool = False, min_args: int | None = None
) -> bool:
    """Lightning's ``is_param_in_hook_signature``, answered once per function: the training and evaluation
    loops ask it about ``training_step``/``validation_step`` on every batch (``inspect`` each time)."""
    original = _lightning_hooks["is_param_in_hook_signature"]
    key = (getattr(hook_fx, "__func__", hook_fx), hasattr(hook_fx, "__self__"), param, explicit, min_args)
    try:
        return _signature_answers[key]
    except KeyError:
        answer = bool(original(hook_fx, param, explicit=explicit, min_args=min_args))
        _signature_answers[key] = answer
        return answer
    except TypeError:  # an unhashable callable
        return bool(original(hook_fx, param, explicit=explicit, min_args=min_args))


#: (module, attribute) -> the lean stand-in; Lightning's originals are kept in ``_lightning_hooks``.
def _replacements() -> list[tuple[Any, str, Any]]:
    from lightning.pytorch.loops import evaluation_loop, training_epoch_loop
    from lightning.pytorch.trainer import call

    return [
        (call, "_call_callback_hooks", _call_callback_hooks),
        (call, "_call_lightning_module_hook", _call_lightning_module_hook),
        (call, "_call_strategy_hook", _call_strategy_hook),
        (training_epoch_loop, "is_param_in_hook_signature", _is_param_in_hook_signature),
        (evaluation_loop, "is_param_in_hook_signature", _is_param_in_hook_signature),
    ]


# ------------------------------------------------------------------------------------- trainer-state enums
_INHERITED = object()
_eq_before: dict[type, Any] = {}  # enum class -> its own __eq__ before ours (_INHERITED: it had none)


def _state_enums() -> list[type]:
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus

    return [RunningStage, TrainerFn, TrainerStatus]


def _identity_first(original: Any) -> Any:
    """``original`` (``StrEnum.__eq__``: two ``.value`` reads and two ``str.lower()``) after an identity
    check: ``trainer.training`` compares its stage ~20 times a step (behind ``trainer._results``), nearly
    always with the same member. Equal answers: a member is equal to itself under the original too."""

    def __eq__(self: Any, other: object) -> bool:
        return self is other or original(self, other)

    return __eq__


def _install_identity_first_eq() -> None:
    for enum in _state_enums():
        if enum in _eq_before:
            continue
        _eq_before[enum] = enum.__dict__.get("__eq__", _INHERITED)
        enum.__eq__ = _identity_first(enum.__eq__)  # type: ignore[method-assign]  # __hash__ stays the class's


def _remove_identity_first_eq() -> None:
    for enum, before in _eq_before.items():
        if before is _INHERITED:
            del enum.__eq__
        else:
            enum.__eq__ = before  # type: ignore[method-assign]
    _eq_before.clear()


def install_lean_hook_calls(trainer: Any) -> bool:
    """Route ``trainer``'s hook calls through the lean versions above (every other trainer gets Lightning's
    own); True when installed. Not with a profiler other than Lightning's no-op one (its records stay
    complete). Counted: the last :func:`remove_lean_hook_calls` puts Lightning's functions back."""
    global _hook_users
    from lightning.pytorch.profilers import PassThroughProfiler

    if trainer is None or type(getattr(trainer, "profiler", None)) is not PassThroughProfiler:
        return False
    if not lean_log_supported()[0]:
        return False
    replacements = _replacements()
    if not all(callable(getattr(module, name, None)) for module, name, _ in replacements):
        return False
    if _hook_users == 0:
        for module, name, lean in replacements:
            _lightning_hooks.setdefault(name, getattr(module, name))
            setattr(module, name, lean)
        _install_identity_first_eq()
    _hook_users += 1
    trainer.__dict__[_LEAN_FLAG] = True
    return True


def remove_lean_hook_calls(trainer: Any) -> None:
    """Undo one :func:`install_lean_hook_calls`."""
    global _hook_users
    if trainer is not None:
        trainer.__dict__.pop(_LEAN_FLAG, None)
    if _hook_users == 0:
        return
    _hook_users -= 1
    if _hook_users == 0:
        for module, name, _ in _replacements():
            setattr(module, name, _lightning_hooks[name])
        _lightning_hooks.clear()
        _remove_identity_first_eq()
