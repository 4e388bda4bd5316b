"""Triton kernels with fused epilogues, one module per op, each beside its PyTorch reference.

Every op has one name, used alike for its module (``kernels.<name>``, which holds the function of that name),
its reference (``kernels.<name>_reference``), its ``torch.library`` op (``lcv::<name>``, with a fake
implementation and autograd, so ``torch.compile(fullgraph=True)`` traces it without graph breaks) and the
kernel choice of ``CompileConfig(kernels=[...])``. Without CUDA an op runs its PyTorch reference, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton code runs in the interpreter::

    from lcv_kernels.conv_bn_act import conv_bn_act
    from lcv_kernels.batch_norm_act import batch_norm_act
"""

from lcv_kernels import batch_norm_act, conv_bn_act, group_norm_act, layer_norm2d_act
from lcv_kernels.batch_norm_act import FusedBatchNormAct
from lcv_kernels.conv_bn_act import FusedConvBNAct
from lcv_kernels.group_norm_act import FusedGroupNormAct
from lcv_kernels.layer_norm2d_act import FusedLayerNorm2dAct

#: The kernels, by the one name each goes by (module, function, op, ``CompileConfig(kernels=...)``).
KERNELS: tuple[str, ...] = ("conv_bn_act", "batch_norm_act", "group_norm_act", "layer_norm2d_act")

__all__ = [
    "KERNELS",
    "FusedBatchNormAct",
    "FusedConvBNAct",
    "FusedGroupNormAct",
    "FusedLayerNorm2dAct",
    "batch_norm_act",
    "conv_bn_act",
    "group_norm_act",
    "layer_norm2d_act",
]
