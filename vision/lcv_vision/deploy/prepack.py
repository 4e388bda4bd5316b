"""Prepacked oneDNN convolution weights in a dynamic-batch CPU package (an Inductor post-grad pass).

Why: with freezing, Inductor turns each CPU convolution into ``mkldnn._convolution_pointwise`` and, for a static
input shape, reorders its weight into oneDNN's blocked layout once, at compile time. With a symbolic batch (our
packages take any ``N``) it leaves the weight plain ("pack weight in runtime"), so every call reorders every
convolution's weight again: for ResNet-18 that is 44 MB of copies per call, most of a batch-1 call. oneDNN's
blocked layout of a convolution weight depends on the channels, kernel and instruction set, not on the batch, so
this pass packs each frozen weight for a hint batch and the kernels use it at any batch (oneDNN reorders again
only if it ever expects another layout: the old cost, never a wrong result). Its effect on ResNet-18
(benchmarks/inference.py) is in docs/deploy.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["PACKED_PREFIX", "PrepackConvWeights"]

#: Name prefix of the packed weights among the package's constants (``runner.get_constant_fqns()``).
PACKED_PREFIX = "_lcv_packed_"

#: ``op -> (index of the input, index of the weight)``; padding, stride, dilation, groups follow the bias.
_CONV_OPS: dict[Any, tuple[int, int]] = {}
if torch._C._has_mkldnn:
    _CONV_OPS = {
        torch.ops.mkldnn._convolution_pointwise.default: (0, 1),
        torch.ops.mkldnn._convolution_pointwise.binary: (0, 2),
        torch.ops.mkldnn._convolution_pointwise_.binary: (1, 2),
    }


class PrepackConvWeights(CustomGraphPass):
    """Post-grad pass: the plain frozen weight of each oneDNN fp32 convolution with a symbolic input shape
    becomes the same weight in oneDNN's layout, packed for ``hint_batch`` (a compile-time constant)."""

    def __init__(self, hint_batch: int = 1) -> None:
        self.hint_batch = int(hint_batch)

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        if module is None:
            return
        for node in list(graph.nodes):
            indices = _CONV_OPS.get(node.target) if node.op == "call_function" else None
            if indices is None:
                continue
            x_index, w_index = indices
            weight = node.args[w_index]
            example = (
                node.args[x_index].meta.get("val") if isinstance(node.args[x_index], torch.fx.Node) else None
            )
            if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr" or example is None:
                continue
            value = _attribute(module, str(weight.target))
            if not isinstance(value, torch.Tensor) or value.is_mkldnn or value.dtype != torch.float32:
                continue
            if all(isinstance(size, int) for size in example.shape):
                continue  # a static shape: Inductor packed it already
            shape = [self._hint(size) for size in example.shape]
            padding, stride, dilation, groups = node.args[w_index + 2 : w_index + 6]
            packed = torch.ops.mkldnn._reorder_convolution_weight(
                value, list(padding), list(stride), list(dilation), int(groups), shape
            )
            name = PACKED_PREFIX + str(weight.target).replace(".", "_")
            module.register_buffer(name, packed)
            with graph.inserting_before(node):
                constant = graph.get_attr(name)
            constant.meta.update(weight.meta)
            node.replace_input_with(weight, constant)
            if not weight.users:
                graph.erase_node(weight)

    def _hint(self, size: Any) -> int:
        return int(size) if isinstance(size, int) else self.hint_batch

    def uuid(self) -> Any:
        return (get_hash_for_files((__file__,)), self.hint_batch)


def _attribute(module: torch.nn.Module, target: str) -> Any:
    """``module``'s attribute at the dotted ``target`` of a ``get_attr`` node (unfrozen weights keep their
    module path, e.g. ``network.layer1.conv1.weight``), or ``None``."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
