"""The `TorchCompile` callback gives the strategy's compilation to any strategy."""

from __future__ import annotations

import lightning as L
import pytest

from boring import TRAINER_KWARGS, TinyModule, make_loader
from lightning_plugin.callbacks.compile import TorchCompile


def test_callback_compiles_and_restores_under_the_default_strategy():
    callback = TorchCompile(backend="aot_eager")
    module = TinyModule()
    L.Trainer(callbacks=[callback], **TRAINER_KWARGS).fit(module, make_loader())
    assert callback.compile_stats.graphs >= 1
    assert callback.compile_stats.graph_breaks == 0
    assert "forward" not in module.__dict__


def test_callback_refuses_to_double_compile_under_the_compiled_strategy():
    trainer = L.Trainer(strategy="compiled", callbacks=[TorchCompile(backend="aot_eager")], **TRAINER_KWARGS)
    with pytest.raises(ValueError, match="already compiles the module"):
        trainer.fit(TinyModule(), make_loader())


def test_callback_rejects_unknown_settings():
    with pytest.raises(TypeError, match=r"unknown compile setting\(s\) \['fast'\]"):
        TorchCompile(fast=True)
    with pytest.raises(ValueError, match="mode='turbo'"):
        TorchCompile(mode="turbo")
