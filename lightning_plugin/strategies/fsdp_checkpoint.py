"""A sharded checkpoint (a folder of ``torch.distributed.checkpoint`` shards) as one plain Lightning checkpoint.

Why: ``compiled_fsdp`` saves each rank's shards, which only a distributed load reads. The consolidated file
holds the full tensors in the layout every other path reads: ``Trainer(strategy="compiled", ckpt_path=...)``,
``LightningModule.load_from_checkpoint`` and ``lcv export``. Nothing here needs a process group, so it runs in
a plain process (``python -m lightning_plugin.strategies.fsdp_checkpoint SHARDED OUT.ckpt``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

#: Written by Lightning's ``ModelParallelStrategy`` beside the shards: everything but weights and optimizers.
METADATA_FILE = "meta.pt"


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A folder written by ``torch.distributed.checkpoint`` (it has the ``.metadata`` file)."""
    return (Path(path) / ".metadata").is_file()


def consolidate_checkpoint(
    sharded: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """The full checkpoint of a sharded one; written atomically to ``output`` when given.

    Optimizer states are keyed by parameter name in the shards; here they are keyed by position, as
    ``torch.optim.Optimizer.state_dict`` keys them, so a plain optimizer loads them.
    """
    path = Path(sharded)
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a sharded checkpoint folder (no .metadata file)")
    with tempfile.TemporaryDirectory() as tmp:
        full_file = Path(tmp) / "full.pt"
        dcp_to_torch_save(path, full_file)
        full = torch.load(full_file, map_location="cpu", weights_only=False)
    meta_file = path / METADATA_FILE
    checkpoint: dict[str, Any] = torch.load(meta_file, weights_only=False) if meta_file.is_file() else {}
    checkpoint["state_dict"] = full.pop("state_dict")
    optimizers = sorted((k for k in full if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        checkpoint["optimizer_states"] = [positional_optimizer_state(full[k]) for k in optimizers]
    if output is not None:
        save_atomically(checkpoint, Path(output))
    return checkpoint


def positional_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``) keyed by position instead."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` to a sibling file, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    torch.save(obj, partial)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=consolidate_checkpoint.__doc__)
    parser.add_argument("sharded", help="the checkpoint folder compiled_fsdp wrote")
    parser.add_argument("output", help="the consolidated checkpoint file to write")
    args = parser.parse_args(argv)
    consolidate_checkpoint(args.sharded, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
