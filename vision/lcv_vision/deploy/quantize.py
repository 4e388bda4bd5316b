"""``lcv export --quantize int8``: PT2E post-training int8 quantization for x86 CPUs (torchao).

Why these choices: ``torch.ao.quantization.quantize_pt2e`` is gone in torch 2.14, its successor is
``torchao.quantization.pt2e``; ``X86InductorQuantizer`` marks the patterns Inductor lowers to oneDNN int8
kernels; the capture is strict (dynamo), because ``prepare_pt2e`` fails on the non-strict export of a ResNet
("Input partition has more than one output node": a ReLU module called twice loses its ``source_fn_stack``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable

import torch
from torch import nn

from lcv_vision.deploy.capture import capture
from lcv_vision.deploy.errors import DeployError, import_extra

__all__ = ["batch_norms_as_affine", "int8_reduce_range", "numeric_padding", "quantize_int8"]

#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) below AVX-512 with VNNI: int8 convolutions there multiply u8 x s8
#: pairs into saturating int16 sums (``vpmaddubsw``).
_ONEDNN_CAPS_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")

#: Images per calibration forward.
CALIBRATION_BATCH = 32


def int8_reduce_range() -> bool:
    """Whether activations are quantized to 7 bits (0..127) instead of 8: on a CPU whose int8 kernels run
    without VNNI, or with oneDNN or ATen capped below it, u8 x s8 products are summed in pairs into saturating
    int16, and full-range activations lose accuracy (the digits package: 93.9% against fp32's 96.9% under an
    AVX2 cap, 0.1 point on AVX-512 VNNI). The package's kernels are built for the exporting machine's ISA, so
    the exporting machine decides."""
    vnni = getattr(torch.cpu, "_is_vnni_supported", None)  # private; without it, assume no VNNI (safe side)
    if vnni is None or not vnni():
        return True
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):  # ATEN_CPU_CAPABILITY's cap
        return True
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _ONEDNN_CAPS_WITHOUT_VNNI


def quantize_int8(
    model: nn.Module, calibration: torch.Tensor, example: torch.Tensor, progress: bool = True
) -> torch.export.ExportedProgram:
    """``model`` (uint8 images -> logits) with int8 convolutions and linears, observed on ``calibration``
    (uint8 ``[N, 3, H, W]``), exported again for AOTInductor."""
    pt2e = import_extra("torchao.quantization.pt2e.quantize_pt2e", "quantize", "--quantize int8")
    x86 = import_extra(
        "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer", "quantize", "--quantize int8"
    )
    if calibration.shape[0] < 1:
        raise DeployError("int8 calibration needs at least one training image (--calibration-images N)")
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config(reduce_range=int8_reduce_range()))
    model = numeric_padding(copy.deepcopy(model))
    graph = capture(model, example, strict=True).module()
    prepared = batch_norms_as_affine(pt2e.prepare_pt2e(graph, quantizer))
    with torch.no_grad():
        for batch in _batches(calibration, progress):
            prepared(batch)
    converted = pt2e.convert_pt2e(prepared)
    return capture(converted, example, strict=True)


def batch_norms_as_affine(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each inference BatchNorm left in ``graph`` as ``x * scale + shift`` (constants), in place.

    Why: ``prepare_pt2e`` folds a BatchNorm that follows a conv into it, but not one after a pool (airbench's
    conv -> pool -> BN); for any BatchNorm left, torchao's ``convert_pt2e`` exports and matches 64 QAT
    conv-BN patterns (none can occur after post-training quantization): most of an int8 export's time (the
    digits package: 79-121 s with that search, 28-34 s without, one thread on a loaded 2-core machine). The
    same affine map, computed once, leaves it nothing to look for."""
    aten = torch.ops.aten
    changed = False
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target != aten.batch_norm.default:
            continue
        if len(node.args) < 8:
            continue
        x, weight, bias, mean, var, training, _momentum, eps = node.args[:8]
        constants = (weight, bias, mean, var)
        if training or mean is None or var is None or not all(map(_is_constant_or_none, constants)):
            continue
        value = node.meta.get("val")
        if value is None:
            continue
        exact = torch.float64
        inv_std = torch.rsqrt(_attr(graph, var).to(exact) + eps)
        scale = inv_std if weight is None else _attr(graph, weight).to(exact) * inv_std
        shift = -_attr(graph, mean).to(exact) * scale
        if bias is not None:
            shift = shift + _attr(graph, bias).to(exact)
        shape = (1, -1, *([1] * (value.dim() - 2)))
        with graph.graph.inserting_before(node):
            affine = x
            for op, constant in ((aten.mul.Tensor, scale), (aten.add.Tensor, shift)):
                name = f"{node.name}_as_{'scale' if op is aten.mul.Tensor else 'shift'}"
                graph.register_buffer(name, constant.to(value.dtype).reshape(shape))
                affine = graph.graph.call_function(op, (affine, graph.graph.get_attr(name)))
                affine.meta["val"] = value
        node.replace_all_uses_with(affine)
        graph.graph.erase_node(node)
        changed = True
    if changed:
        graph.graph.eliminate_dead_code()
        graph.recompile()
    return graph


def _is_constant_or_none(arg: object) -> bool:
    return arg is None or (isinstance(arg, torch.fx.Node) and arg.op == "get_attr")


def _attr(graph: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor:
    """The tensor a ``get_attr`` node names."""
    owner: object = graph
    for part in str(node.target).split("."):
        owner = getattr(owner, part)
    assert isinstance(owner, torch.Tensor), node.target
    return owner


def _batches(images: torch.Tensor, progress: bool) -> Iterable[torch.Tensor]:
    from tqdm.auto import tqdm

    batches = images.split(CALIBRATION_BATCH)
    return tqdm(batches, desc="int8 calibration", unit="batch", disable=not progress, leave=False)


def numeric_padding(model: nn.Module) -> nn.Module:
    """``padding="same"``/``"valid"`` convolutions with the equal numeric padding, in place.

    Why: a string padding is traced as ``aten.conv2d.padding``, which ``X86InductorQuantizer`` rejects ("is
    not an aten conv2d operator"); numeric padding gives ``aten.conv2d.default`` and the same output."""
    for name, conv in model.named_modules():
        if not isinstance(conv, nn.Conv2d) or not isinstance(conv.padding, str):
            continue
        if conv.padding == "valid":
            conv.padding = (0, 0)
            continue
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if any(t % 2 for t in totals) or conv.padding_mode != "zeros":
            raise DeployError(
                f"cannot quantize conv {name!r}: padding='same' with an even kernel {conv.kernel_size} or "
                f"padding_mode={conv.padding_mode!r} has no symmetric numeric padding"
            )
        conv.padding = (totals[0] // 2, totals[1] // 2)
    return model
