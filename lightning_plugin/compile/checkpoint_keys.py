"""Checkpoint keys free of ``_orig_mod.``, whatever the user compiled themselves.

A user who writes ``self.net = torch.compile(self.net)`` gets ``net._orig_mod.*`` keys,
which an eager module cannot load (Lightning #17415). The compiled strategies save
clean keys and accept both spellings on load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

COMPILE_PREFIX = "_orig_mod."


def strip_compile_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop every ``_orig_mod.`` component from the keys."""
    return {key.replace(COMPILE_PREFIX, ""): value for key, value in state_dict.items()}


def align_to_module(state_dict: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """Rename clean or prefixed keys to the spelling ``module.state_dict()`` uses."""
    expected = {key.replace(COMPILE_PREFIX, ""): key for key in module.state_dict()}
    aligned: dict[str, Any] = {}
    for key, value in state_dict.items():
        clean = key.replace(COMPILE_PREFIX, "")
        aligned[expected.get(clean, key)] = value
    return aligned
