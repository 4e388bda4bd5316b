"""One compiled graph for a whole training step: forward, backward and the optimizer update (``compile_step``).

The compiled strategies normally compile the forward; Lightning's loop then runs the backward (AOTAutograd's
compiled backward) and the optimizer step (the fused or foreach kernels) as separate calls, each with its own
host work between them. With ``CompileConfig(compile_step=True)`` the strategy replaces Lightning's
automatic-optimization step for the fit: dynamo traces ``training_step``, ``loss.backward()`` (which it can
trace since ``torch._dynamo.config.trace_autograd_ops``), gradient clipping and the optimizer's update
(``torch.optim``'s own functional SGD/Adam/AdamW, so the maths is the optimizer's) into **one** graph, compiled
with the strategy's backend. What the step does is Lightning's, in Lightning's order:

- gradients are set to None at the first batch of each accumulation window (``on_before_zero_grad`` and
  ``optimizer_zero_grad`` run just before the step, not after ``training_step``);
- the loss is divided by ``accumulate_grad_batches``; batches inside a window run a graph without the update;
- ``on_before_backward``/``on_after_backward``/``on_before_optimizer_step`` of the LightningModule run inside
  the graph, then the trainer's ``gradient_clip_val``/``gradient_clip_algorithm``, then the update;
- ``self.log`` calls made in those places are recorded during the graph and handed to the module's ``log``
  right after it (the same keys, values and options, so loggers, the progress bar and checkpoint monitors see
  what they see without this option);
- the learning rate goes in as a tensor filled from the param group each step, so an LR schedule never
  recompiles; the optimizer's ``state_dict`` stays the optimizer's own.

What cannot be captured falls back, with one line saying why: before the fit (manual optimization, several
optimizers, an optimizer other than SGD/Adam/AdamW, AMSGrad, 16-bit precision with a grad scaler, an
overridden ``backward``/``optimizer_step``/``optimizer_zero_grad``/``configure_gradient_clipping``, a callback
implementing a hook that runs between backward and the update, more than one process), at the first step
(a graph break: anything dynamo cannot put in one graph), and after the third step of a step that recompiles
every time (a Python number read by the step that changes each step, such as a ``torchmetrics`` Metric's
update count). The fallback is the strategy's usual compiled forward.

Lightning's automatic-optimization loop is private API: the step is used only on the Lightning versions the
lean logging was tested on (:data:`lightning_plugin.fast_step.TESTED_LIGHTNING`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core import LightningModule
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim import optimizer as optimizer_module
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update

from lightning_plugin.compile import dynamo_cache
from lightning_plugin.compile.stats import CompileStats, CountingBackend
from lightning_plugin.fast_step import lean_log_supported

__all__ = ["UNSUPPORTED_MODULE_HOOKS", "TRACED_HOOKS", "WholeStep", "whole_step_unsupported"]

#: LightningModule methods whose override takes the step out of one graph (they receive closures, or replace
#: the parts the graph does itself).
UNSUPPORTED_MODULE_HOOKS: tuple[str, ...] = (
    "backward",
    "optimizer_step",
    "optimizer_zero_grad",
    "configure_gradient_clipping",
)
#: Hooks that run inside the graph when the LightningModule overrides them (a callback implementing one is a
#: reason to fall back: a callback sees the trainer, which dynamo does not trace).
TRACED_HOOKS: tuple[str, ...] = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")

#: Graphs allowed per distinct step (accumulating or updating, clip settings, ...): its first and one recompile
#: (dynamo makes a changed batch size dynamic); more means something recompiles every step.
GRAPHS_PER_PLAN = 2

_SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (SGD, Adam, AdamW)


def _overrides(obj: Any, base: type, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def whole_step_unsupported(trainer: Any, module: Any, world_size: int = 1) -> str | None:
    """Why this fit's step cannot be one graph, in one phrase; None when it can (judged before the first step)."""
    supported, why = lean_log_supported()
    if not supported:
        return why
    if world_size != 1:
        return f"it runs on one device only (world size {world_size})"
    if not isinstance(module, LightningModule):
        return (
            "the module is not a lightning.pytorch LightningModule (the standalone pytorch_lightning package)"
        )
    if not getattr(module, "automatic_optimization", False):
        return "the LightningModule uses manual optimization"
    overridden = [name for name in UNSUPPORTED_MODULE_HOOKS if _overrides(module, LightningModule, name)]
    if overridden:
        return f"{type(module).__name__} overrides {', '.join(overridden)}"
    callbacks = [
        f"{type(cb).__name__}.{hook}"
        for cb in getattr(trainer, "callbacks", [])
        for hook in TRACED_HOOKS
        if _overrides(cb, Callback, hook)
    ]
    if callbacks:
        return f"a callback runs between backward and the update ({', '.join(callbacks)})"
    optimizers = list(getattr(trainer, "optimizers", []))
    if len(optimizers) != 1:
        return f"it needs exactly one optimizer, the LightningModule has {len(optimizers)}"
    optimizer = optimizers[0]
    if type(optimizer) not in _SUPPORTED_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not one of SGD, Adam, AdamW"
    if _step_hooks(optimizer):
        return "the optimizer has step hooks (register_step_pre_hook/register_step_post_hook)"
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            return "Adam with amsgrad=True"
        if group.get("differentiable"):
            return "an optimizer with differentiable=True"
        if isinstance(optimizer, SGD) and group["momentum"] and group["dampening"]:
            return "SGD with dampening"  # its first step differs from later ones (a second graph)
    precision = _precision_kind(trainer.strategy.precision_plugin)
    if precision is None:
        return f"precision {getattr(trainer.strategy.precision_plugin, 'precision', '?')!r} (32 and bf16-mixed only)"
    loop = _automatic_loop(trainer)
    if loop is None:
        return "this Lightning has no automatic-optimization loop where the step expects one"
    return None


def _step_hooks(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` would run hooks (its own or the global ones) that the traced update skips."""
    own = getattr(optimizer, "_optimizer_step_pre_hooks", {}) or getattr(
        optimizer, "_optimizer_step_post_hooks", {}
    )
    return bool(
        own
        or getattr(optimizer_module, "_global_optimizer_pre_hooks", {})
        or getattr(optimizer_module, "_global_optimizer_post_hooks", {})
    )


def _precision_kind(plugin: Any) -> str | None:
    """'32' (no autocast), 'bf16-mixed' (autocast to bfloat16), or None (a grad scaler or another plugin)."""
    name = type(plugin).__name__
    precision = str(getattr(plugin, "precision", ""))
    if name == "Precision" and precision in ("32-true", "32"):
        return "32"
    if name == "MixedPrecision" and precision == "bf16-mixed" and getattr(plugin, "scaler", None) is None:
        return "bf16-mixed"
    return None


def _automatic_loop(trainer: Any) -> Any:
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    loop = getattr(epoch_loop, "automatic_optimization", None)
    needed = ("run", "optim_progress", "_on_before_zero_grad", "_optimizer_zero_grad", "output_result_cls")
    return loop if loop is not None and all(hasattr(loop, n) for n in needed) else None


@dataclass
class _LogRecorder:
    """Stands in for ``module.log`` while the step is traced: each call is kept for the real ``log`` after the
    graph (tensors detached, as Lightning's results store them)."""

    calls: list[tuple[str, str, Any, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    hook: str = "training_step"

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self.calls.append((self.hook, name, value, args, kwargs))


_RECORDER = _LogRecorder()


@dataclass(frozen=True)
class _StepPlan:
    """The constants of one traced step (dynamo specialises on them: one graph per distinct plan)."""

    normalize: int
    update: bool
    clip_val: float | None
    clip_algorithm: str
    autocast: torch.dtype | None
    device_type: str
    hooks: tuple[str, ...]
    settings: tuple[tuple[Any, ...], ...]  # each param group's settings but the learning rate


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, Mapping):
        return output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items()}
    return output


@dataclass
class _GroupTensors:
    """One param group's parameters and optimizer state, gathered once for the traced update (the optimizer
    object stays out of the graph: dynamo would guard on every setting of every group, the learning rate too)."""

    params: list[torch.Tensor]
    momentum_buffers: list[torch.Tensor | None]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]


def _group_tensors(optimizer: Optimizer) -> list[_GroupTensors]:
    groups = []
    for group in optimizer.param_groups:
        params = list(group["params"])
        state = [optimizer.state[p] for p in params]
        adam = not isinstance(optimizer, SGD)
        groups.append(
            _GroupTensors(
                params=params,
                momentum_buffers=[s.get("momentum_buffer") for s in state] if not adam else [],
                exp_avgs=[s["exp_avg"] for s in state] if adam else [],
                exp_avg_sqs=[s["exp_avg_sq"] for s in state] if adam else [],
                steps=[s["step"] for s in state] if adam else [],
            )
        )
    return groups


def _settings(optimizer: Optimizer) -> tuple[tuple[Any, ...], ...]:
    """Each group's settings other than the learning rate, as the traced update's constants."""
    if isinstance(optimizer, SGD):
        keys: tuple[str, ...] = ("weight_decay", "momentum", "dampening", "nesterov", "maximize")
        return tuple(("sgd", *(g[k] for k in keys)) for g in optimizer.param_groups)
    decoupled = isinstance(optimizer, AdamW)
    return tuple(
        (
            "adam",
            *g["betas"],
            g["weight_decay"],
            g["eps"],
            g["maximize"],
            bool(g.get("decoupled_weight_decay", decoupled)),
        )
        for g in optimizer.param_groups
    )


def _apply_update(
    groups: list[_GroupTensors], lrs: list[torch.Tensor], settings: tuple[tuple[Any, ...], ...]
) -> None:
    """``optimizer.step()``'s maths through torch's functional optimizers (the optimizer's own ``step`` refuses
    to be traced after a backward in the same graph)."""
    for tensors, lr, setting in zip(groups, lrs, settings, strict=True):
        chosen = [i for i, p in enumerate(tensors.params) if p.grad is not None]
        if not chosen:
            continue
        params = [tensors.params[i] for i in chosen]
        grads = [g for g in (p.grad for p in params) if g is not None]
        if setting[0] == "sgd":
            _, weight_decay, momentum, dampening, nesterov, maximize = setting
            sgd_update(
                params,
                grads,
                [tensors.momentum_buffers[i] for i in chosen],
                foreach=False,
                weight_decay=weight_decay,
                momentum=momentum,
                lr=lr,
                dampening=dampening,
                nesterov=nesterov,
                maximize=maximize,
            )
        else:
            _, beta1, beta2, weight_decay, eps, maximize, decoupled = setting
            adam_update(
                params,
                grads,
                [tensors.exp_avgs[i] for i in chosen],
                [tensors.exp_avg_sqs[i] for i in chosen],
                [],
                [tensors.steps[i] for i in chosen],
                foreach=False,
                capturable=params[0].device.type != "cpu",
                decoupled_weight_decay=decoupled,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
            )


def _init_state(optimizer: Optimizer) -> None:
    """Create the optimizer state its first ``step`` would create, with the values that step would leave
    (zero moments; an SGD momentum buffer of zeros makes the first step ``buf = grad``, as torch's does)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, SGD):
                if group["momentum"] and state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif "step" not in state:
                on_cpu = p.device.type == "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device="cpu" if on_cpu else p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif p.device.type != "cpu" and state["step"].device != p.device:
                # The traced update runs Adam's capturable branch off the CPU, which wants its step counts on
                # the parameters' device (a resumed state keeps them on the CPU); torch's own step reads either.
                state["step"] = state["step"].to(p.device)


def _train_step(
    module: Any,
    optimizer: Optimizer | None,
    groups: list[_GroupTensors],
    recorder: _LogRecorder,
    lrs: list[torch.Tensor],
    args: tuple[Any, ...],
    plan: _StepPlan,
) -> Any:
    """The traced step. Runs under ``no_grad`` (so AOTAutograd sees one inference graph) and turns grad mode on
    for the forward and backward only."""
    with torch.enable_grad():
        recorder.hook = "training_step"
        if plan.autocast is not None:
            with torch.autocast(plan.device_type, dtype=plan.autocast):
                output = module.training_step(*args)
        else:
            output = module.training_step(*args)
        loss = _loss_of(output)
        if loss is not None:
            closure_loss = loss / plan.normalize
            if "on_before_backward" in plan.hooks:
                recorder.hook = "on_before_backward"
                module.on_before_backward(closure_loss)
            closure_loss.backward()
            if "on_after_backward" in plan.hooks:
                recorder.hook = "on_after_backward"
                module.on_after_backward()
    if loss is not None and plan.update:
        if "on_before_optimizer_step" in plan.hooks:
            recorder.hook = "on_before_optimizer_step"
            module.on_before_optimizer_step(optimizer)
        if plan.clip_val is not None and plan.clip_val > 0:
            params = [p for tensors in groups for p in tensors.params]
            if plan.clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, plan.clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, plan.clip_val)
        _apply_update(groups, lrs, plan.settings)
    return _detached(output)


class WholeStep:
    """Runs each automatic-optimization step of a fit as one compiled graph (see the module docstring).

    ``backend`` is the strategy's counting backend (its graphs show in the strategy's compile stats);
    ``use_graph`` says per step whether to run the graph (False: Lightning's own step, for ``compile="auto"``'s
    eager samples); ``after_step`` runs after each step (the auto decision's clock); ``on_fallback`` is told why
    the graph could not be built, once."""

    def __init__(
        self,
        backend: CountingBackend,
        stats: CompileStats,
        dynamic: bool | None,
        use_graph: Callable[[], bool],
        after_step: Callable[[], None],
        on_fallback: Callable[[str], None],
    ) -> None:
        # Entries an earlier fit left with other settings would count towards dynamo's recompile limit.
        reused = dynamo_cache.prepare(dynamo_cache.code_of(_train_step), backend)
        stats.start(reused_frames=reused)
        self._compiled = torch.compile(_train_step, backend=backend, fullgraph=True, dynamic=dynamic)
        self._stats = stats
        self._plans: set[_StepPlan] = set()
        self._use_graph = use_graph
        self._after_step = after_step
        self._on_fallback = on_fallback
        self._recorder = _RECORDER  # one object for every fit: dynamo guards on its identity
        self._recorder.calls.clear()
        self._lrs: list[torch.Tensor] = []
        self._groups: list[_GroupTensors] = []
        self._loop: Any = None
        self._trainer: Any = None
        self._failed = False

    @property
    def installed(self) -> bool:
        return self._loop is not None

    @property
    def host_scalars(self) -> tuple[torch.Tensor, ...]:
        """The CPU scalars the graph takes each step (the learning rates). They stay on the CPU whatever the
        device, and dynamo's guards read their values before each call (``not isnan(lr)``): a read of host
        memory, not a wait for the device."""
        return tuple(self._lrs)

    def install(self, trainer: Any) -> None:
        """Take over the fit's automatic-optimization step (an instance attribute shadowing ``run``)."""
        self._trainer = trainer
        self._loop = _automatic_loop(trainer)
        optimizer = trainer.optimizers[0]
        self._lrs = [torch.zeros((), dtype=torch.float64) for _ in optimizer.param_groups]
        self._loop.run = self.run

    def remove(self) -> None:
        if self._loop is not None:
            self._loop.__dict__.pop("run", None)
        self._loop = None
        self._trainer = None

    def run(self, optimizer: Optimizer, batch_idx: int, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        loop, trainer = self._loop, self._trainer
        if self._failed or loop._skip_backward or not self._use_graph():
            return type(loop).run(loop, optimizer, batch_idx, kwargs)
        module = trainer.lightning_module
        accumulate = trainer.accumulate_grad_batches
        update = not trainer.fit_loop._should_accumulate()
        if not self._groups:
            _init_state(optimizer)
            self._groups = _group_tensors(optimizer)
        if batch_idx % accumulate == 0:
            loop._on_before_zero_grad(optimizer)
            loop._optimizer_zero_grad(batch_idx, optimizer)
        lrs = []  # a tensor learning rate is used as it is; a number fills a CPU scalar (neither waits for a device)
        for scalar, group in zip(self._lrs, optimizer.param_groups, strict=True):
            value = group["lr"]
            lrs.append(value if isinstance(value, torch.Tensor) else scalar.fill_(value))
        plan = self._plan(trainer, module, accumulate, update)
        if update:
            loop.optim_progress.optimizer.step.increment_ready()
        try:
            output = self._call(module, optimizer, tuple(kwargs.values()), plan, lrs)
        except torch._dynamo.exc.TorchDynamoException as err:
            if self._stats.one_graph_steps:
                raise
            self._failed = True
            progress = loop.optim_progress.optimizer  # Lightning's step below counts this batch again
            if update:
                _uncount(progress.step, "ready")
            if batch_idx % accumulate == 0:
                _uncount(progress.zero_grad, "ready", "started", "completed")
            self._on_fallback(_first_line(err))
            return type(loop).run(loop, optimizer, batch_idx, kwargs)
        self._stats.one_graph_steps += 1
        self._plans.add(plan)
        if self._stats.graphs > GRAPHS_PER_PLAN * len(self._plans):
            reasons = self._stats.recompile_reasons
            self._failed = True
            self._on_fallback(
                "it recompiled at every step"
                + (f", last because {reasons[-1]}" if reasons else "")
                + " (a Python number that changes each step, such as a torchmetrics Metric's update count, is "
                "part of the graph's guards)"
            )
        if update:
            optimizer._opt_called = True  # type: ignore[attr-defined]  # what step()'s LR-scheduler wrapper records
            loop.optim_progress.optimizer.step.increment_completed()
        self._after_step()
        result = loop.output_result_cls.from_training_step_output(output, accumulate)
        return {} if result.loss is None else result.asdict()

    def _plan(self, trainer: Any, module: Any, accumulate: int, update: bool) -> _StepPlan:
        plugin = trainer.strategy.precision_plugin
        clip_val = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm
        return _StepPlan(
            normalize=accumulate,
            update=update,
            clip_val=float(clip_val) if clip_val is not None else None,
            clip_algorithm=str(getattr(algorithm, "value", algorithm) or "norm"),
            autocast=torch.bfloat16 if _precision_kind(plugin) == "bf16-mixed" else None,
            device_type=trainer.strategy.root_device.type,
            hooks=tuple(h for h in TRACED_HOOKS if _overrides(module, LightningModule, h)),
            settings=_settings(trainer.optimizers[0]),
        )

    def _call(
        self,
        module: Any,
        optimizer: Optimizer,
        args: tuple[Any, ...],
        plan: _StepPlan,
        lrs: list[torch.Tensor],
    ) -> Any:
        recorder = self._recorder
        had_log = "log" in module.__dict__
        previous_log = module.__dict__.get("log")
        module.__dict__["log"] = recorder
        try:
            watch = self._stats.watch_frames()
            with torch.no_grad(), torch._dynamo.config.patch(trace_autograd_ops=True):
                hook_optimizer = optimizer if "on_before_optimizer_step" in plan.hooks else None
                output = self._compiled(module, hook_optimizer, self._groups, recorder, lrs, args, plan)
            self._stats.collect_frames(watch)
        finally:
            if had_log:
                module.__dict__["log"] = previous_log
            else:
                module.__dict__.pop("log", None)
        self._replay_logs(module)
        return output

    def _replay_logs(self, module: Any) -> None:
        calls = self._recorder.calls
        if not calls:
            return
        previous = module._current_fx_name
        try:
            for hook, name, value, args, kwargs in calls:
                module._current_fx_name = hook
                module.log(name, value, *args, **kwargs)
        finally:
            module._current_fx_name = previous
            calls.clear()


def _uncount(progress: Any, *fields: str) -> None:
    """Take back one count of ``fields`` from a Lightning ``_Progress`` (its total and its current)."""
    for tracker in (progress.total, progress.current):
        for name in fields:
            setattr(tracker, name, getattr(tracker, name) - 1)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
