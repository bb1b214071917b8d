"""The LoRA side of the continuous-batching engine's own CUDA graphs.

transformers' engine pads each step to a size it captured a graph for (or captures one) and
replays it. A captured LoRA layer reads its batch description from addresses fixed at capture,
so each step's per-request adapters are written in place, before the replay, into static
batch-info buffers: one set per row tile (``batch.BLOCK_M_TIERS``), so a small decode-sized
step keeps the small tile and the one-launch decode kernel while a long prefill step gets a
large tile. The engine keys its graphs by step shape; the buffers do not depend on the shape
beyond the tier, so one fill serves any graph of that tier.

Graphs read the stacks and the buffers: when fastlora rebuilds either (an adapter added or
deleted, more slots than the buffers hold, a new backend), every graph of the engine is dropped
and recaptured at its next use.

Where the engine builds no read indices (every layer reads the paged cache in place through the
step's page table, ``continuous.pages``), each step is also keyed as if its longest request read the
most keys allowed, so graphs are keyed by the query count alone and ``warm_up`` can capture every
one of them before serving: a capture synchronizes the GPU and empties allocator caches, a stall no
client should meet.
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..compat.engine import (cb_capacity, cb_disable_graphs, cb_drop_graphs, cb_emulate_graphs, cb_graphed_step,
                             cb_graphs_suspended, cb_pin_key_lengths, cb_query_sizes, cb_reads_skipped,
                             cb_step_graph_held, cb_stream, cb_warm_up_sizes)
from ..compat.modules import on_stream
from ..batch import BLOCK_M_TIERS, NO_LORA_BATCH, BatchInfoBuffers, TokenSegments, choose_block_m


@dataclass
class EngineWarmup:
    """What ``warmup_engine`` did: the query counts warmed, graphs captured, seconds."""

    query_sizes: List[int]
    captures: int
    seconds: float


class EngineGraphs:
    """Static LoRA batch info for one batch processor's graphs, and when to drop them.

    Args:
        state: the model's ``FastLoRAState``.
        processor: the engine's batch processor.
        emulate: no CUDA graphs: the engine pads as for graphs and each graphed step runs its
            forward eagerly over the static buffers (tests on CPU).
    """

    def __init__(self, state, processor, emulate: bool = False):
        self.state, self.processor, self.emulate = state, processor, emulate
        self.blocker: Optional[str] = None  # set when a step could not be captured
        # captures: graphed steps the engine held no graph for (each captured one first), and
        # the seconds their forwards took
        self.stats = collections.Counter(graphed_steps=0, eager_steps=0, graphs_dropped=0, captures=0,
                                         capture_s=0.0)
        self._buffers: Dict[int, BatchInfoBuffers] = {}
        self._generation = state.generation
        self._backend = state.backend
        self._max_tokens, self._max_requests = cb_capacity(processor)
        if emulate:
            cb_emulate_graphs(processor)
        self.keyed_by_queries = cb_reads_skipped(processor)

    def prepared(self) -> None:
        """The engine prepared its next step: keyed by its query count alone where it can be."""
        if self.keyed_by_queries:
            cb_pin_key_lengths(self.processor)

    def warm_up(self, model, began: float, captured: int = 0) -> EngineWarmup:
        """Capture the graph of every query count a step can have, where graphs are keyed by it
        alone (otherwise the engine's own warm-up is all); ``began``: when the warm-up began,
        ``captured``: the captures counted before it (those of the engine's own are the warm-up's)."""
        sizes = cb_query_sizes(self.processor) if self.keyed_by_queries else []
        if sizes:
            cb_warm_up_sizes(self.processor, model, sizes)
        return EngineWarmup(sizes, self.stats["captures"] - captured, time.perf_counter() - began)

    def graphed(self) -> bool:
        """Whether the step about to run goes through one of the engine's graphs."""
        return self.blocker is None and cb_graphed_step(self.processor)

    @contextlib.contextmanager
    def step(self, segments: TokenSegments):
        """Around the engine's forward of a graphed step: the step's LoRA batch written into the
        static buffers (on the stream the graph runs on), and the layers told to read them."""
        state = self.state
        self._drop_if_stale()
        capture = cb_step_graph_held(self.processor) is False
        if capture:
            self.stats["captures"] += 1
        with on_stream(cb_stream(self.processor)):
            bi = self._fill(segments)
        start = time.perf_counter()
        with state.forward_context(bi):
            if self.emulate:
                with cb_graphs_suspended(self.processor):
                    yield
            else:
                yield
        if capture:  # the engine's warm-up forward and capture (host time, kernels compiled included)
            self.stats["capture_s"] += time.perf_counter() - start
        self.stats["graphed_steps"] += 1

    def give_up(self, reason: str) -> None:
        """A step could not be captured: the engine's graphs go off for good (eager from now on)."""
        self.blocker = reason
        self.drop()
        cb_disable_graphs(self.processor)

    def drop(self) -> None:
        """Forget every graph the engine holds and the buffers they read (once the step launched
        before, with async batching, no longer replays one)."""
        self.state.wait_for_engine()
        cb_drop_graphs(self.processor)
        self.stats["graphs_dropped"] += 1  # invalidations (the engine may have held none yet)
        self._buffers.clear()
        self._generation, self._backend = self.state.generation, self.state.backend

    def close(self) -> None:
        """The processor will not run again: let go of it and of the buffers (the stats stay)."""
        self.processor = None
        self._buffers.clear()

    def _drop_if_stale(self) -> None:
        state = self.state
        slots = state.registry.num_slots
        if (state.generation != self._generation or state.backend is not self._backend
                or any(b.max_slots < slots for b in self._buffers.values())):
            self.drop()

    def _buffers_for(self, num_tokens: int) -> BatchInfoBuffers:
        block_m = choose_block_m(num_tokens)
        buffers = self._buffers.get(block_m)
        if buffers is None:
            limit = dict(BLOCK_M_TIERS)[block_m]
            tokens = limit if limit is not None else max(self._max_tokens, num_tokens)
            rows = min(tokens, self._max_requests) + 1  # one more: the padded tail
            buffers = self._buffers[block_m] = self.state.backend.new_graph_buffers(
                rows, tokens, max_slots=self.state.registry.num_slots)
        if num_tokens > buffers.max_tokens:  # the engine padded past what it said it would
            raise RuntimeError(f"fastlora: an engine step of {num_tokens} tokens exceeds the graph "
                               f"buffers' {buffers.max_tokens}")
        return buffers

    def _fill(self, segments: TokenSegments):
        state = self.state
        if not state.has_lora:
            return NO_LORA_BATCH
        fb, slots = segments.forward_batch(state.registry.slots_for(segments.names), state.device)
        ranks = state.slots.slot_ranks()
        with state.backend.using_graph_buffers(self._buffers_for(segments.num_tokens)):
            return state.backend.prepare_lora_batch(fb, slots, ranks, [1.0] * len(ranks), use_cuda_graph=True)

