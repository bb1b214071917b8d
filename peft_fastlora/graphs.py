"""Decode steps of ``generate`` replayed from CUDA graphs.

How it plugs into HF ``generate`` without copying its loop: when a compilable (static) cache is in
use, ``generate`` runs every decode step through ``model.get_compiled_call(...)``. While a fastlora
``generate`` call is armed, that method (on the model instance only) returns this runner instead of
a ``torch.compile`` wrapper. The runner

- sends anything that is not a one-token step (prefill) to the eager forward;
- otherwise copies the step's tensors into static buffers, refreshes the LoRA batch info in place
  (``prepare_lora_batch(..., use_cuda_graph=True)``), replays the graph captured for this batch
  size and cache, and returns the captured output, whose logits are static (HF copies them).

fastlora owns the static caches (one per batch size and length bucket) and resets them between
calls, so graphs captured once are replayed by later ``generate`` calls. Anything the runner cannot
capture runs eagerly, with the reason in ``runner.stats['eager_reasons']``.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Dict, Optional

import torch

from . import _compat

logger = logging.getLogger("peft_fastlora")


class GraphUnsafe(RuntimeError):
    """Raised inside a capture when a layer would leave the static path."""


class EagerReplayGraph:
    """Stand-in for ``torch.cuda.CUDAGraph`` that re-runs the captured call: lets the whole runner
    (static buffers, in-place batch info, cache-state handling) be tested without a GPU."""

    def __init__(self):
        self._fn = None
        self._output = None

    def capture(self, fn):
        self._fn = fn
        self._output = fn()
        return self._output

    def replay(self):
        # a real graph writes into the captured output's memory: do the same with the logits
        self._output.logits.copy_(self._fn().logits)


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _length_bucket(n: int, step: int = 256) -> int:
    return -(-n // step) * step


class DecodeGraphRunner:
    """Captures and replays one-token decode steps of an HF causal LM.

    Args:
        state: the model's fastlora state (backend, adapter registry).
        hf_model: the transformers model whose forward is captured.
        fake_graphs: use ``EagerReplayGraph`` instead of CUDA graphs (tests without a GPU).
        max_graphs: captured graphs kept (oldest dropped first).
    """

    def __init__(self, state, hf_model, fake_graphs: bool = False, max_graphs: int = 8,
                 buckets=DEFAULT_BUCKETS):
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"graph buckets must be positive batch sizes, got {buckets!r}")
        self.state = state
        self.model = hf_model
        self.fake = fake_graphs
        self.max_graphs = max_graphs
        self.graphs: Dict[tuple, dict] = {}
        self.caches: Dict[tuple, object] = {}
        self.pool = None if fake_graphs else torch.cuda.graph_pool_handle()
        self.stats = {"captures": 0, "replays": 0, "eager_steps": 0, "capture_s": 0.0,
                      "capture_bytes": 0, "eager_reasons": {}}
        self.adapter_names = None  # the names of the armed generate call
        self.generation = state.generation if state is not None else 0
        self._graph_bs = 0

    # -- caches -------------------------------------------------------------------------------
    def bucket_for(self, batch_size: int):
        """The captured batch size serving ``batch_size`` rows (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def cache_for(self, batch_size: int, needed_len: int):
        """A reset static cache for ``batch_size`` rows, sized for the batch's bucket."""
        rows = self.bucket_for(batch_size)
        if rows is None:
            raise ValueError(f"batch of {batch_size} rows exceeds the largest graph bucket {self.buckets[-1]}")
        key = (rows, _length_bucket(needed_len))
        cache = self.caches.get(key)
        if cache is None:
            kernel_writes = self.state is None or self.state.options.get("fuse_kv_write", "auto") is not False
            cache = _compat.make_static_cache(self.model, key[1], batch_size=rows, kernel_writes=kernel_writes)
            self.caches[key] = cache
        else:
            cache.reset()
        return cache

    # -- the compiled-call replacement -----------------------------------------------------------
    def _eager(self, reason: str, inputs):
        self.stats["eager_steps"] += 1
        reasons = self.stats["eager_reasons"]
        reasons[reason] = reasons.get(reason, 0) + 1
        return self.model(**inputs)

    def __call__(self, **inputs):
        ids = inputs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
            return self.model(**inputs)  # prefill: eager through the backend
        if self.state is not None and (self.adapter_names is None
                                       or len(self.adapter_names) != ids.shape[0]):
            return self._eager("adapter names do not match the batch", inputs)
        cache = inputs.get(_compat.cache_kwarg_name(self.model))
        why = _compat.cache_is_graph_safe(cache)
        if why:
            return self._eager(why, inputs)
        rows = ids.shape[0]
        padded = cache.layers[0].keys.shape[0] if cache.layers[0].is_initialized else rows
        if padded < rows:
            return self._eager("the cache holds fewer rows than the batch", inputs)
        key = self._key(inputs, cache, rows, padded)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, inputs, cache, rows, padded)
            except GraphUnsafe as e:
                return self._eager(str(e), inputs)
        self._copy_inputs(entry["static"], inputs, rows)
        self._refresh_batch_info(padded)
        if self.fake and self.state is not None:
            # the emulated replay runs the layers again: they must see the capture-time state
            self.state.use_cuda_graph = True
            try:
                entry["graph"].replay()
            finally:
                self.state.use_cuda_graph = False
        else:
            entry["graph"].replay()
        self.stats["replays"] += 1
        return entry["view"](rows)

    @staticmethod
    def _flat(inputs):
        for name, v in sorted(inputs.items()):
            if isinstance(v, dict):
                for k, t in sorted(v.items()):
                    yield f"{name}.{k}", t
            else:
                yield name, v

    def _key(self, inputs, cache, rows, padded):
        parts = [id(cache), padded]
        for name, v in self._flat(inputs):
            if isinstance(v, torch.Tensor):
                shape = tuple(v.shape)
                if shape and shape[0] == rows:
                    shape = (padded,) + shape[1:]  # per-row inputs are padded to the bucket
                parts.append((name, shape, v.dtype, v.device))
            elif v is None or isinstance(v, (bool, int, float, str)):
                parts.append((name, v))
            elif v is cache:
                parts.append((name, "cache"))
            else:
                parts.append((name, type(v).__name__))
        return tuple(parts)

    @staticmethod
    def _pad(t: torch.Tensor, rows: int, padded: int) -> torch.Tensor:
        """A static copy of a per-row input with ``padded`` rows; padding rows repeat row 0 (any
        valid row: they belong to no adapter and their outputs are never read)."""
        if t.dim() == 0 or t.shape[0] != rows or rows == padded:
            return t.clone()
        out = t.new_empty((padded,) + tuple(t.shape[1:]))
        out[:rows] = t
        out[rows:] = t[:1]
        return out

    def _clone_inputs(self, inputs, rows, padded):
        out = {}
        for name, v in inputs.items():
            if isinstance(v, torch.Tensor):
                out[name] = self._pad(v, rows, padded)
            elif isinstance(v, dict):
                out[name] = {k: self._pad(t, rows, padded) if isinstance(t, torch.Tensor) else t
                             for k, t in v.items()}
            else:
                out[name] = v
        return out

    @staticmethod
    def _copy_one(dst: torch.Tensor, src: torch.Tensor, rows: int):
        if dst.shape == src.shape:
            dst.copy_(src, non_blocking=True)
        else:  # a padded per-row input: fill the real rows, padding rows keep repeating row 0
            dst[:rows].copy_(src, non_blocking=True)
            dst[rows:].copy_(src[:1].expand_as(dst[rows:]), non_blocking=True)

    def _copy_inputs(self, static, inputs, rows):
        for name, v in inputs.items():
            if isinstance(v, torch.Tensor):
                self._copy_one(static[name], v, rows)
            elif isinstance(v, dict):
                for k, t in v.items():
                    if isinstance(t, torch.Tensor):
                        self._copy_one(static[name][k], t, rows)

    def _refresh_batch_info(self, batch_size: int):
        state = self.state
        if state is None:  # a model without LoRA (the benchmark's base model)
            return
        slots = state.registry.slots_for(self.adapter_names)
        slots = slots + [-1] * (batch_size - len(slots))  # padding rows: no adapter
        ranks = state.slot_ranks()
        from .batch import ForwardBatch

        fb = ForwardBatch.from_shape(batch_size, 1, state.device)
        state.graph_batch_info = state.backend.prepare_lora_batch(
            fb, slots, ranks, [1.0] * len(ranks), use_cuda_graph=True)

    @staticmethod
    def _output_view(output, padded):
        """rows -> the captured output with its logits cut to the real rows (a view: no copy)."""
        def view(rows):
            if rows == padded:
                return output
            out = copy.copy(output)
            out["logits"] = output.logits[:rows]
            return out
        return view

    def _ensure_graph_buffers(self, batch_size: int):
        if self.state is not None and batch_size > self._graph_bs:
            # buffers sized for the largest batch seen; graphs captured earlier keep reading the
            # old buffers, so they are dropped
            self._graph_bs = max(batch_size, 2 * self._graph_bs)
            self.state.backend.init_cuda_graph_batch_info(self._graph_bs, 1)
            self.graphs.clear()

    def _capture(self, key, inputs, cache, rows, padded):
        state = self.state
        bs = padded
        self._ensure_graph_buffers(bs)
        static = self._clone_inputs(inputs, rows, padded)
        lengths = _compat.cache_state_tensors(cache)
        saved = [t.clone() for t in lengths]

        def restore():
            for t, s in zip(lengths, saved):
                t.copy_(s)

        self._refresh_batch_info(bs)
        t0 = time.perf_counter()
        if state is not None:
            state.use_cuda_graph = True
        try:
            if self.fake:
                graph = EagerReplayGraph()
                restore()
                output = graph.capture(lambda: self.model(**static))
                restore()  # the capture ran the step once; the replay below runs it for real
            else:
                mem0 = torch.cuda.memory_allocated()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                        restore()
                        self.model(**static)
                torch.cuda.current_stream().wait_stream(side)
                restore()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    output = self.model(**static)
                self.stats["capture_bytes"] += torch.cuda.memory_allocated() - mem0
        except GraphUnsafe:
            restore()
            raise
        finally:
            if state is not None:
                state.use_cuda_graph = False
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        if len(self.graphs) >= self.max_graphs:
            self.graphs.pop(next(iter(self.graphs)))
        entry = {"graph": graph, "static": static, "output": output,
                 "view": self._output_view(output, padded)}
        self.graphs[key] = entry
        return entry
