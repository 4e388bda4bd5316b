"""timm's fusable norms and blocks, registered by class path (nothing here imports timm until a timm model
is rewritten, so a missing timm costs nothing).

Each forward restates the one of timm 1.0 (checked against 1.0.31) named in its docstring; the attribute
names are those of timm >= 0.9. timm's norm layers mostly come as norm-activation classes: a
``BatchNormAct2d`` *is* a ``BatchNorm2d`` whose forward then calls its ``drop`` and ``act`` children, so it is
both a norm (inside ``ConvNormAct`` and the EfficientNet blocks) and, standing alone, its own block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_plugin.blocks._registry import Chain, register_block, register_norm
from lightning_plugin.blocks._run import run_chain

# The forwards below take `self: Any`: they are bound to timm's instances and reach their children by
# name, which mypy cannot follow through `nn.Module.__getattr__` (typed `Tensor | Module`).

_NORM_ACT = "timm.layers.norm_act"
_RESNET = "timm.models.resnet"
_EFFICIENTNET_BLOCKS = "timm.models._efficientnet_blocks"


def _fast_norm(norm: nn.Module) -> str | None:
    """timm's opt-in ``fast_norm`` path normalises in low precision under autocast, unlike the kernels."""
    return "timm fast_norm is on" if getattr(norm, "_fast_norm", False) else None


def _checkpoint_seq(modules: object, x: torch.Tensor) -> torch.Tensor:
    from timm.models import checkpoint_seq

    return checkpoint_seq(modules, x, flatten=True)


def _checkpointing(model: Any) -> bool:
    return model.grad_checkpointing and not torch.jit.is_scripting()


def _norm_act_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``BatchNormAct2d.forward`` / ``GroupNormAct.forward``: the norm, its ``drop``, its ``act``."""
    return run_chain(self, "", x)


def _conv_norm_act_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.layers.ConvNormAct.forward``."""
    x = run_chain(self, "bn", x)
    aa = getattr(self, "aa", None)
    return x if aa is None else self.aa(x)


def _basic_block_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.models.resnet.BasicBlock.forward``."""
    out = self.aa(run_chain(self, "bn1", x))
    shortcut = x if self.downsample is None else self.downsample(x)
    return run_chain(self, "bn2", out, shortcut)


def _bottleneck_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.models.resnet.Bottleneck.forward``."""
    out = run_chain(self, "bn1", x)
    out = self.aa(run_chain(self, "bn2", out))
    shortcut = x if self.downsample is None else self.downsample(x)
    return run_chain(self, "bn3", out, shortcut)


def _resnet_forward_features(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.models.resnet.ResNet.forward_features``."""
    x = self.maxpool(run_chain(self, "bn1", x))
    stages = [self.layer1, self.layer2, self.layer3, self.layer4]
    if _checkpointing(self):
        return _checkpoint_seq(stages, x)
    for stage in stages:
        x = stage(x)
    return x


def _skip(self: Any, x: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
    return self.drop_path(x) + shortcut if self.has_skip else x


def _conv_bn_act_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_efficientnet_blocks.ConvBnAct.forward``."""
    return _skip(self, self.aa(run_chain(self, "bn1", x)), x)


def _depthwise_separable_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_efficientnet_blocks.DepthwiseSeparableConv.forward``."""
    shortcut = x
    if self.conv_s2d is not None:
        x = run_chain(self, "bn_s2d", x)
    x = self.se(self.aa(run_chain(self, "bn1", x)))
    return _skip(self, run_chain(self, "bn2", x), shortcut)


def _inverted_residual_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_efficientnet_blocks.InvertedResidual.forward``."""
    shortcut = x
    if self.conv_s2d is not None:
        x = run_chain(self, "bn_s2d", x)
    x = run_chain(self, "bn1", x)
    x = self.se(self.aa(run_chain(self, "bn2", x)))
    return _skip(self, run_chain(self, "bn3", x), shortcut)


def _edge_residual_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_efficientnet_blocks.EdgeResidual.forward`` (EfficientNetV2's fused MBConv)."""
    x_mid = self.se(self.aa(run_chain(self, "bn1", x)))
    return _skip(self, run_chain(self, "bn2", x_mid), x)


def _efficientnet_forward_features(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.models.efficientnet.EfficientNet.forward_features``: stem chain, blocks, head chain."""
    x = run_chain(self, "bn1", x)
    x = _checkpoint_seq(self.blocks, x) if _checkpointing(self) else self.blocks(x)
    return run_chain(self, "bn2", x)


def _mobilenetv3_forward_features(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.models.mobilenetv3.MobileNetV3.forward_features``: stem chain, blocks."""
    x = run_chain(self, "bn1", x)
    return _checkpoint_seq(self.blocks, x) if _checkpointing(self) else self.blocks(x)


def _convnext_block_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``timm.models.convnext.ConvNeXtBlock.forward``. Only its ``conv_mlp`` form normalises NCHW tensors (a
    ``LayerNorm2d``, the chain); the other one runs a plain ``LayerNorm`` on channels-last ones, as is."""
    shortcut = x
    x = self.conv_dw(x)
    if self.use_conv_mlp:
        x = self.mlp(run_chain(self, "norm", x))
    else:
        x = self.mlp(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
    if self.gamma is not None:
        x = x.mul(self.gamma.reshape(1, -1, 1, 1))
    return self.drop_path(x) + self.shortcut(shortcut)


register_norm("timm.layers.norm.LayerNorm2d", "layer_norm2d_act", check=_fast_norm)
register_norm(f"{_NORM_ACT}.BatchNormAct2d", "batch_norm_act", act="act", identities=("drop",))
register_norm(
    f"{_NORM_ACT}.GroupNormAct", "group_norm_act", act="act", identities=("drop",), check=_fast_norm
)
for _name in ("BatchNormAct2d", "GroupNormAct"):
    register_block(f"{_NORM_ACT}.{_name}", chains=(Chain(""),), forward=_norm_act_forward)
register_block(
    "timm.layers.conv_bn_act.ConvNormAct", chains=(Chain("bn", conv="conv"),), forward=_conv_norm_act_forward
)
register_block(
    f"{_RESNET}.BasicBlock",
    chains=(
        Chain("bn1", conv="conv1", act="act1", between=("drop_block",)),
        Chain("bn2", conv="conv2", act="act2", between=("se", "drop_path")),
    ),
    forward=_basic_block_forward,
)
register_block(
    f"{_RESNET}.Bottleneck",
    chains=(
        Chain("bn1", conv="conv1", act="act1"),
        Chain("bn2", conv="conv2", act="act2", between=("drop_block",)),
        Chain("bn3", conv="conv3", act="act3", between=("se", "drop_path")),
    ),
    forward=_bottleneck_forward,
)
register_block(
    f"{_RESNET}.ResNet",
    attribute="forward_features",
    chains=(Chain("bn1", conv="conv1", act="act1"),),
    forward=_resnet_forward_features,
)
register_block(
    f"{_EFFICIENTNET_BLOCKS}.ConvBnAct", chains=(Chain("bn1", conv="conv"),), forward=_conv_bn_act_forward
)
register_block(
    f"{_EFFICIENTNET_BLOCKS}.DepthwiseSeparableConv",
    chains=(Chain("bn_s2d", conv="conv_s2d"), Chain("bn1", conv="conv_dw"), Chain("bn2", conv="conv_pw")),
    forward=_depthwise_separable_forward,
)
register_block(
    f"{_EFFICIENTNET_BLOCKS}.InvertedResidual",
    chains=(
        Chain("bn_s2d", conv="conv_s2d"),
        Chain("bn1", conv="conv_pw"),
        Chain("bn2", conv="conv_dw"),
        Chain("bn3", conv="conv_pwl"),
    ),
    forward=_inverted_residual_forward,
)
register_block(
    f"{_EFFICIENTNET_BLOCKS}.EdgeResidual",
    chains=(Chain("bn1", conv="conv_exp"), Chain("bn2", conv="conv_pwl")),
    forward=_edge_residual_forward,
)
register_block(
    "timm.models.efficientnet.EfficientNet",
    attribute="forward_features",
    chains=(Chain("bn1", conv="conv_stem"), Chain("bn2", conv="conv_head")),
    forward=_efficientnet_forward_features,
)
register_block(
    "timm.models.mobilenetv3.MobileNetV3",
    attribute="forward_features",
    chains=(Chain("bn1", conv="conv_stem"),),
    forward=_mobilenetv3_forward_features,
)
register_block("timm.models.convnext.ConvNeXtBlock", chains=(Chain("norm"),), forward=_convnext_block_forward)
