"""Kernel substitution: identical state_dict keys, same training as eager, zero graph breaks, undo.

The fused ops run their Triton kernels in the interpreter here (``TRITON_INTERPRET=1`` from conftest),
except the torchvision ResNet-18 test, which runs on the op references (``TRITON_INTERPRET=0``) because
the interpreter is too slow for 64-512 channel convolutions; the kernels themselves are tested in
``tests/kernels``. Training checks use 16x16 inputs: at 8x8 the last stage normalises 2 values per channel,
which is so ill-conditioned that any two correct implementations drift apart within a few steps.
"""

from __future__ import annotations

import copy
import logging
import pickle

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from boring import TRAINER_KWARGS
from lcv_kernels.tolerances import bound, network_length, reduction_tolerance, tolerance, trajectory_tolerance
from lcv_vision.models.airbench import AirbenchNet
from lcv_vision.models.resnet import BasicBlock, Bottleneck, ResNet
from lightning_plugin import KNOWN_KERNELS, CompiledStrategy
from lightning_plugin.kernel_choice.substitution import (
    PLAN_ATTR,
    apply_substitutions,
    substituted_modules,
    undo_substitutions,
)

ALL = frozenset(KNOWN_KERNELS)


def tiny_resnet(block=BasicBlock) -> ResNet:
    return ResNet(block, (1, 1, 1, 1), num_classes=3, width=4, stem="cifar")


def _layernorm2d(c: int) -> nn.Module:
    return torchvision.models.convnext.LayerNorm2d(c, eps=1e-6)


def _stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2),
        nn.BatchNorm2d(4),
        nn.SiLU(),
        nn.GroupNorm(2, 4),
        nn.GELU(),
        _layernorm2d(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


@pytest.fixture
def reference_ops(monkeypatch):
    """Run the fused ops on their PyTorch references (fast on CPU) where a test is about the rewrite or the
    strategy, not the kernels (which ``test_tiny_resnet_trains_like_eager`` and tests/kernels cover)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _assert_close(a: torch.Tensor, b: torch.Tensor, family: str = "norm", msg: str = "") -> None:
    atol, rtol = tolerance(family, torch.float32)
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")


def _assert_loss_close(
    got: torch.Tensor, want: torch.Tensor, net: nn.Module, batch_shape: tuple[int, ...], step: int
) -> None:
    """The loss at 0-based ``step``: the forward after ``step`` updates, each carrying one reduction error."""
    atol, rtol = trajectory_tolerance(torch.float32, network_length(net, batch_shape), max(step, 1))
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"loss at step {step}: {m}")


@pytest.mark.parametrize(
    "make",
    [tiny_resnet, lambda: tiny_resnet(Bottleneck), lambda: AirbenchNet(widths=(4, 8, 8)), _stack],
    ids=["resnet_basic", "resnet_bottleneck", "airbench", "sequential"],
)
def test_state_dict_keys_identical_and_undo_restores_the_class_forwards(make):
    model = make()
    keys = list(model.state_dict())
    params = {k: p for k, p in model.named_parameters()}
    report = apply_substitutions(model, ALL)
    assert report.replacements and substituted_modules(model)
    assert list(model.state_dict()) == keys
    assert {k: p for k, p in model.named_parameters()} == params  # the same Parameter objects
    fresh = make()
    fresh.load_state_dict(model.state_dict())  # checkpoints stay interchangeable with eager models
    undo_substitutions(model, report)
    assert not report.replacements and not substituted_modules(model)
    for module in model.modules():
        assert not {"forward", "_forward_impl", "forward_features", PLAN_ATTR} & set(module.__dict__)


def test_plan_of_the_tiny_resnet_lists_every_block():
    model = tiny_resnet()
    report = apply_substitutions(model, ALL)
    paths = [r.path for r in report.replacements]
    assert paths == [
        "ResNet",
        "layer1.0",
        "layer2.0",
        "layer2.0.downsample",
        "layer3.0",
        "layer3.0.downsample",
        "layer4.0",
        "layer4.0.downsample",
    ]
    assert all(r.kind == "conv_bn_act" for r in report.replacements)
    summary = report.summary()
    assert "8 module(s) rewritten" in summary and "conv1+bn1+relu -> conv_bn_act" in summary
    assert "Sequential: 0+1 -> conv_bn_act" in summary


def test_tiny_resnet_trains_like_eager():
    torch.manual_seed(0)
    eager = tiny_resnet()
    fused = copy.deepcopy(eager)
    apply_substitutions(fused, ALL)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, fused)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([0, 2])
    for step in range(2):  # the second update is the first to read SGD's momentum buffer
        losses = []
        for model, opt in zip((eager, fused), opts, strict=True):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
        _assert_loss_close(losses[1], losses[0], eager, tuple(x.shape), step)
    for (name, a), b in zip(eager.state_dict().items(), fused.state_dict().values(), strict=True):
        _assert_close(b.float(), a.float(), "norm", name)
    eager.eval(), fused.eval()
    _assert_close(fused(x), eager(x), "norm", "eval logits")


@pytest.mark.parametrize("model", ["airbench", "bottleneck"])
def test_airbench_and_bottleneck_forward_backward_match_eager(model, monkeypatch):
    if model == "bottleneck":  # 16-128 channels: too slow for the interpreter; the rewrite is what is tested
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    eager = AirbenchNet(widths=(4, 8, 8)) if model == "airbench" else tiny_resnet(Bottleneck)
    fused = copy.deepcopy(eager)
    apply_substitutions(fused, ALL)
    x = torch.randn(2, 3, 9, 9) if model == "airbench" else torch.randn(2, 3, 16, 16)
    out_e, out_f = eager(x), fused(x)
    _assert_close(out_f, out_e, msg="logits")
    out_e.square().sum().backward()
    out_f.square().sum().backward()
    for (name, p_e), p_f in zip(eager.named_parameters(), fused.parameters(), strict=True):
        if p_e.grad is not None:
            _assert_close(p_f.grad, p_e.grad, msg=f"grad {name}")


def test_sequential_patterns_and_numerics():
    torch.manual_seed(0)
    eager = _stack()
    fused = copy.deepcopy(eager)
    report = apply_substitutions(fused, ALL)
    assert [r.path for r in report.replacements] == ["Sequential"]
    plan = getattr(fused, PLAN_ATTR)
    assert [step[0] for step in plan] == [
        "conv_bn_act",
        "call",
        "batch_norm_act",
        "group_norm_act",
        "layer_norm2d_act",
        "call",
        "call",
        "call",
    ]
    x = torch.randn(2, 3, 5, 7)
    _assert_close(fused(x), eager(x))
    _assert_close(fused[4].running_var, eager[4].running_var, msg="grouped conv's BN running_var")


def test_torchvision_conv2d_norm_activation_is_a_sequential_we_rewrite():
    from torchvision.ops.misc import Conv2dNormActivation

    block = Conv2dNormActivation(3, 4, kernel_size=3, activation_layer=nn.SiLU)
    fused = copy.deepcopy(block)
    report = apply_substitutions(fused, ALL)
    assert report.replacements[0].description == "Conv2dNormActivation: 0+1+silu -> conv_bn_act"
    x = torch.randn(2, 3, 6, 5)
    _assert_close(fused(x), block(x))


def test_torchvision_resnet18_is_rewritten_correctly(reference_ops):
    torch.manual_seed(0)
    eager = torchvision.models.resnet18(num_classes=5)
    fused = copy.deepcopy(eager)
    keys = list(eager.state_dict())
    report = apply_substitutions(fused, ALL)
    assert [r.path for r in report.replacements] == [
        "ResNet",
        "layer1.0",
        "layer1.1",
        "layer2.0",
        "layer2.0.downsample",
        "layer2.1",
        "layer3.0",
        "layer3.0.downsample",
        "layer3.1",
        "layer4.0",
        "layer4.0.downsample",
        "layer4.1",
    ]
    assert report.replacements[0].description.startswith(
        "ResNet._forward_impl: conv1+bn1+relu -> conv_bn_act"
    )
    assert list(fused.state_dict()) == keys
    x = torch.randn(2, 3, 64, 64)
    # the same arithmetic in other orders through the whole network (the gradients come back through all of
    # it): the bound grows with its reduction length, so an AVX2 CPU's other order passes (a fixed 1e-4 failed
    # the stem's weight gradient by 1.1e-4 there, with 1 element of 9,408 over)
    tol = reduction_tolerance(torch.float32, network_length(eager, x.shape))

    def close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
        torch.testing.assert_close(got, want, atol=bound(tol, want), rtol=0, msg=lambda m: f"{msg}: {m}")

    out_e, out_f = eager(x), fused(x)
    close(out_f, out_e, "train-mode logits")
    out_e.sum().backward()
    out_f.sum().backward()
    close(fused.conv1.weight.grad, eager.conv1.weight.grad, "stem conv grad")
    close(fused.layer2[0].downsample[1].weight.grad, eager.layer2[0].downsample[1].weight.grad, "ds bn")
    eager.eval(), fused.eval()
    close(fused(x), eager(x), "eval logits")
    close(fused.layer4[1].bn2.running_var, eager.layer4[1].bn2.running_var, "running_var")


def test_kinds_choose_what_is_fused():
    model = tiny_resnet()
    report = apply_substitutions(model, frozenset({"batch_norm_act"}))
    assert getattr(model.layer1[0], PLAN_ATTR)["bn1"][0] == "batch_norm_act"
    assert all(r.kind == "batch_norm_act" for r in report.replacements)
    # without conv fusion a downsample's conv runs as is and its BN (no activation) runs the BN op
    assert [step[0] for step in getattr(model.layer2[0].downsample, PLAN_ATTR)] == ["call", "batch_norm_act"]
    undo_substitutions(model, report)

    airbench = AirbenchNet(widths=(4, 8, 8))
    report = apply_substitutions(airbench, frozenset({"conv_bn_act"}))
    plan = getattr(airbench.layer1, PLAN_ATTR)
    assert plan["norm1"][0] == "eager" and plan["norm2"][0] == "conv_bn_act"
    assert ("layer1", "norm1: batch_norm_act is not enabled") in report.skipped
    assert "not fused: layer1: norm1: batch_norm_act is not enabled" in report.summary()
    undo_substitutions(airbench, report)

    assert apply_substitutions(tiny_resnet(), frozenset()).summary() == "no kernel substitutions applied"


def test_blocks_that_cannot_be_fused_stay_eager_with_the_reason():
    model = tiny_resnet()
    model.layer1[0].relu = nn.Tanh()
    model.layer2[0].conv1 = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False, padding_mode="reflect")
    report = apply_substitutions(model, ALL)
    assert "layer1.0" not in [r.path for r in report.replacements]
    reasons = dict(report.skipped)
    assert "Tanh cannot be fused" in reasons["layer1.0"]
    assert "conv stays eager (padding_mode='reflect'" in reasons["layer2.0"]
    assert getattr(model.layer2[0], PLAN_ATTR)["bn1"][0] == "batch_norm_act"


def test_a_norm_swapped_after_planning_runs_as_is(reference_ops):
    """E.g. Lightning converting BatchNorm2d to SyncBatchNorm after the rewrite: the plan must not fuse it."""

    class OtherBatchNorm(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    model = tiny_resnet()
    eager = copy.deepcopy(model)
    apply_substitutions(model, ALL)
    for m in (model, eager):
        swapped = OtherBatchNorm(4)
        swapped.load_state_dict(m.layer1[0].bn1.state_dict())
        m.layer1[0].bn1 = swapped
    x = torch.randn(2, 3, 16, 16)
    _assert_close(model(x), eager(x))
    seq = _stack()
    eager_seq = copy.deepcopy(seq)
    apply_substitutions(seq, ALL)
    for m in (seq, eager_seq):  # the Sequential's conv+bn+relu: the ReLU must still run after the swap
        swapped = OtherBatchNorm(4)
        swapped.load_state_dict(m[1].state_dict())
        m[1] = swapped
    _assert_close(seq(x), eager_seq(x))


def test_apply_is_idempotent_and_the_rewritten_model_copies_and_pickles(reference_ops):
    model = tiny_resnet()
    first = apply_substitutions(model, ALL)
    assert apply_substitutions(model, ALL).replacements == []  # already rewritten: left alone
    x = torch.randn(2, 3, 16, 16)
    model.eval()
    expected = model(x)
    twin = copy.deepcopy(model)
    assert PLAN_ATTR in twin.layer1[0].__dict__
    assert twin.layer1[0].forward.args[0] is twin.layer1[0]  # bound to the copy, not the original
    _assert_close(twin(x), expected)
    restored = pickle.loads(pickle.dumps(model))
    _assert_close(restored(x), expected)
    undo_substitutions(model, first)
    _assert_close(model(x), expected)  # same numbers from the original modules


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown kernels"):
        apply_substitutions(_stack(), frozenset({"bogus"}))


def test_fullgraph_compile_of_a_rewritten_model_train_and_eval(reference_ops):
    model = tiny_resnet()
    apply_substitutions(model, ALL)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 16, 16)
    compiled(x).sum().backward()
    assert model.conv1.weight.grad is not None
    model.eval()
    assert compiled(x).shape == (2, 3)


class _TinyResNetModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_resnet()
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _RecordBlocks(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.blocks = trainer.strategy.substituted_blocks()


def test_trainer_compiled_strategy_with_substitutions(caplog, reference_ops):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 3, (8,), generator=g))
    torch.manual_seed(0)
    eager_module = _TinyResNetModule()
    fused_module = copy.deepcopy(eager_module)
    L.Trainer(**TRAINER_KWARGS).fit(eager_module, DataLoader(data, batch_size=4))
    strategy = CompiledStrategy(
        backend="aot_eager", kernels=["conv_bn_act", "batch_norm_act"], fullgraph=True
    )
    record = _RecordBlocks()
    with caplog.at_level(logging.INFO):
        L.Trainer(strategy=strategy, callbacks=[record], **TRAINER_KWARGS).fit(
            fused_module, DataLoader(data, batch_size=4)
        )
    stats = strategy.compile_stats
    assert stats.graphs >= 1 and stats.graph_breaks == 0 and not stats.fell_back, stats.break_reasons
    assert [r.path for r in record.blocks][:2] == ["net", "net.layer1.0"]
    assert "kernel substitutions: 8 module(s) rewritten" in caplog.text
    assert not substituted_modules(fused_module), "teardown must undo the substitutions"
    for step, (a, b) in enumerate(zip(eager_module.losses, fused_module.losses, strict=True)):
        _assert_loss_close(torch.tensor(b), torch.tensor(a), eager_module.net, (4, 3, 16, 16), step)


class _StackModule(_TinyResNetModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _stack()


def test_trainer_compiled_strategy_runs_the_triton_kernels_without_graph_breaks():
    """The same check with the Triton kernels in the interpreter (TRITON_INTERPRET=1 from conftest), every
    substitution kind (conv+BN+act, BN+act, GroupNorm+act, LayerNorm2d+act), fullgraph, tiny shapes."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
    torch.manual_seed(0)
    eager_module = _StackModule()
    fused_module = copy.deepcopy(eager_module)
    L.Trainer(**{**TRAINER_KWARGS, "max_steps": 2}).fit(eager_module, DataLoader(data, batch_size=2))
    strategy = CompiledStrategy(backend="aot_eager", kernels="all", fullgraph=True)
    record = _RecordBlocks()
    L.Trainer(strategy=strategy, callbacks=[record], **{**TRAINER_KWARGS, "max_steps": 2}).fit(
        fused_module, DataLoader(data, batch_size=2)
    )
    stats = strategy.compile_stats
    assert stats.graphs >= 1 and stats.graph_breaks == 0 and not stats.fell_back, stats.break_reasons
    kinds = {k for r in record.blocks for k in r.kind.split("+")}
    assert kinds >= {"conv_bn_act", "group_norm_act", "layer_norm2d_act"}, kinds
    assert len(fused_module.losses) == 2
    for step, (a, b) in enumerate(zip(eager_module.losses, fused_module.losses, strict=True)):
        _assert_loss_close(torch.tensor(b), torch.tensor(a), eager_module.net, (2, 3, 8, 8), step)


def test_float64_training_keeps_blocks_eager_and_says_why(caplog):
    """``precision="64-true"`` with kernels on crashed in the first step (no kernel takes float64). The blocks
    stay eager, the fit-start table names the dtype, and training matches a plain float64 run."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 3, (8,), generator=g))
    torch.manual_seed(0)
    eager_module = _TinyResNetModule()
    fused_module = copy.deepcopy(eager_module)
    kwargs = {**TRAINER_KWARGS, "precision": "64-true"}
    L.Trainer(**kwargs).fit(eager_module, DataLoader(data, batch_size=4))
    strategy = CompiledStrategy(backend="aot_eager", kernels="all")
    record = _RecordBlocks()
    with caplog.at_level(logging.INFO):
        L.Trainer(strategy=strategy, callbacks=[record], **kwargs).fit(
            fused_module, DataLoader(data, batch_size=4)
        )
    assert record.blocks == []
    assert "no kernel substitutions applied" in caplog.text
    assert "not fused: net.layer1.0: bn1: BatchNorm2d.weight is float64" in caplog.text
    assert not strategy.compile_stats.fell_back
    # aot_eager decomposes some ops (another order of the same float64 sums); the loss after ``step``
    # optimizer steps carries their errors
    length = network_length(eager_module, (4, 3, 16, 16))
    for step, (a, b) in enumerate(zip(eager_module.losses, fused_module.losses, strict=True)):
        limit = bound(trajectory_tolerance(torch.float64, length, step + 1), torch.tensor(a))
        assert abs(a - b) <= limit, f"loss at step {step}: {a} vs {b}"


def test_an_input_of_a_dtype_no_kernel_takes_runs_the_blocks_eager():
    """A model rewritten in fp32 and then converted (``.double()``) runs its own modules instead of
    failing."""
    model = tiny_resnet()
    eager = copy.deepcopy(model).double()
    apply_substitutions(model, ALL)
    model.double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    want = eager(x)
    tol = reduction_tolerance(torch.float64, network_length(eager, x.shape))
    torch.testing.assert_close(model(x), want, atol=bound(tol, want), rtol=0)
