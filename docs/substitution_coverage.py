"""How much of common vision models the kernel substitution rewrites, and what stays eager and why.

Run with the project's environment (no GPU, no network: models are built without pretrained weights):

    python docs/substitution_coverage.py

For each model it applies every kernel (``kernels="all"``) and prints a Markdown table: modules rewritten,
norms that run a fused kernel (by kernel) out of all norm layers, and grouped reasons for the rest: norms
that stay eager, and BatchNorms that run ``batch_norm_act`` because their conv cannot be fused into them.
Nothing runs a forward; this counts the plan. timm models are skipped when timm is not installed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import torchvision
from torch import nn

from lightning_plugin import KNOWN_KERNELS
from lightning_plugin.kernel_choice.substitution import SubstitutionReport, apply_substitutions, planned_norms

NORM_BASES = (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False)

    return build


MODELS: dict[str, Callable[[], nn.Module]] = {
    "torchvision resnet50": torchvision.models.resnet50,
    "torchvision efficientnet_b0": torchvision.models.efficientnet_b0,
    "torchvision convnext_tiny": torchvision.models.convnext_tiny,
    "torchvision regnet_y_400mf": torchvision.models.regnet_y_400mf,
    "timm resnet50": _timm("resnet50"),
    "timm efficientnet_b0": _timm("efficientnet_b0"),
    "timm convnext_nano": _timm("convnext_nano"),
}


def _general(reason: str) -> str:
    """A reason without its per-layer numbers, so equal causes group together."""
    return re.sub(r" \(groups=\d+\)", "", reason)


def _chain_reasons(model: nn.Module, report: SubstitutionReport) -> dict[str, str]:
    """Each skipped chain's reason by its norm's path (the report joins a block's as ``norm: why; ...``)."""
    root = type(model).__name__
    reasons = {}
    for label, joined in report.skipped:
        block = "" if label == root else label
        for part in joined.split("; "):
            norm, _, why = part.partition(": ")
            reasons[".".join(p for p in (block, "" if norm == "self" else norm) if p)] = why
    return reasons


def _owner(model: nn.Module, path: str) -> nn.Module:
    """The nearest ancestor of ``path`` that is not a Sequential: the block the norm belongs to."""
    parts = path.split(".")[:-1]
    while parts and isinstance(model.get_submodule(".".join(parts)), nn.Sequential):
        parts.pop()
    return model.get_submodule(".".join(parts))


def coverage(model: nn.Module) -> dict[str, object]:
    report = apply_substitutions(model, frozenset(KNOWN_KERNELS))
    modes = planned_norms(model)
    reasons = _chain_reasons(model, report)
    norms = {p: m for p, m in model.named_modules() if isinstance(m, NORM_BASES)}
    fused = Counter(mode for p, mode in modes.items() if p in norms and mode != "eager")
    eager: Counter = Counter()
    conv_eager: Counter = Counter()
    for path, norm in norms.items():
        mode = modes.get(path, "eager")
        why = reasons.get(path)
        owner = type(_owner(model, path)).__name__
        if mode == "eager":
            unseen = f"{type(norm).__name__} in {owner}, not registered"
            eager[f"{_general(why)} (in {owner})" if why else unseen] += 1
        elif why is not None:  # fused, but its conv runs as is
            conv_eager[_general(why.removeprefix("conv stays eager (").removesuffix(")"))] += 1
    return {
        "rewritten": len(report.replacements),
        "norms": len(norms),
        "fused": fused,
        "eager": eager,
        "conv_eager": conv_eager,
    }


def _counts(counter: Counter) -> str:
    return "; ".join(f"{n}× {what}" for what, n in counter.most_common()) or "–"


def main() -> None:
    columns = ["model", "modules rewritten", "norms fused / all (by kernel)", "conv left out of its BN"]
    print("| " + " | ".join([*columns, "norms eager"]) + " |")
    print("|---|---|---|---|---|")
    for name, build in MODELS.items():
        try:
            model = build()
        except ImportError:
            print(f"| {name} | (not installed) | | | |")
            continue
        c = coverage(model)
        total = sum(c["fused"].values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(c["fused"].items()))
        print(
            f"| {name} | {c['rewritten']} | {total} / {c['norms']} ({kinds}) | {_counts(c['conv_eager'])} "
            f"| {_counts(c['eager'])} |"
        )


if __name__ == "__main__":
    main()
