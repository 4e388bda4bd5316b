"""The module paths from before the plugin's folders still import, warn, and give the same objects."""

from __future__ import annotations

import importlib
import sys

import pytest

from lightning_plugin._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_forwards(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public
    for name in public:
        assert getattr(module, name) is getattr(new, name)


def test_the_documented_imports_are_unchanged():
    import lightning_plugin
    from lightning_plugin import CompileConfig, CompiledDDPStrategy, CompileStats, callbacks
    from lightning_plugin.strategy import CompiledStrategy

    assert CompiledStrategy is lightning_plugin.CompiledStrategy
    assert CompiledDDPStrategy.__module__ == "lightning_plugin.strategies.ddp"
    assert CompileConfig.__module__ == "lightning_plugin.config" and CompileStats.__module__.endswith("stats")
    assert hasattr(callbacks, "TrainingMonitor")
