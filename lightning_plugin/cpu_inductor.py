"""Inductor tuned for *training* on a CPU: applied by the strategy's backend on its own.

Where a compiled CPU training step lost to eager (torch.profiler, torchvision resnet18, 64 px,
batch 32, fwd+bwd+SGD, 2-core x86_64 Xeon with AVX-512, torch 2.14; both ways in one process):

* Inductor's layout optimisation turns every activation around a mkldnn convolution into
  ``channels_last`` on CPU (``GraphLowering.decide_layout_opt``: "for cpu backend and mkldnn
  enabled, we always use channels_last", meant for inference). In training on this CPU the
  oneDNN convolutions got slower in that layout (mkldnn_convolution 48 ms/step against eager's
  33 ms), the conversions cost another ~12 ms/step of ``aten::copy_``, and every conv-weight
  gradient came back channels_last, so ``AccumulateGrad`` copied each one (``aten::_to_copy``,
  7 ms/step). Off, the step went from 0.82x to 1.11x eager. A model the user made
  channels_last stays channels_last: this only stops Inductor from choosing the layout itself.
* Inductor decomposes BatchNorm into its own C++ reductions (mean, variance, normalise; and the
  backward's two reductions over N, H, W) and fuses them with the neighbouring ReLU/add. On CPU,
  ATen's ``native_batch_norm``/``native_batch_norm_backward`` do one vectorised, threaded pass
  per channel block, and the generated kernels were slower than both together. Keeping batch
  norm in ATen (removing its decompositions: Inductor then calls the ATen kernels as fallbacks,
  forward, backward and the running-stat update) is what :data:`ATEN_OPS` lists.

A user's ``mode`` or ``options`` win: the strategy applies none of this when either is set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

#: Inductor config patches for CPU training (see the module docstring for the measurements).
CPU_TRAINING_OPTIONS: dict[str, Any] = {"layout_optimization": False}

#: Ops compiled as calls to their ATen CPU kernels instead of Inductor's decompositions into loops.
ATEN_OPS: tuple[Any, ...] = (
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten._batch_norm_with_update,
    aten._batch_norm_with_update_functional,
    aten._batch_norm_no_update,
    aten.batch_norm_backward,
)


def applies(backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None,
            device: torch.device | None) -> bool:
    """Whether the strategy compiles for a CPU with plain Inductor (no user ``mode`` or ``options``)."""
    return (
        device is not None
        and torch.device(device).type == "cpu"
        and backend == "inductor"
        and mode in (None, "default")
        and not options
    )


def decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor's decomposition table without the ops of :data:`ATEN_OPS`."""
    from torch._inductor.decomposition import select_decomp_table

    kept = set(ATEN_OPS)
    return {op: fn for op, fn in select_decomp_table().items() if getattr(op, "overloadpacket", op) not in kept}


class CpuInductorBackend(torch._TorchCompileInductorWrapper):
    """``torch.compile``'s Inductor backend with :data:`CPU_TRAINING_OPTIONS` and :data:`ATEN_OPS` kept in ATen.

    Equal only to another ``CpuInductorBackend`` with the same ``dynamic``: dynamo then reuses one fit's
    compiled frames in the next fit with the same settings, never a plain Inductor backend's.
    """

    def __init__(self, dynamic: bool | None) -> None:
        super().__init__(None, CPU_TRAINING_OPTIONS, dynamic)

    def __call__(self, model_: Any, inputs_: Any, *, config_patches: dict[str, Any] | None = None) -> Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(
            model_, inputs_, config_patches={**self.config, **(config_patches or {})},
            decompositions=decompositions(), compile_region_name=self.name,
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is CpuInductorBackend and super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]
