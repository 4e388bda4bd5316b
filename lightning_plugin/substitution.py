"""Rewrite a model in place so BatchNorm2d -> activation chains run as our fused modules.

Module-level rewrite (not an Inductor pattern pass): it keeps parameter names and state_dict keys,
works in eager and compiled mode alike, and is trivially undone at teardown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

KNOWN_SUBSTITUTIONS: tuple[str, ...] = ("conv_bn_act", "bn_act", "groupnorm_act", "layernorm2d_act")


@dataclass
class Replacement:
    path: str
    kind: str
    description: str
    originals: dict[str, nn.Module] = field(default_factory=dict, repr=False)


@dataclass
class SubstitutionReport:
    replacements: list[Replacement]

    def summary(self) -> str:
        """A table of replaced blocks for the fit-start log."""
        if not self.replacements:
            return "no kernel substitutions applied"
        width = max(len(r.path) for r in self.replacements)
        lines = [f"{'path'.ljust(width)}  kind     description"]
        lines += [f"{r.path.ljust(width)}  {r.kind.ljust(7)}  {r.description}" for r in self.replacements]
        return "\n".join(lines)


def apply_substitutions(module: nn.Module, kinds: frozenset[str]) -> SubstitutionReport:
    """Replace fusable chains in place; returns what was replaced. Unknown kinds raise."""
    unknown = set(kinds) - set(KNOWN_SUBSTITUTIONS)
    if unknown:
        raise ValueError(f"unknown substitutions {sorted(unknown)}; known: {KNOWN_SUBSTITUTIONS}")
    report = SubstitutionReport([])
    if "bn_act" in kinds:
        from kernels.fused_norm import FusedBatchNormAct, activation_name

        for name, parent in list(module.named_modules()):
            if not isinstance(parent, nn.Sequential):
                continue
            keys = list(parent._modules)
            for a, b in zip(keys, keys[1:]):
                bn, act = parent._modules[a], parent._modules[b]
                if type(bn) is nn.BatchNorm2d and act is not None and activation_name(act) not in (None, "none"):
                    parent._modules[a] = FusedBatchNormAct.from_module(bn, act)
                    parent._modules[b] = nn.Identity()
                    prefix = f"{name}." if name else ""
                    report.replacements.append(Replacement(
                        f"{prefix}{a}", "bn_act", f"BatchNorm2d + {type(act).__name__} -> FusedBatchNormAct",
                        {a: bn, b: act}))
    return report


def undo_substitutions(module: nn.Module, report: SubstitutionReport) -> None:
    """Put the original modules back (they share parameters with the fused ones, so training carries over)."""
    for rep in reversed(report.replacements):
        parent_path = rep.path.rpartition(".")[0]
        parent = module.get_submodule(parent_path) if parent_path else module
        for key, original in rep.originals.items():
            parent._modules[key] = original
    report.replacements.clear()
