"""Inductor tuned for *training* on a CPU: the strategy's backend applies it on its own.

Where a compiled CPU training step lost to eager (torch.profiler, torchvision resnet18, 64 px,
batch 32, fwd+bwd+SGD, 2-core x86_64 Xeon with AVX-512, torch 2.14, both ways in one process):
Inductor's layout optimisation turns every activation around a mkldnn convolution into
``channels_last`` on CPU (``GraphLowering.decide_layout_opt``: "for cpu backend and mkldnn enabled,
we always use channels_last", a choice made for inference). In training on this CPU the oneDNN
convolutions got slower in that layout (``mkldnn_convolution`` 48 ms/step against eager's 33 ms),
the conversions cost another ~12 ms/step of ``aten::copy_``, and every conv-weight gradient came
back channels_last, so ``AccumulateGrad`` copied each one (``aten::_to_copy``, 7 ms/step). With the
layout left alone the step went from 0.82x/0.80x to 1.11x/1.06x eager (two runs, 2 torch threads, quiet
machine) and from 0.78x to 1.07x (1 thread, machine shared). A model the user made channels_last
stays channels_last: this only stops Inductor from choosing the layout itself.

Tried and left out: keeping batch norm in ATen (its decompositions removed, so Inductor calls
``native_batch_norm``/``native_batch_norm_backward`` as fallbacks). It matched eager in float64 but
did not pay: resnet18 0.76x with the layout optimisation, 1.05x without (against 1.07x for the
layout change alone), 1 thread, same process.

Inductor's C++ wrapper (``cpp_wrapper``): the generated code that calls the kernels and allocates the buffers
is C++ instead of Python, which saves a few ms per step of interpreter work. torchvision ResNet-18 (64 px,
batch 32, fused SGD step, same process, 2-core x86_64): 1.104x -> 1.133x eager; mobilenet_v3_small 1.16x ->
1.20x; a cold compile takes about 1.7 s longer (one more C++ build per graph). Those gains come from graphs of
hundreds of ops; on a small graph a call into the C++ wrapper costs a little more than one of the Python
wrapper (``benchmarks/cpp_wrapper.py``, fwd+bwd of an MLP, batch 4, 1 thread: +6-7 us at 1-5 ops, within
+-14 us from 17 to 49 ops, no size of it where the C++ wrapper won clearly). So a graph with fewer than
:data:`CPP_WRAPPER_MIN_OPS` ops keeps the Python wrapper (a small head, a piece between graph breaks):
``benchmarks/step_overhead.py``'s ``Linear(8, 2)`` step 17 us shorter (8 pairs against the C++ wrapper for
every graph, ``--cpp-wrapper-min-ops 0``).

Graph changes (:mod:`lightning_plugin.cpu.graph_passes`), passed by :class:`CPUTrainingInductor`: for
non-overlapping max-pools in channels_last the forward values realised once and a gather in place of torch
2.14's scatter for the backward, a bias-only conv backward as a fused sum, that bias's gradient through the
next conv as a weight gradient instead of an input gradient, a wide conv's weight gradient on a tiny map as a
matrix product, and GELU's erf saved for the backward instead of recomputed (``digits-small``'s network:
0.91x -> 1.09-1.10x eager; resnet18 1.10x -> 1.21x).

A user's ``mode`` or ``options`` win: the strategy applies none of this when either is set, nor with
``CompileConfig(tune_cpu=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lcv_kernels.cpp_extension_notice import quiet_cpp_extension_notice
from lightning_plugin.cpu.graph_passes import graph_pass_options, training_decompositions

#: Inductor config patches for CPU training (see the module docstring for the measurements).
CPU_TRAINING_OPTIONS: dict[str, Any] = {"layout_optimization": False, "cpp_wrapper": True}

#: Graphs with fewer operations than this keep Inductor's Python wrapper (module docstring).
CPP_WRAPPER_MIN_OPS = 24


def graph_op_count(graph_module: Any) -> int:
    """Operations in a Dynamo graph: its function, method and module calls (inputs, outputs, attributes not)."""
    graph = getattr(graph_module, "graph", None)
    if graph is None:
        return CPP_WRAPPER_MIN_OPS  # not an FX graph: no reason to change the setting
    return sum(node.op in ("call_function", "call_method", "call_module") for node in graph.nodes)


quiet_cpp_extension_notice()  # the C++ wrapper's first build logs a CUDA notice that concerns no CPU graph


def training_options(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    device: torch.device | None,
    tune_cpu: bool = True,
) -> dict[str, Any] | None:
    """:data:`CPU_TRAINING_OPTIONS` when the strategy compiles for a CPU with plain Inductor, else ``None``.

    Plain means no user ``mode`` and no ``options``: those are the user's choice and win.
    """
    plain = tune_cpu and backend == "inductor" and mode in (None, "default") and not options
    if plain and device is not None and torch.device(device).type == "cpu":
        return dict(CPU_TRAINING_OPTIONS)
    return None


class CPUTrainingInductor(torch._TorchCompileInductorWrapper):
    """``torch.compile``'s Inductor backend (the same ``mode``/``options`` handling and equality) that also
    gives Inductor :mod:`lightning_plugin.cpu.graph_passes`: its decompositions and its joint-graph pass
    (neither where the user installed a joint-graph pass of their own in Inductor's config), and writes the
    C++ wrapper only for graphs of :data:`CPP_WRAPPER_MIN_OPS` ops or more."""

    def __call__(self, model_: Any, inputs_: Any, *, config_patches: dict[str, Any] | None = None) -> Any:
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        if config.joint_custom_pre_pass is not None:  # a pass of the user's own: their Inductor, unchanged
            return super().__call__(model_, inputs_, config_patches=config_patches)
        patches = {**self.config, **graph_pass_options(), **(config_patches or {})}
        asked = "cpp_wrapper" in (config_patches or {})  # a caller's own setting stands
        if patches.get("cpp_wrapper") and not asked and graph_op_count(model_) < CPP_WRAPPER_MIN_OPS:
            patches["cpp_wrapper"] = False
        return compile_fx(model_, inputs_, config_patches=patches, decompositions=training_decompositions())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # equal by settings, like the class it extends
