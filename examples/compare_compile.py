"""Eager vs ``strategy="compiled"`` on the same recipe, same seed and same batches: prints the speed ratio.

    python examples/compare_compile.py                                  # digits-small, CPU ok
    python examples/compare_compile.py --recipe cifar10-airbench --data-root data/ --steps 100
    python examples/compare_compile.py --smoke                          # tiny, backend "eager" (what the test
    runs)

Each mode trains ``--steps`` steps ``--repeats`` times (alternating eager, compiled, eager, ...), each time
with a fresh module. Reported per mode: the median step time after ``--warmup`` steps (steady state), the
first step (which includes compiling), and the whole run; then eager / compiled ratios (> 1 = compiled
is faster). The device is synchronised before every clock read. Medians are over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="digits-small")
    p.add_argument("--data-root", default=None, help="CIFAR-10 / ImageFolder root for recipes that need one")
    p.add_argument("--zip", default=None, help="CIFAR-10 JPEG zip (cifar10 recipes)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the steady-state median")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled runs")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--smoke", action="store_true", help="2 steps of a tiny model, backend 'eager'")
    return p.parse_args(argv)


class StepTimer:
    """Lightning callback: wall time of every training step (batch start to batch end),
    device-synchronised."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        outer = self

        class _Callback(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                outer._sync(trainer)
                outer._start = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                outer._sync(trainer)
                outer.steps.append(time.perf_counter() - outer._start)

        self.callback = _Callback()
        self.steps: list[float] = []
        self._start = 0.0

    @staticmethod
    def _sync(trainer: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)


def run_once(args: argparse.Namespace, compiled: bool) -> dict[str, float]:
    import lightning.pytorch as pl

    import lightning_plugin  # noqa: F401
    from lcv_vision.recipes import build, get_recipe
    from lightning_plugin import CompiledStrategy

    recipe = get_recipe(args.recipe, batch_size=args.batch_size)
    data: dict = {"root": args.data_root, "zip_path": args.zip}
    model: dict = {}
    if args.smoke:
        data = {"batch_size": 16, "image_size": 16}
        model = {"model_kwargs": {"widths": [8, 8, 8]}, "whitening_images": 32}
    pl.seed_everything(0)
    torch._dynamo.reset()
    module, datamodule = build(recipe, data=data, model=model)
    timer = StepTimer()
    gpu = torch.cuda.is_available()
    if compiled:  # compile="always": with "auto" a compiled side measured slower would switch to eager
        strategy: Any = CompiledStrategy(
            **{
                **recipe.compile,
                "backend": args.backend,
                "compile": "always",
                **({} if args.backend == "inductor" else {"mode": None}),
            }
        )
    else:
        strategy = "auto"
    trainer = pl.Trainer(
        strategy=strategy,
        precision=recipe.precision if gpu else "32-true",
        max_epochs=-1,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer.callback],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule)
    total = time.perf_counter() - start
    steady = timer.steps[args.warmup :] or timer.steps[-1:]
    return {
        "steady_ms": 1000 * statistics.median(steady),
        "first_step_s": timer.steps[0],
        "total_s": total,
        "steps": len(timer.steps),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.backend = 2, 1, 1, "eager"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.warmup >= args.steps:
        raise SystemExit(f"compare_compile: --warmup ({args.warmup}) must be below --steps ({args.steps})")
    runs: dict[str, list[dict[str, float]]] = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for mode in ("eager", "compiled"):
            runs[mode].append(run_once(args, compiled=mode == "compiled"))
    summary = {
        mode: {k: statistics.median(r[k] for r in results) for k in results[0]}
        for mode, results in runs.items()
    }
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(
        f"{args.recipe} on {device}, {args.steps} steps x {args.repeats} runs per mode "
        f"(backend {args.backend!r}, torch threads {torch.get_num_threads()}):"
    )
    for mode, s in summary.items():
        print(
            f"  {mode:8s} steady step {s['steady_ms']:8.2f} ms   first step {s['first_step_s']:7.2f} s   "
            f"whole run {s['total_s']:7.2f} s"
        )
    ratios = {
        "steady": summary["eager"]["steady_ms"] / summary["compiled"]["steady_ms"],
        "whole_run": summary["eager"]["total_s"] / summary["compiled"]["total_s"],
    }
    print(
        f"  eager / compiled: steady-state {ratios['steady']:.2f}x, whole run {ratios['whole_run']:.2f}x "
        "(> 1: compiled is faster)"
    )
    return {"summary": summary, "ratios": ratios, "runs": runs}


if __name__ == "__main__":
    main()
