"""Capturing one decode step as a CUDA graph, and leaving the process healthy when that fails.

``capture`` warms the step up on a side stream, then captures it into a ``GraphPool`` shared by
the runner's graphs. Any exception on the way (a layer refusing the static path, an allocator or
driver error, a kernel that syncs) is re-raised only after the process is put back in order: the
stream capture ended, the allocator no longer routing to the pool, the CUDA generator's state no
longer flagged as capturing, the current stream restored. The caller then runs the step eagerly.

``EmulatedGraph`` stands in for ``torch.cuda.CUDAGraph`` without a GPU (``cuda_graphs="emulate"``):
it re-runs the captured call, so everything around the capture is tested on the CPU.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..compat.graphs import (end_allocate_to_pool, graph_pool_bytes, new_cuda_graph, new_graph_pool,
                             reset_rng_capture_state)
from . import early_launch


class GraphUnsafe(RuntimeError):
    """Raised inside a capture when a layer would leave the static path (PEFT's own forward indexes
    rows from host lists: captured, it would replay stale indices)."""


class GraphPool:
    """A private memory pool for a set of graphs, kept alive by this object (not by the graphs), so
    graphs can be freed one at a time. Dropping the object (after its graphs) frees the pool."""

    def __init__(self):
        self._owner, self.id = new_graph_pool()

    def reserved_bytes(self) -> Optional[int]:
        return graph_pool_bytes(self.id)


class EmulatedGraph:
    """Re-executes the captured call on replay and copies the logits into the captured output, as
    a real replay writes into the captured output's memory."""

    def __init__(self):
        self._fn = None
        self._output = None

    def capture(self, fn: Callable):
        self._fn = fn
        self._output = fn()
        return self._output

    def replay(self):
        self._output.logits.copy_(self._fn().logits)


def capture(fn: Callable, pool: GraphPool, restore: Callable[[], None], warmup: int = 2):
    """Capture ``fn()`` (one decode step) into a new CUDA graph sharing ``pool``.

    ``restore`` puts back whatever a run of ``fn`` advances (the cache lengths); it runs before
    every warm-up run and before the capture. The captured graph's expands behind cuBLAS GEMMs are
    set to launch early (``early_launch``) before it is instantiated; ``graph.fastlora_early_edges``
    says how many. Should that edit fail, early launch is turned off for the process and the step
    captured again as it is. Returns (graph, captured output).
    """
    device = torch.cuda.current_device()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # Triton compiles, cuBLAS picks its kernels, lazy buffers appear
            restore()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    restore()
    torch.cuda.synchronize()
    try:
        return _capture_once(fn, pool, device, early_launch.wanted())
    except early_launch.EditFailed as failed:
        held = failed.graph  # a use of the pool until the new graph holds one
        restore()
        graph, output = _capture_once(fn, pool, device, False)
        del held
        return graph, output


def _capture_once(fn: Callable, pool: GraphPool, device: int, early: bool):
    graph = new_cuda_graph(keep=True) if early else None
    if early and graph is None:
        early_launch.disable(f"torch {torch.__version__} cannot keep a captured graph to edit (no keep_graph)")
    if graph is None:
        graph, early = torch.cuda.CUDAGraph(), False
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        try:
            graph.capture_begin(pool=pool.id)
            output = fn()
            graph.capture_end()
            graph.fastlora_early_edges = early_launch.edit(graph) if early else 0
        except BaseException:
            _abandon(graph, pool, device)
            raise
    return graph, output


def _abandon(graph, pool: GraphPool, device: int) -> None:
    """Undo what a failed capture may have left behind (call on the capture stream)."""
    if torch.cuda.is_current_stream_capturing():
        try:
            graph.capture_end()  # ends the stream capture even when it then raises
        except Exception:  # noqa: BLE001 - an invalidated capture: ended all the same
            pass
    end_allocate_to_pool(device, pool.id)
    reset_rng_capture_state(device)
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a sticky CUDA error: nothing here can recover from it
        pass
