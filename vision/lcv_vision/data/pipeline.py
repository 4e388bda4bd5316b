"""A composable pipeline of batched augmentation ops with per-sample random parameters, compiled.

A batch goes through three stages (see :mod:`lcv_vision.data.ops` for the op contract): the parameters of every
op are drawn on the CPU from one generator (:meth:`Pipeline.sample`), turned into per-sample tables on the
CPU (``prepare``), and the ops' ``apply`` run on the device.  With ``compile=True`` (the default) the
``apply`` chain runs as one ``torch.compile`` graph (:mod:`lcv_vision.data.compiled`); ops that cannot be traced
(``compilable = False``) run eagerly between compiled runs of the others.  A compile failure falls back to
the eager ops with one warning.  Both paths give the same images: bitwise for integer ops (crops, flips,
grayscale on uint8, erasing), within float rounding (a few 1e-4 of a level) for arithmetic.

Images flow through the ops as ``(N, C, H, W)`` tensors: uint8 while only indexing ops (crop, flip)
touch them (and, on the CPU, after a resize of whole-pixel boxes), float32 in 0..255 units after the first
arithmetic op, and in normalized units after :class:`~lcv_vision.data.color.Normalize`.  Batches whose images
have different sizes enter as a :class:`RaggedBatch`; the first op must then be a resizing op that brings
them to one size.

On the CPU, batches of large images run in slices of a few samples on single-threaded workers (see
:meth:`Pipeline._map_rows`), eager or compiled; small images run compiled as one call, the kernels splitting
the batch across the threads.  Ops whose eager kernel beats Inductor's code there say so (``compiles_on``:
the uint8 resize) and run between the compiled runs; the last graph leaves the channels_last copy to ATen,
and the outputs of large images reuse the memory of batches the caller dropped (:mod:`lcv_vision.data.buffers`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lcv_vision.data.buffers import OutputBuffers
from lcv_vision.data.color import Normalize
from lcv_vision.data.compiled import CompiledOps, ops_runner
from lcv_vision.data.functional.pool import run_parts
from lcv_vision.data.ops import BatchOp, Params, RaggedBatch, check_image_batch

__all__ = ["BatchOp", "Params", "Pipeline", "RaggedBatch", "check_image_batch"]


def _params_to(params: Params, device: torch.device) -> Params:
    if device.type == "cpu":
        return params
    return {k: v.to(device, non_blocking=True) for k, v in params.items()}


class Pipeline:
    """A list of :class:`BatchOp` run on whole batches, ending in the requested dtype and memory format.

    Args:
        ops: the ops, in order.
        dtype: floating dtype of the output images (e.g. ``torch.float32`` or ``torch.bfloat16``).
        channels_last: return images in ``torch.channels_last`` memory format.
        compile: run the ops' ``apply`` as one ``torch.compile`` graph (compiled on the first batch, once per
            input and output size); ``False`` runs them eagerly.
    """

    def __init__(
        self,
        ops: Sequence[BatchOp],
        dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        compile: bool = True,
    ):
        ops = list(ops)
        for i, op in enumerate(ops):
            if not isinstance(op, BatchOp):
                raise TypeError(f"Pipeline: op {i} is {type(op).__name__}, not a lcv_vision.data BatchOp")
        if not dtype.is_floating_point:
            raise TypeError(f"Pipeline: output dtype must be floating point, got {dtype}")
        self.ops = ops
        self.dtype = dtype
        self.channels_last = channels_last
        self.compile = compile
        self._steps = _fold_steps(ops)
        self._segments: dict[str, list[tuple[int, int, CompiledOps | None]]] = {}
        self._compile_failed = False
        self._outputs = OutputBuffers()
        self._compiled_on_workers = False

    @property
    def mixes_targets(self) -> bool:
        return any(op.mixes_targets for op in self.ops)

    def batch_normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """``(mean, std)`` in 0..1 units of the last :class:`~lcv_vision.data.color.Normalize` op: what a viewer
        of the output must undo (``TrainingMonitor``'s image grid asks, through the loader); None without
        one."""
        for op in reversed(self.ops):
            if isinstance(op, Normalize):
                return op.mean, op.std
        return None

    def sample(self, n: int, height: Any, width: Any, generator: torch.Generator) -> list[Params]:
        """Draw the parameters of every op for one batch (CPU tensors), tracking the size through the ops."""
        all_params = []
        for op in self.ops:
            all_params.append(op.sample(n, height, width, generator))
            height, width = op.output_size(height, width)
        return all_params

    def __call__(
        self,
        images: Tensor | RaggedBatch,
        targets: Tensor | None = None,
        generator: torch.Generator | None = None,
        params: list[Params] | None = None,
        index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Augment one batch. ``params`` (from :meth:`sample`) replaces sampling when given.

        With ``index`` (N,), ``images`` is a larger store and the batch is ``images[index]``; a first op that
        can, fuses that gather into its own (saves one pass over the batch).  ``index`` is best given on
        the CPU (the tables built from it are CPU work).
        """
        ragged = isinstance(images, RaggedBatch)
        if index is not None:
            if isinstance(images, RaggedBatch):
                raise TypeError("Pipeline: index= is only supported with a tensor image store")
            check_image_batch(images)
            if not (self.ops and self.ops[0].fuses_gather):
                images, index = images.index_select(0, index.to(images.device)), None
        height: Tensor | int  # per image (a RaggedBatch's sizes) or the batch's
        width: Tensor | int
        if isinstance(images, RaggedBatch):
            if not self.ops or not self.ops[0].accepts_ragged:
                first = type(self.ops[0]).__name__ if self.ops else "nothing"
                raise ValueError(
                    "Pipeline: images of different sizes need a resizing first op "
                    f"(RandomResizedCrop, Resize, ResizeCenterCrop), but the first op is {first}"
                )
            source, n, height, width = images.canvas, len(images), images.heights, images.widths
        else:
            check_image_batch(images)
            source = images
            n = index.shape[0] if index is not None else images.shape[0]
            height, width = int(images.shape[-2]), int(images.shape[-1])
        # Parameters and tables are made outside inference mode (Lightning evaluates in it): inference tensors
        # would be new kinds of inputs to the compiled graph, compiling it a second time.
        with torch.inference_mode(False), torch.no_grad():
            if params is None:
                generator = generator if generator is not None else torch.Generator().manual_seed(0)
                params = self.sample(n, height, width, generator)
            if len(params) != len(self.ops):
                raise ValueError(f"Pipeline: got {len(params)} param dicts for {len(self.ops)} ops")
            prepared = self._prepare(params, tuple(source.shape), n, index, source.device)
        index = index.to(source.device) if index is not None else None
        if not self.compile or self._compile_failed or n == 1:
            # A batch of one runs eagerly: PyTorch specialises sizes 0 and 1, so it would compile a second
            # graph.
            return self._run_eager(source, prepared, index, targets)
        try:
            with torch.inference_mode(False), torch.no_grad():
                out, targets = self._run_compiled(source, prepared, index, targets, ragged)
        except Exception as compiled_error:
            out, targets = self._run_eager(source, prepared, index, targets)  # the ops' own errors raise here
            self._compile_failed = True
            message = str(compiled_error).strip().splitlines()[0] if str(compiled_error).strip() else ""
            warnings.warn(
                f"Pipeline: torch.compile failed ({type(compiled_error).__name__}: {message}); "
                "running this pipeline's ops eagerly from now on",
                stacklevel=2,
            )
        return out, targets

    # ------------------------------------------------------------------------------------------- planning
    def _prepare(
        self, params: list[Params], shape: tuple[int, ...], n: int, index: Tensor | None, device: torch.device
    ) -> list[Params]:
        """Per step: the params of its op and of the ops folded into it, made into tables (CPU), on
        ``device``."""
        index_cpu = index.cpu() if index is not None else None
        prepared: list[Params] = []
        for step in self._steps:
            op = self.ops[step[0]]
            merged = dict(params[step[0]])
            for j in step[1:]:
                merged.update(self.ops[j].fold_as(params[j]))
            if op.prepares_on_device:
                merged = _params_to(merged, device)
            prepared.append(
                _params_to(op.prepare(merged, shape, index_cpu if not prepared else None), device)
            )
            height, width = op.output_size(shape[-2], shape[-1])
            shape = (n, shape[1], int(height), int(width))
        return prepared

    def _finish(self, x: Tensor) -> Tensor:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        return x.to(self.dtype).contiguous(memory_format=fmt)

    def _cast(self, x: Tensor) -> Tensor:
        return x.to(self.dtype)

    def _step_ops(self) -> list[BatchOp]:
        return [self.ops[step[0]] for step in self._steps]

    def _compiled_segments(self, device: torch.device) -> list[tuple[int, int, CompiledOps | None]]:
        """Runs of steps: ``(start, end, compiled runner)``, the runner None for ops not compiled on
        ``device``."""
        if device.type not in self._segments:
            ops = self._step_ops()
            compiles = [op.compiles_on(device) for op in ops]
            segments, start = [], 0
            for end in range(1, len(ops) + 1):
                if end == len(ops) or compiles[end] != compiles[start]:
                    last = end == len(ops)
                    compiled = None
                    if compiles[start]:
                        finish = self._finish if device.type != "cpu" else self._cast
                        compiled = CompiledOps(ops_runner(ops[start:end], finish if last else None), device)
                    segments.append((start, end, compiled))
                    start = end
            self._segments[device.type] = segments
        return self._segments[device.type]

    # ------------------------------------------------------------------------------------------- running
    def _run_compiled(
        self, x: Tensor, prepared: list[Params], index: Tensor | None, targets: Tensor | None, ragged: bool
    ) -> tuple[Tensor, Tensor | None]:
        ops = self._step_ops()
        if not ops:
            return self._finish(x), targets
        n = index.shape[0] if index is not None else x.shape[0]
        if (
            x.device.type == "cpu"
            and not self.mixes_targets
            and n > _LARGE_CHUNK
            and self._output_pixels(x) >= _LARGE_OUTPUT
        ):
            # Large images: some per call (see _large_chunk), so that the kernels' intermediate planes stay
            # in the core's cache (the whole batch's would go through memory: twice as slow on a 2-core CPU),
            # on single-threaded workers like the eager path (see _map_rows).
            out = self._empty_output(n, x)

            def run_rows(rows: slice) -> None:
                part = [{k: v[rows] for k, v in p.items()} for p in prepared]
                sub = (x, index[rows]) if index is not None else (x[rows], None)
                self._run_segments(ops, sub[0], part, sub[1], None, ragged, out[rows])

            self._map_rows(n, _large_chunk(n), run_rows, first_alone=not self._compiled_on_workers)
            self._compiled_on_workers = True
            return out, targets
        return self._run_segments(ops, x, prepared, index, targets, ragged)

    def _run_segments(
        self,
        ops: list[BatchOp],
        x: Tensor,
        prepared: list[Params],
        index: Tensor | None,
        targets: Tensor | None,
        ragged: bool,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        for start, end, compiled in self._compiled_segments(x.device):
            last = end == len(ops)
            if compiled is not None and x.device.type == "cpu":
                # On the CPU the graph ends in the output dtype but keeps its own layout: ATen's eager copy
                # to channels_last is 4x cheaper than Inductor's scalar stores for it (a no-op when the
                # graph's output is channels_last already, as a crop's gather is).  Into ``out`` (it has the
                # output's dtype and layout) that is one copy, not a converted copy and then a second one.
                x, targets = compiled(x, prepared[start:end], index, targets, ragged and start == 0, None)
                if last:
                    x = out.copy_(x) if out is not None else self._finish(x)
            elif compiled is not None:
                x, targets = compiled(
                    x, prepared[start:end], index, targets, ragged and start == 0, out if last else None
                )
            else:
                x, targets = ops_runner(ops[start:end], self._finish if last else None)(
                    x, prepared[start:end], index, targets, out if last else None
                )
            index = None
        return x, targets

    def _run_eager(
        self, source: Tensor, prepared: list[Params], index: Tensor | None, targets: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        ops = self._step_ops()
        n = index.shape[0] if index is not None else source.shape[0]
        if source.device.type == "cpu" and not self.mixes_targets:
            chunk = _cpu_chunk_size(n, self._output_pixels(source))
            if chunk < n:
                out = self._empty_output(n, source)
                self._run_chunked(ops, source, prepared, chunk, index, out)
                return out, targets
        return ops_runner(ops, self._finish)(source, prepared, index, targets)

    def _output_size(self, source: Tensor) -> tuple[int, int]:
        height, width = int(source.shape[-2]), int(source.shape[-1])
        for op in self.ops:
            height, width = op.output_size(height, width)
        return int(height), int(width)

    def _output_pixels(self, source: Tensor) -> int:
        height, width = self._output_size(source)
        return height * width

    def _empty_output(self, n: int, source: Tensor) -> Tensor:
        height, width = self._output_size(source)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        shape = (n, source.shape[1], int(height), int(width))
        if source.device.type == "cpu":
            return self._outputs.take(shape, self.dtype, fmt)
        return torch.empty(shape, dtype=self.dtype, device=source.device, memory_format=fmt)

    def _run_chunked(
        self,
        ops: list[BatchOp],
        source: Tensor,
        prepared: list[Params],
        chunk: int,
        index: Tensor | None,
        out: Tensor,
    ) -> None:
        """Eagerly on CPU: run the ops on slices of the batch (see :meth:`_map_rows`)."""

        def run_rows(rows: slice) -> None:
            x = source if index is not None else source[rows]
            part = [{k: v[rows] for k, v in p.items()} for p in prepared]
            ops_runner(ops, None)(x, part, index[rows] if index is not None else None, None, out[rows])

        self._map_rows(out.shape[0], chunk, run_rows)

    @staticmethod
    def _map_rows(n: int, chunk: int, run_rows: Callable[[slice], None], first_alone: bool = False) -> None:
        """Run ``run_rows`` on slices of ``chunk`` samples, in parallel on single-threaded workers.

        Same result as the whole batch (every op is per sample).  Workers with one thread each, rather than
        multi-threaded ops, keep going when another process takes a core (no barrier after every op), like
        the worker processes of a DataLoader.  ``first_alone`` runs the first slice before the others start
        (it compiles the graph: once, on one worker).
        """
        run_parts(run_rows, [slice(s, s + chunk) for s in range(0, n, chunk)], first_alone)

    def __repr__(self) -> str:
        inner = "".join(f"\n  {op!r}," for op in self.ops)
        return (
            f"Pipeline([{inner}\n], dtype={self.dtype}, channels_last={self.channels_last}, "
            f"compile={self.compile})"
        )


def _fold_steps(ops: list[BatchOp]) -> list[list[int]]:
    """Group each op with the ops right after it that it declares it can take over
    (``folds``/``fold_key``)."""
    steps: list[list[int]] = []
    i = 0
    while i < len(ops):
        step, taken = [i], set()
        while i + len(step) < len(ops):
            key = ops[i + len(step)].fold_key
            if key is None or key not in ops[i].folds or key in taken:
                break
            taken.add(key)
            step.append(i + len(step))
        steps.append(step)
        i += len(step)
    return steps


#: Output pixels per sample above which CPU chunks hold a few samples (their float intermediates then stay
#: in the per-core cache: 4 x 224^2 x 3 float32 ~ 2.4 MB); below it the batch is split across the threads.
_LARGE_OUTPUT = 96 * 96
#: Fewest and most samples per compiled call on a CPU worker for large outputs (see _large_chunk).
_LARGE_CHUNK = 4
_LARGE_CHUNK_MAX = 16


def _large_chunk(n: int) -> int:
    """Samples per compiled call for large outputs: as many as still give every thread two calls (4 to 16).

    Each call costs about 0.2 ms of slicing, guards and launching, a tenth of four 224 px samples' work; the
    compiled colour ops keep one sample's planes at a time in a local buffer, so a larger call does not leave
    the cache.  At least two calls per thread keep the threads evenly loaded.
    """
    return max(_LARGE_CHUNK, min(_LARGE_CHUNK_MAX, n // (2 * torch.get_num_threads())))


def _cpu_chunk_size(n: int, out_pixels: int) -> int:
    threads = torch.get_num_threads()
    if out_pixels >= _LARGE_OUTPUT:
        return 4
    return max(1, -(-n // (4 * threads)))
