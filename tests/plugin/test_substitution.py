"""Substitution keeps state_dict keys, trains like eager, compiles without graph breaks, and undoes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kernels.fused_norm import FusedBatchNormAct
from kernels.tolerances import tolerance
from lightning_plugin.substitution import KNOWN_SUBSTITUTIONS, apply_substitutions, undo_substitutions


def _stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )


def test_state_dict_keys_identical_and_undo() -> None:
    model = _stack()
    keys = list(model.state_dict())
    report = apply_substitutions(model, frozenset({"bn_act"}))
    assert [r.path for r in report.replacements] == ["1", "4"]
    assert isinstance(model[1], FusedBatchNormAct) and model[1].activation == "relu"
    assert list(model.state_dict()) == keys
    assert "FusedBatchNormAct" in report.summary()
    undo_substitutions(model, report)
    assert type(model[1]) is nn.BatchNorm2d and type(model[2]) is nn.ReLU
    assert list(model.state_dict()) == keys


def test_training_matches_eager() -> None:
    eager = _stack()
    fused = copy.deepcopy(eager)
    apply_substitutions(fused, frozenset({"bn_act"}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, fused)]
    x, y = torch.randn(4, 3, 9, 9), torch.randint(0, 3, (4,))
    atol, rtol = tolerance("norm", torch.float32)
    for _ in range(3):
        losses = []
        for m, opt in zip((eager, fused), opts):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], abs=atol, rel=rtol)
    for (k, a), (_, b) in zip(eager.state_dict().items(), fused.state_dict().items()):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=f"mismatch in {k}")


def test_fullgraph_compile_has_no_graph_breaks() -> None:
    model = _stack()
    apply_substitutions(model, frozenset({"bn_act"}))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out = compiled(torch.randn(2, 3, 7, 7))
    assert out.shape == (2, 3)


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown substitutions"):
        apply_substitutions(_stack(), frozenset({"bogus"}))
    assert "bn_act" in KNOWN_SUBSTITUTIONS


def test_from_module_rejects_non_bn() -> None:
    with pytest.raises(TypeError, match="BatchNorm2d"):
        FusedBatchNormAct.from_module(nn.ReLU(), nn.ReLU())  # type: ignore[arg-type]


def test_eval_mode_matches_batchnorm() -> None:
    bn = nn.BatchNorm2d(5)
    bn.train()(torch.randn(2, 5, 3, 3))
    fused = FusedBatchNormAct.from_module(copy.deepcopy(bn), nn.ReLU()).eval()
    x = torch.randn(2, 5, 4, 4)
    torch.testing.assert_close(fused(x), torch.relu(bn.eval()(x)))
