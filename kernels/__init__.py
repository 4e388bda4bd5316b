"""Triton kernels with fused epilogues, each beside its PyTorch reference.

Each op is registered as a ``torch.library`` op (namespace ``lcv``) with a fake
(meta) implementation and autograd, so ``torch.compile(fullgraph=True)`` traces it
without graph breaks. Without CUDA an op runs its PyTorch reference, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton code runs in the interpreter.
"""

from kernels.conv_ops import conv2d_fused
from kernels.fused_conv import FusedConvBNAct
from kernels.fused_norm import FusedBatchNormAct, FusedGroupNormAct, FusedLayerNorm2dAct, conv_bn_act
from kernels.norm_ops import batch_norm_act, group_norm_act, layer_norm2d_act

__all__ = [
    "FusedBatchNormAct",
    "FusedConvBNAct",
    "FusedGroupNormAct",
    "FusedLayerNorm2dAct",
    "batch_norm_act",
    "conv2d_fused",
    "conv_bn_act",
    "group_norm_act",
    "layer_norm2d_act",
]
