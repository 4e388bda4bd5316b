"""The airbench CIFAR-10 network (Keller Jordan, arXiv 2404.00498), written from its description.

Why it is fast: a frozen 2x2 *whitening* convolution (patch-covariance eigenvectors, with
their negatives) gives the first layer a good basis for free; three conv-pool-BN-GELU groups
with no residuals and dirac (identity) init train quickly at a very high learning rate; BN
scales are frozen at 1 and only BN biases learn. Published widths: 64/256/256 (airbench94),
128/384/384 (airbench95).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lcv_vision.models._registry import register_model
from lightning_plugin.blocks import Chain, register_block, run_chain

__all__ = ["AirbenchNet", "ConvGroup", "whitening_weights", "airbench94", "airbench95"]


def _batchnorm(channels: int, eps: float = 1e-12) -> nn.BatchNorm2d:
    """BN with a frozen unit scale, a tiny eps and fast running statistics (PyTorch momentum 0.4)."""
    bn = nn.BatchNorm2d(channels, eps=eps, momentum=0.4)
    bn.weight.requires_grad_(False)
    return bn


def _conv3x3(in_channels: int, out_channels: int) -> nn.Conv2d:
    conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding="same", bias=False)
    # Identity on the first in_channels filters: each group starts close to passing its input through.
    with torch.no_grad():
        nn.init.dirac_(conv.weight[: min(in_channels, out_channels)])
    return conv


class ConvGroup(nn.Module):
    """conv3x3 -> MaxPool2 -> BN -> GELU -> conv3x3 -> BN -> GELU (no residual)."""

    def __init__(self, in_channels: int, out_channels: int, bn_eps: float = 1e-12) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = _batchnorm(out_channels, bn_eps)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.norm2 = _batchnorm(out_channels, bn_eps)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


def _conv_group_chains(self: ConvGroup, x: torch.Tensor) -> torch.Tensor:
    """:meth:`ConvGroup.forward` with its BN-GELU chains run by the kernel substitution's plan (the pool
    between ``conv1`` and ``norm1`` keeps that conv out of its chain)."""
    x = run_chain(self, "norm1", self.pool(self.conv1(x)))
    return run_chain(self, "norm2", x)


register_block(
    ConvGroup,
    chains=(Chain("norm1", act="act"), Chain("norm2", conv="conv2", act="act")),
    forward=_conv_group_chains,
)


class AirbenchNet(nn.Module):
    """Whitening conv, three :class:`ConvGroup` s, global max pool, bias-free linear head scaled by 1/9.

    Args:
        num_classes: size of the head.
        widths: output channels of the three groups.
        in_channels: image channels.
        logit_scale: multiplies the logits (airbench uses 1/9; it pairs with label smoothing 0.2).
        bn_eps: BatchNorm epsilon (airbench: 1e-12). So small an eps needs every channel to carry signal:
            BN scales the gradient of a ~constant channel by ~1/sqrt(eps) (see :func:`whitening_weights`).
    """

    def __init__(
        self,
        num_classes: int = 10,
        widths: tuple[int, int, int] | list[int] = (64, 256, 256),
        in_channels: int = 3,
        logit_scale: float = 1 / 9,
        bn_eps: float = 1e-12,
    ) -> None:
        super().__init__()
        if len(widths) != 3 or any(int(w) < 1 for w in widths):
            raise ValueError(f"AirbenchNet needs three positive widths, got {widths!r}")
        widths = [int(w) for w in widths]
        whiten_channels = 2 * in_channels * 2 * 2
        self.whiten = nn.Conv2d(in_channels, whiten_channels, kernel_size=2, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        assert self.whiten.bias is not None  # bias=True
        nn.init.zeros_(self.whiten.bias)  # as airbench: the bias starts at 0 and learns for a few epochs
        self.act = nn.GELU()
        if not bn_eps > 0:
            raise ValueError(f"AirbenchNet: bn_eps must be > 0, got {bn_eps!r}")
        self.layer1 = ConvGroup(whiten_channels, widths[0], bn_eps)
        self.layer2 = ConvGroup(widths[0], widths[1], bn_eps)
        self.layer3 = ConvGroup(widths[1], widths[2], bn_eps)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.logit_scale = logit_scale

    @torch.no_grad()
    def init_whitening(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Set the frozen whitening filters from (normalised) training ``images`` (N, C, H, W).

        Under FSDP (``compiled_fsdp``) the filter is a DTensor shard: every rank computes the same full
        filter (the images are the same seeded sample on every rank) and keeps its shard of it."""
        weight = self.whiten.weight
        full = whitening_weights(images.to(device=weight.device, dtype=weight.dtype), eps=eps)
        if isinstance(weight, DTensor):
            full = distribute_tensor(full, weight.device_mesh, weight.placements)
        weight.copy_(full)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.whiten(x))
        x = self.layer3(self.layer2(self.layer1(x)))
        return torch.amax(x, dim=(2, 3))  # = MaxPool(3) on the 3x3 map of a 32x32 input, any size here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x)) * self.logit_scale


def whitening_weights(images: torch.Tensor, eps: float = 5e-4, rel_tol: float = 1e-6) -> torch.Tensor:
    """2x2 whitening filters: eigenvectors of the patch covariance over sqrt(eigenvalue + eps), then negated
    copies.

    Returns a (2 * C * 4, C, 2, 2) weight, largest-variance directions first. Directions in which the data
    does not vary (eigenvalue <= ``rel_tol`` x the largest; e.g. grey images stored in 3 identical channels)
    would give channels that are ~0 on every image; after the dirac-initialised convolution, BN (eps 1e-12)
    scales their gradients by ~1e6 and training blows up. Their filters are replaced by copies of the
    informative ones, in order. On CIFAR-10 every direction is informative and nothing is replaced.
    """
    if images.dim() != 4 or images.shape[-1] < 2 or images.shape[-2] < 2:
        raise ValueError(
            f"whitening needs a batch of images (N, C, H>=2, W>=2), got shape {tuple(images.shape)}"
        )
    c = images.shape[1]
    patches = images.float().unfold(2, 2, 1).unfold(3, 2, 1)  # N, C, H-1, W-1, 2, 2
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * 4)
    covariance = patches.T @ patches / patches.shape[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance.double())
    eigenvalues, eigenvectors = eigenvalues.flip(0).float(), eigenvectors.T.flip(0).float()
    filters = eigenvectors.reshape(-1, c, 2, 2) / torch.sqrt(eigenvalues.clamp_min(0) + eps).view(-1, 1, 1, 1)
    informative = int((eigenvalues > rel_tol * eigenvalues[0].clamp_min(0)).sum())
    if informative == 0:
        raise ValueError("whitening: the images do not vary at all (constant images?)")
    if informative < filters.shape[0]:
        filters = filters[torch.arange(filters.shape[0]) % informative]
    return torch.cat((filters, -filters))


@register_model
def airbench94(num_classes: int = 10, **kwargs: Any) -> AirbenchNet:
    """airbench94 widths 64/256/256 (94% on CIFAR-10 in ~10 epochs)."""
    return AirbenchNet(num_classes=num_classes, **{"widths": (64, 256, 256), **kwargs})


@register_model
def airbench95(num_classes: int = 10, **kwargs: Any) -> AirbenchNet:
    """airbench95 widths 128/384/384 (95% in ~15 epochs)."""
    return AirbenchNet(num_classes=num_classes, **{"widths": (128, 384, 384), **kwargs})
