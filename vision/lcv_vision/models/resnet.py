"""ResNet-18/34/50 with torchvision's state_dict layout, and a CIFAR stem variant.

Written from the architecture (He et al. 2015; v1.5: stride on the 3x3 of the bottleneck).
Parameter names match ``torchvision.models.resnet*`` exactly (``conv1``, ``bn1``,
``layer{1..4}.{i}.conv{1,2,3}``, ``downsample.{0,1}``, ``fc``) so torchvision weights load
with ``load_state_dict``. Only standard conv/BN/ReLU ops: channels_last and Inductor friendly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from lcv_vision.models._registry import register_model
from lightning_plugin.blocks import Chain, register_block, run_chain

__all__ = ["ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet34", "resnet50", "cifar_resnet18"]


def _downsample(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual; ``expansion = 1``."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        needs_projection = stride != 1 or in_channels != out_channels
        self.downsample = _downsample(in_channels, out_channels, stride) if needs_projection else None

    def last_norm(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def _basic_block_chains(self: BasicBlock, x: torch.Tensor) -> torch.Tensor:
    """:meth:`BasicBlock.forward` with its conv-BN-ReLU chains run by the kernel substitution's plan."""
    identity = x if self.downsample is None else self.downsample(x)
    out = run_chain(self, "bn1", x)
    return run_chain(self, "bn2", out, identity)


register_block(
    BasicBlock,
    chains=(Chain("bn1", conv="conv1", act="relu"), Chain("bn2", conv="conv2", act="relu")),
    forward=_basic_block_chains,
)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, v1.5), 1x1 expand by 4, with a residual."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        needs_projection = stride != 1 or in_channels != out_channels
        self.downsample = _downsample(in_channels, out_channels, stride) if needs_projection else None

    def last_norm(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _bottleneck_chains(self: Bottleneck, x: torch.Tensor) -> torch.Tensor:
    """:meth:`Bottleneck.forward` with its conv-BN-ReLU chains run by the kernel substitution's plan."""
    identity = x if self.downsample is None else self.downsample(x)
    out = run_chain(self, "bn1", x)
    out = run_chain(self, "bn2", out)
    return run_chain(self, "bn3", out, identity)


register_block(
    Bottleneck,
    chains=(
        Chain("bn1", conv="conv1", act="relu"),
        Chain("bn2", conv="conv2", act="relu"),
        Chain("bn3", conv="conv3", act="relu"),
    ),
    forward=_bottleneck_chains,
)


class ResNet(nn.Module):
    """A ResNet with a choice of stem.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: blocks per stage, e.g. ``(2, 2, 2, 2)`` for ResNet-18.
        num_classes: size of the ``fc`` head.
        in_channels: image channels.
        width: channels of the first stage (64 in the paper); stages double it. Small values make test models.
        stem: ``"imagenet"`` (7x7 stride-2 conv + 3x3 max pool, for 224 px) or ``"cifar"``
            (3x3 stride-1 conv, no pool, for 32 px). Both keep the same parameter names.
        zero_init_residual: start every residual branch's last BN at 0 (Goyal et al.), so blocks start as
            identities.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        num_classes: int = 1000,
        in_channels: int = 3,
        width: int = 64,
        stem: Literal["imagenet", "cifar"] = "imagenet",
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(f"ResNet needs four positive stage depths, got {layers!r}")
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        channels = width
        stages = []
        for index, depth in enumerate(layers):
            stage_channels = width * 2**index
            stride = 1 if index == 0 else 2
            blocks = []
            for b in range(depth):
                blocks.append(block(channels, stage_channels, stride if b == 0 else 1))
                channels = stage_channels * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_norm().weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.forward_features(x))


def _resnet_features_chains(self: ResNet, x: torch.Tensor) -> torch.Tensor:
    """:meth:`ResNet.forward_features` with the stem's conv-BN-ReLU run by the kernel substitution's plan."""
    x = self.maxpool(run_chain(self, "bn1", x))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return torch.flatten(self.avgpool(x), 1)


register_block(
    ResNet,
    attribute="forward_features",
    chains=(Chain("bn1", conv="conv1", act="relu"),),
    forward=_resnet_features_chains,
)


@register_model
def resnet18(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-18 (BasicBlock, 2-2-2-2)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, **kwargs)


@register_model
def resnet34(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-34 (BasicBlock, 3-4-6-3)."""
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes=num_classes, **kwargs)


@register_model
def resnet50(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet-50 (Bottleneck v1.5, 3-4-6-3)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, **kwargs)


@register_model
def cifar_resnet18(num_classes: int = 10, **kwargs: Any) -> ResNet:
    """ResNet-18 with the 3x3 stride-1 stem and no max pool, the usual choice for 32 px images."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, **{"stem": "cifar", **kwargs})
