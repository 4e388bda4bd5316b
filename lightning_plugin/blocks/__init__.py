"""Blocks declared where they live: which module classes the kernel substitution may fuse, and how.

A *norm class* is one whose forward normalises as one of our kernels does (``nn.BatchNorm2d``,
``nn.GroupNorm``, a LayerNorm over NCHW channels), possibly followed by its own activation (timm's
``BatchNormAct2d``): :func:`register_norm`. A *block class* is one whose forward runs *chains*,
``[conv →] norm [→ …] [+ residual] [→ act]`` (:class:`Chain`), on its own child modules:
:func:`register_block` takes the chains and a restated forward that calls :func:`run_chain` where the
class's forward runs a chain.
``lightning_plugin.kernel_choice.substitution`` plans each chain of a registered block (a kernel, or eager with
the reason) and installs the restated forward on the instance; ``nn.Sequential`` needs no registration.

Whoever owns a block registers it next to its class (``lcv_vision.models.resnet`` does); torchvision's, timm's and
Hugging Face transformers' blocks are registered here by class path, so none of those libraries is imported
(``_torchvision``, ``_timm``, ``_transformers``).
"""

from lightning_plugin.blocks import (  # noqa: F401  (the built-in specs, by class path)
    _timm,
    _torchvision,
    _transformers,
)
from lightning_plugin.blocks._registry import (
    NORM_KERNELS,
    BlockSpec,
    Chain,
    NormSpec,
    block_spec,
    class_path,
    norm_spec,
    register_block,
    register_norm,
    registered_blocks,
    registered_norms,
)
from lightning_plugin.blocks._run import PLAN_ATTR, Step, run_chain

__all__ = [
    "NORM_KERNELS",
    "PLAN_ATTR",
    "BlockSpec",
    "Chain",
    "NormSpec",
    "Step",
    "block_spec",
    "class_path",
    "norm_spec",
    "register_block",
    "register_norm",
    "registered_blocks",
    "registered_norms",
    "run_chain",
]
