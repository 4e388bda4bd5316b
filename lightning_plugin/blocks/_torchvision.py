"""torchvision's fusable blocks, registered by class path (nothing here imports torchvision).

``Conv2dNormActivation`` and the MobileNet, EfficientNet and RegNet blocks built from it need no spec: it is
an ``nn.Sequential`` that keeps Sequential's forward, which the substitution rewrites generically; the
blocks around it only call it. Each forward below restates the one of torchvision 0.29 named in its docstring.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_plugin.blocks._registry import Chain, register_block, register_norm
from lightning_plugin.blocks._run import run_chain

# The forwards below take `self: Any`: they are bound to torchvision's instances and reach their children by
# name, which mypy cannot follow through `nn.Module.__getattr__` (typed `Tensor | Module`).

_RESNET = "torchvision.models.resnet"


def _basic_block_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``BasicBlock.forward``."""
    out = run_chain(self, "bn1", x)
    identity = x if self.downsample is None else self.downsample(x)
    return run_chain(self, "bn2", out, identity)


def _bottleneck_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``Bottleneck.forward``."""
    out = run_chain(self, "bn1", x)
    out = run_chain(self, "bn2", out)
    identity = x if self.downsample is None else self.downsample(x)
    return run_chain(self, "bn3", out, identity)


def _resnet_forward_impl(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``ResNet._forward_impl``: the stem's chain, then the stages and the head as they are."""
    x = self.maxpool(run_chain(self, "bn1", x))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return self.fc(torch.flatten(self.avgpool(x), 1))


register_block(
    f"{_RESNET}.BasicBlock",
    chains=(Chain("bn1", conv="conv1", act="relu"), Chain("bn2", conv="conv2", act="relu")),
    forward=_basic_block_forward,
)
register_block(
    f"{_RESNET}.Bottleneck",
    chains=(
        Chain("bn1", conv="conv1", act="relu"),
        Chain("bn2", conv="conv2", act="relu"),
        Chain("bn3", conv="conv3", act="relu"),
    ),
    forward=_bottleneck_forward,
)
register_block(
    f"{_RESNET}.ResNet",
    attribute="_forward_impl",
    chains=(Chain("bn1", conv="conv1", act="relu"),),
    forward=_resnet_forward_impl,
)
register_norm("torchvision.models.convnext.LayerNorm2d", "layer_norm2d_act")
