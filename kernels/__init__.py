"""Triton kernels with fused epilogues, each beside its PyTorch reference.

Each op is registered as a ``torch.library`` op (namespace ``lcv``) with a fake
(meta) implementation and autograd, so ``torch.compile(fullgraph=True)`` traces it
without graph breaks. Without CUDA an op runs its PyTorch reference, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton code runs in the interpreter.
"""

from kernels.conv_ops import conv2d_fused
from kernels.fused_conv import FusedConvBNAct

__all__ = ["FusedConvBNAct", "conv2d_fused"]
