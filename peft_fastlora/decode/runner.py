"""Decode steps of ``generate`` replayed from CUDA graphs.

How it plugs into HF ``generate`` without copying its loop: when a compilable (static) cache is in
use, ``generate`` runs every decode step through ``model.get_compiled_call(...)``. While a fastlora
``generate`` call is armed (``generate.py``), that method returns this runner instead of a
``torch.compile`` wrapper. The runner

- sends anything that is not a one-token step (prefill) to the eager forward;
- otherwise copies the step's tensors into static buffers, refreshes the LoRA batch info in place
  (``prepare_lora_batch(..., use_cuda_graph=True)``), replays the graph captured for this batch
  bucket and cache, and returns the captured output, whose logits are static (HF copies them).

What it keeps, and for how long:

- static KV caches: ``StaticCacheStore``, one per batch bucket, all views of one buffer;
- graphs: at most ``max_graphs`` (least recently used dropped first), all in one ``GraphPool``.
  A graph is dropped when its cache is replaced, when it is evicted, or, all of them, when the
  adapter stacks or fused weights are rebuilt (they hold their addresses). The pool itself is
  released with the last graph and a fresh one made for the next capture;
- batch-info buffers: the backend's, initialised once for the largest bucket
  (``init_cuda_graph_batch_info``); re-initialised (all graphs dropped) only when the adapter slots
  outgrow them or the backend is replaced.

A capture that fails for any reason leaves the process healthy (``capture.capture``); the step
and every later step of the same shape run eagerly, with the reason recorded in ``stats`` and
logged once.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections import OrderedDict
from typing import Dict, Optional

import torch

from ..compat.generate import cache_kwarg_name
from ..batch import NO_LORA_BATCH, ForwardBatch
from . import early_launch, step_advance
from .capture import EmulatedGraph, GraphPool, GraphUnsafe, capture
from .static_cache import CacheUnavailable, StaticCacheStore, cache_state_tensors

logger = logging.getLogger("peft_fastlora")


class DecodeGraphRunner:
    """Captures and replays one-token decode steps of an HF causal LM.

    Args:
        state: the model's fastlora state (options, backend, adapter registry, forward context).
        hf_model: the transformers model whose forward is captured.
        emulate: use ``EmulatedGraph`` instead of CUDA graphs (tests without a GPU).
    """

    def __init__(self, state, hf_model, emulate: bool = False):
        opts = state.options
        self.state = state
        self.model = hf_model
        self.emulate = emulate
        self.buckets = opts.graph_buckets
        self._max_graphs = opts.max_graphs
        self.caches = StaticCacheStore(hf_model, kernel_writes=opts.fuse_kv_write is not False,
                                       budget_bytes=opts.cache_budget_bytes)
        self.graphs: "OrderedDict[tuple, dict]" = OrderedDict()  # least recently used first
        self.failed: Dict[tuple, str] = {}  # graph key -> why its capture failed
        # keys of ``failed`` whose capture ran out of memory: tried again at the next call, which may
        # find the memory that an earlier call held freed
        self._short_of_memory: set = set()
        self.pool: Optional[GraphPool] = None
        self.adapter_names = None  # the names of the armed generate call
        self.generation = state.generation
        self._batch_info_backend = None  # the backend whose graph batch info is initialised
        self._counters = {"captures": 0, "replays": 0, "eager_steps": 0, "capture_s": 0.0,
                          "capture_failures": 0, "evictions": 0, "graphs_dropped": 0,
                          "deferred_stop_calls": 0, "steps_undone": 0, "fused_selection_calls": 0,
                          "advanced_calls": 0, "advanced_steps": 0, "early_edges": 0, "released_for_room": 0}
        self.eager_reasons: Dict[str, int] = {}
        self.selection_reasons: Dict[str, int] = {}  # why deferred calls kept transformers' token selection
        self.advance_reasons: Dict[str, int] = {}  # why fused-selection calls built their inputs on the host
        self.last_step = None  # (graph entry, rows, the step's inputs, batch info) of the last replay
        # the armed call passed its own position_ids (they may pass the cache's length): no rotary tables
        self.own_positions = False

    @property
    def max_graphs(self) -> int:
        """``max_graphs``, or one graph per bucket, two where some sites fold per call (a call that
        folds them and one that does not run different graphs)."""
        if self._max_graphs is not None:
            return self._max_graphs
        return len(self.buckets) * (2 if self.state.folds_per_call() else 1)

    # -- stats ------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters, the reasons any decode step or call ran eagerly, and the memory held now:
        ``cache_bytes`` (the static KV caches) and ``graph_pool_bytes`` (reserved by the graphs'
        pool; None when torch cannot say). ``early_edges``: expands set to launch early in the
        graphs captured (``early_launch``); ``early_launch_off``: why none are (None: they may be);
        ``rotary_table_off``: rotary embedding classes whose table failed its check (``rotary_tables``)."""
        out = dict(self._counters)
        out["graphs"] = len(self.graphs)
        out["cache_bytes"] = self.caches.nbytes()
        out["graph_pool_bytes"] = (self.pool.reserved_bytes() if self.pool is not None else 0)
        out["eager_reasons"] = dict(self.eager_reasons)
        out["selection_reasons"] = dict(self.selection_reasons)
        out["advance_reasons"] = dict(self.advance_reasons)
        out["early_launch_off"] = early_launch.unavailable
        ops = self.state.base_ops
        out["rotary_table_off"] = dict(ops.rotary_tables.off) if ops is not None and ops.rotary_tables else {}
        return out

    def note_eager(self, reason: str, steps: int = 0):
        """Record (and log once per reason) that a call or a step decodes eagerly."""
        if reason not in self.eager_reasons:
            logger.warning("fastlora: decoding eagerly (no CUDA graph): %s", reason)
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        self._counters["eager_steps"] += steps

    def note_deferred_stop(self, steps_undone: int):
        """A call that read its stop flag one step late has finished (``deferred_stop.py``)."""
        self._counters["deferred_stop_calls"] += 1
        self._counters["steps_undone"] += steps_undone

    def note_token_selection(self, blocker: Optional[str]):
        """A deferred call's token selection: fused (``greedy_loop``; ``blocker`` None) or why not."""
        if blocker is None:
            self._counters["fused_selection_calls"] += 1
        else:
            self.selection_reasons[blocker] = self.selection_reasons.get(blocker, 0) + 1

    # -- per generate call -----------------------------------------------------------------------
    def bucket_for(self, batch_size: int) -> Optional[int]:
        """The captured batch size serving ``batch_size`` rows (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def begin_call(self, rows: int, needed_len: int, reset: bool = True):
        """The static cache for a call of ``rows`` rows and ``needed_len`` tokens; raises
        ``CacheUnavailable`` (the call then decodes eagerly)."""
        for key in self._short_of_memory:
            self.failed.pop(key, None)
        self._short_of_memory.clear()
        bucket = self.bucket_for(rows)
        if bucket is None:
            # one reason for every such size: it is logged once
            raise CacheUnavailable(f"batch larger than the largest graph bucket ({self.buckets[-1]} rows)")
        if self.generation != self.state.generation:
            self.drop_graphs()  # they read stacks or fused weights that were rebuilt
            self.generation = self.state.generation
        self._ensure_batch_info()
        if self.caches.would_grow(bucket, needed_len):
            self.drop_graphs()  # they hold the old buffers: freed before the new ones are allocated
        try:
            cache = self.caches.cache_for(bucket, needed_len, reset=reset)
        finally:
            self._drop_graphs_of_replaced_caches()
        return cache

    def _ensure_batch_info(self):
        backend = self.state.backend
        if backend is None:
            return
        slots = self.state.registry.num_slots
        if backend is self._batch_info_backend and slots <= backend.graph_slot_capacity():
            return
        self.drop_graphs()  # they read the buffers about to be replaced
        backend.init_cuda_graph_batch_info(self.buckets[-1], 1, max_slots=slots)
        self._batch_info_backend = backend

    # -- dropping graphs ---------------------------------------------------------------------------
    def drop_graphs(self):
        """Free every graph and the pool they share (a fresh pool serves the next capture)."""
        if self.graphs:
            self._counters["graphs_dropped"] += len(self.graphs)
        self.graphs.clear()
        self.last_step = None
        self.failed.clear()
        self._short_of_memory.clear()
        if self.pool is not None:
            self.pool = None
            if torch.cuda.is_available() and not self.emulate:
                torch.cuda.empty_cache()  # hand the pool's memory back to the device

    def _drop(self, key):
        if self.last_step is not None and self.last_step[0] is self.graphs[key]:
            self.last_step = None
        self.graphs.pop(key)
        self._counters["graphs_dropped"] += 1
        if not self.graphs:
            self.drop_graphs()

    def _drop_graphs_of_replaced_caches(self):
        live = self.caches.live_serials()
        for key in [k for k in self.graphs if k[0] not in live]:
            self._drop(key)
        for key in [k for k in self.failed if k[0] not in live]:
            del self.failed[key]
            self._short_of_memory.discard(key)

    def release(self):
        """Free everything: graphs, pool, caches (unpatch)."""
        self.drop_graphs()
        self.caches.clear()

    def make_room(self, rows: int, needed_len: int) -> bool:
        """Before a call that decodes eagerly (its own KV cache, as PEFT's path would build): free
        the graphs, their pool and the static caches when the device's free memory would not hold
        twice that call's KV cache (the prefill's activations take about as much again), so that
        the graphs' memory never makes a call fail that PEFT's path alone would serve. True when
        freed; the graphs are captured again by the next call that takes them."""
        held = self.caches.nbytes()
        if held == 0:
            return False
        free = self._free_bytes()
        if free is None or free >= 2 * rows * needed_len * self.caches.bytes_per_token():
            return False
        self.release()
        self._counters["released_for_room"] += 1
        self.state.warn_once(
            "a call that decodes eagerly found too little free memory beside the graphs' static cache: the "
            "graphs and their cache were freed, and are captured again by the next call that takes them")
        return True

    def _free_bytes(self) -> Optional[int]:
        """Bytes the device can still hand out: free on the device, and what PyTorch's allocator
        holds unused (None off CUDA)."""
        device = self.caches.device
        if self.emulate or device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    # -- the compiled-call replacement -------------------------------------------------------------
    def _eager(self, reason: str, inputs):
        self.note_eager(reason, steps=1)
        return self.model(**inputs)

    def __call__(self, **inputs):
        ids = inputs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
            return self.model(**inputs)  # prefill: eager through the backend
        rows = ids.shape[0]
        if self.state.has_lora and (self.adapter_names is None or len(self.adapter_names) != rows):
            return self._eager("adapter names do not match the batch", inputs)
        cache = inputs.get(cache_kwarg_name(self.model))
        serial = self.caches.serial_of(cache)
        if serial is None:
            return self._eager("the step's cache is not one of fastlora's static caches", inputs)
        padded = cache.layers[0].keys.shape[0]
        if padded < rows:
            return self._eager("the cache holds fewer rows than the batch", inputs)
        key = self._key(inputs, serial, cache, rows, padded)
        if key in self.failed:
            return self._eager(self.failed[key], inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, inputs, cache, rows, padded)
            if entry is None:
                return self._eager(self.failed[key], inputs)
        else:
            self.graphs.move_to_end(key)
        self._copy_inputs(entry["static"], inputs, rows)
        batch_info = self._refresh_batch_info(padded)
        self._replay(entry, batch_info)
        self.last_step = (entry, rows, inputs, batch_info)
        return entry["view"](rows)

    def _replay(self, entry, batch_info):
        if self.emulate:  # the emulated replay runs the layers again, in the captured context
            with self.state.forward_context(batch_info), self._rotary_context(entry["cache_len"]):
                entry["graph"].replay()
        else:
            entry["graph"].replay()
        self._counters["replays"] += 1

    # -- greedy steps whose next inputs the GPU writes (``step_advance``) ---------------------------
    def step_advance(self, max_length: int, n_stop: Optional[int], suppress: Optional[torch.Tensor],
                     n_suppress_most: int, select):
        """A ``StepAdvance`` for the step just replayed (``last_step``), or None with the reason
        recorded in ``advance_reasons``. Captured on first use; where that fails, it runs its ops
        eagerly (the reason is logged and counted). ``n_stop``: the EOS ids' count (None: no EOS
        criterion); ``suppress``: the ids a minimum length suppresses now; ``n_suppress_most``: the
        most it will; ``select``: the loop's token selection."""
        if self.last_step is None:
            why = "the step was not replayed from a graph"
        else:
            entry, rows, inputs, _ = self.last_step
            why = step_advance.blocker(inputs, rows, max_length, n_suppress_most)
        if why is not None:
            self.advance_reasons[why] = self.advance_reasons.get(why, 0) + 1
            return None
        # one per kind of call: any rows of the bucket, EOS list and suppressed ids share it (at most four)
        key = (n_stop is not None, suppress is not None)
        kept = entry.setdefault("advance", {})
        adv = kept.get(key)
        if adv is None:
            adv = step_advance.StepAdvance(entry["static"], entry["output"].logits, *key, select)
            if not self.emulate:
                try:
                    adv.capture(self.pool, capture)
                except Exception as e:  # noqa: BLE001 - its ops then run eagerly, as captured they would
                    why = f"step-advance capture failed ({type(e).__name__}: {e})"
                    logger.warning("fastlora: %s; its ops run eagerly", why)
                    self.advance_reasons[why] = self.advance_reasons.get(why, 0) + 1
            kept[key] = adv
        return adv

    def replay_advanced(self, adv):
        """One greedy step from the GPU's own inputs: the last step's graph, then ``adv``'s."""
        entry, _, _, batch_info = self.last_step
        self._replay(entry, batch_info)
        adv.run()
        self._counters["advanced_steps"] += 1

    def note_advanced_call(self):
        self._counters["advanced_calls"] += 1

    @staticmethod
    def _flat(inputs):
        for name, v in sorted(inputs.items()):
            if isinstance(v, dict):
                for k, t in sorted(v.items()):
                    yield f"{name}.{k}", t
            else:
                yield name, v

    def _key(self, inputs, serial, cache, rows, padded):
        parts = [serial, padded, ("fold", self.state.context().folds()), ("rotary_table", self._rotary_tables() is not None)]
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
        """The step's batch info, written in place into the backend's static buffers (the ones the
        graphs read); a model without LoRA has none (a placeholder marks the graphed context)."""
        state = self.state
        if not state.has_lora:
            return NO_LORA_BATCH
        slots = state.registry.slots_for(self.adapter_names)
        slots = slots + [-1] * (batch_size - len(slots))  # padding rows: no adapter
        ranks = state.slots.slot_ranks()
        fb = ForwardBatch.from_shape(batch_size, 1, state.device)
        return state.backend.prepare_lora_batch(fb, slots, ranks, [1.0] * len(ranks), use_cuda_graph=True)

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

    def _capture(self, key, inputs, cache, rows, padded) -> Optional[dict]:
        """Capture the step for ``key``; None (with ``self.failed[key]`` set) when that fails."""
        while len(self.graphs) >= self.max_graphs:
            self._counters["evictions"] += 1
            self._drop(next(iter(self.graphs)))
        lengths = cache_state_tensors(cache)
        saved = [t.clone() for t in lengths]

        def restore():
            for t, s in zip(lengths, saved):
                t.copy_(s)

        t0 = time.perf_counter()
        try:
            static = self._clone_inputs(inputs, rows, padded)
            batch_info = self._refresh_batch_info(padded)
            cache_len = self.caches.length_of(cache)
            with self.state.forward_context(batch_info), self._rotary_context(cache_len):
                if self.emulate:
                    graph = EmulatedGraph()
                    restore()
                    output = graph.capture(lambda: self.model(**static))
                else:
                    if self.pool is None:
                        self.pool = GraphPool()
                    graph, output = capture(lambda: self.model(**static), self.pool, restore)
        except Exception as e:  # noqa: BLE001 - any failure: this shape decodes eagerly from now on
            restore()
            why = str(e) if isinstance(e, GraphUnsafe) else f"capture failed ({type(e).__name__}: {e})"
            self.failed[key] = why
            if isinstance(e, torch.OutOfMemoryError):
                self._short_of_memory.add(key)
            self._counters["capture_failures"] += 1
            if not self.graphs:
                self.drop_graphs_keep_failures()
            logger.warning("fastlora: could not capture a decode graph for %d rows: %s", padded, why)
            return None
        restore()  # the emulated capture ran the step once; the replay runs it for real
        self._counters["captures"] += 1
        self._counters["early_edges"] += getattr(graph, "fastlora_early_edges", 0)
        self._counters["capture_s"] += time.perf_counter() - t0
        tables = self._rotary_tables()
        entry = {"graph": graph, "static": static, "output": output, "cache_len": cache_len,
                 "view": self._output_view(output, padded),
                 "rotary_tables": tables.held() if tables is not None else []}  # the graph reads them
        self.graphs[key] = entry
        return entry

    def _rotary_tables(self):
        """The model's ``RotaryTables`` where this call's steps may read cos / sin from them: positions
        transformers derives (below the cache's length), tables installed and switched on."""
        ops = self.state.base_ops
        tables = ops.rotary_tables if ops is not None else None
        if self.own_positions or tables is None or not tables.modules:
            return None
        return tables

    def _rotary_context(self, cache_len):
        """Inside a captured or emulated step: the rotary tables active for the cache's positions (the
        deferred stop check's extra step reads one past them)."""
        tables = self._rotary_tables()
        if tables is None or cache_len is None:
            return contextlib.nullcontext()
        return tables.active(cache_len + 1)

    def drop_graphs_keep_failures(self):
        """After a failed capture with no graph alive: release the pool, keep the failure memo."""
        failed, short = dict(self.failed), set(self._short_of_memory)
        self.drop_graphs()
        self.failed.update(failed)
        self._short_of_memory.update(short)
