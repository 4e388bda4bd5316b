"""Hugging Face ``transformers``' fusable norms and blocks, registered by class path (nothing here imports
transformers, so a missing one costs nothing).

Each forward restates the one of transformers 5.25 named in its docstring. HF's convolutional vision models
spell conv → norm → act as small modules (``ResNetConvLayer``, EfficientNet's phases) that their blocks
call, so registering those covers the blocks built from them; norm-activation classes (BiT's
``BitGroupNormActivation``) are norms that apply their own activation, and their own block when called
alone, as timm's are. Activations ``ACT2FN`` gives as ``nn.ReLU``/``nn.SiLU`` (``"relu"``, ``"swish"``)
fuse; its own classes (``"gelu"``, ``"silu"``) keep the chain eager, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_plugin.blocks._registry import Chain, register_block, register_norm
from lightning_plugin.blocks._run import run_chain

# The forwards below take `self: Any`: they are bound to transformers' instances and reach their children by
# name, which mypy cannot follow through `nn.Module.__getattr__` (typed `Tensor | Module`).

_MODELS = "transformers.models"
_RESNET = f"{_MODELS}.resnet.modeling_resnet"
_CONVNEXT = f"{_MODELS}.convnext.modeling_convnext"
_EFFICIENTNET = f"{_MODELS}.efficientnet.modeling_efficientnet"
_BIT = f"{_MODELS}.bit.modeling_bit"


def _channels_first(norm: nn.Module) -> str | None:
    """``ConvNextLayerNorm`` normalises NCHW channels only in its ``channels_first`` form."""
    form = getattr(norm, "data_format", None)
    return None if form == "channels_first" else f"data_format={form!r} normalises NHWC tensors"


def _check_channels(self: Any, pixel_values: torch.Tensor) -> None:
    if pixel_values.shape[1] != self.num_channels:
        raise ValueError(
            "Make sure that the channel dimension of the pixel values match with the one set in the configuration."
        )


def _norm_act_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``BitGroupNormActivation.forward``: the norm and its ``activation``."""
    return run_chain(self, "", x)


def _convnext_embeddings_forward(self: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    """``ConvNextEmbeddings.forward``."""
    _check_channels(self, pixel_values)
    return run_chain(self, "layernorm", pixel_values)


def _efficientnet_embeddings_forward(self: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    """``EfficientNetEmbeddings.forward``."""
    return run_chain(self, "batchnorm", self.padding(pixel_values))


def _efficientnet_depthwise_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``EfficientNetDepthwiseLayer.forward``."""
    if self.stride == 2:
        hidden_states = self.depthwise_conv_pad(hidden_states)
    return run_chain(self, "depthwise_norm", hidden_states)


def _single_chain_block(cls: str, norm: str, conv: str, act: str | None = None) -> None:
    """A module whose forward is exactly ``act(norm(conv(x)))``: its chain's norm is read from the instance
    (``_lcv_chain``) through a per-class forward."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return run_chain(self, norm, x)

    forward.__doc__ = f"``{cls.rsplit('.', 1)[1]}.forward``: {conv} → {norm}" + (f" → {act}" if act else "")
    register_block(cls, chains=(Chain(norm, conv=conv, act=act),), forward=forward)


# ResNet (microsoft/resnet-*): every conv is a ResNetConvLayer or a ResNetShortCut; the stem and the residual
# layers call them (the layer's last conv has activation=None, an Identity).
_single_chain_block(f"{_RESNET}.ResNetConvLayer", "normalization", "convolution", "activation")
_single_chain_block(f"{_RESNET}.ResNetShortCut", "normalization", "convolution")

# ConvNeXt: the patchify stem's LayerNorm and the downsampling layers' (an nn.Sequential) are channels_first.
register_norm(f"{_CONVNEXT}.ConvNextLayerNorm", "layer_norm2d_act", check=_channels_first)
register_block(
    f"{_CONVNEXT}.ConvNextEmbeddings",
    chains=(Chain("layernorm", conv="patch_embeddings"),),
    forward=_convnext_embeddings_forward,
)

# EfficientNet: the stem and the expansion and depthwise phases of each block (the projection phase takes two
# inputs and adds its residual after a dropout: it stays as it is).
register_block(
    f"{_EFFICIENTNET}.EfficientNetEmbeddings",
    chains=(Chain("batchnorm", conv="convolution", act="activation"),),
    forward=_efficientnet_embeddings_forward,
)
_single_chain_block(f"{_EFFICIENTNET}.EfficientNetExpansionLayer", "expand_bn", "expand_conv", "expand_act")
register_block(
    f"{_EFFICIENTNET}.EfficientNetDepthwiseLayer",
    chains=(Chain("depthwise_norm", conv="depthwise_conv", act="depthwise_act"),),
    forward=_efficientnet_depthwise_forward,
)

# BiT: a GroupNorm that applies its activation (Identity when apply_activation=False).
register_norm(f"{_BIT}.BitGroupNormActivation", "group_norm_act", act="activation")
register_block(f"{_BIT}.BitGroupNormActivation", chains=(Chain(""),), forward=_norm_act_forward)
