"""`CompileConfig` rejects bad values with messages that name the field."""

from __future__ import annotations

import pytest
import torch

from lightning_plugin import CompileConfig, CompiledStrategy


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": "nope"}, ValueError, r"backend='nope' is not a registered"),
        ({"backend": ""}, ValueError, "must be a backend name or a callable"),
        ({"backend": 3}, ValueError, "must be a backend name or a callable"),
        ({"mode": "fastest"}, ValueError, r"mode='fastest' is not one of"),
        ({"mode": "max-autotune", "backend": "aot_eager"}, ValueError, "needs backend='inductor'"),
        ({"fullgraph": "yes"}, TypeError, "fullgraph must be a bool"),
        ({"channels_last": 1}, TypeError, "channels_last must be a bool"),
        ({"compile_eval": None}, TypeError, "compile_eval must be a bool"),
        ({"regional": "true"}, TypeError, "regional must be a bool"),
        ({"tune_cpu": "no"}, TypeError, "tune_cpu must be a bool"),
        ({"dynamic": "auto"}, TypeError, "dynamic must be None, True or False"),
        ({"options": ["shape_padding"]}, TypeError, "options must be a dict"),
        ({"options": {1: True}}, TypeError, "options must be a dict with str keys"),
        (
            {"mode": "max-autotune", "options": {"shape_padding": True}},
            ValueError,
            "either `mode` or `options`",
        ),
        ({"fallback": "ignore"}, ValueError, r"fallback='ignore' is not one of"),
        ({"kernels": "conv"}, ValueError, r"unknown substitution\(s\) \['conv'\]"),
        (
            {"kernels": ["batch_norm_act", "fast_conv"]},
            ValueError,
            r"unknown substitution\(s\) \['fast_conv'\]",
        ),
        ({"kernels": ["bn_act"]}, ValueError, r"'bn_act' is now called 'batch_norm_act'"),
        ({"kernels": 5}, TypeError, "kernels must be a string or a list"),
    ],
)
def test_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        CompileConfig(**kwargs)
    with pytest.raises(error, match=match):  # the strategy's keywords go through the same checks
        CompiledStrategy(**kwargs)


def test_good_values_round_trip():
    config = CompileConfig(
        mode="max-autotune", fullgraph=True, dynamic=False, kernels=["batch_norm_act"], regional=True
    )
    assert config.resolve_kernels(torch.device("cpu")) == frozenset({"batch_norm_act"})
    assert config.compile_kwargs() == {"fullgraph": True, "dynamic": False}
    assert config.replace(mode=None).mode is None
    with pytest.raises(ValueError, match="mode='bad'"):
        config.replace(mode="bad")
    assert CompileConfig(kernels="none").resolve_kernels(torch.device("cuda")) == frozenset()
