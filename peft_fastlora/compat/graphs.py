"""torch's CUDA graphs: memory pools, keeping captures, and recovery from a failed capture."""

from __future__ import annotations

from typing import Optional

import torch


def new_graph_pool():
    """(owner, pool id) for a private memory pool that graphs can share.

    With ``torch.cuda.MemPool`` the owner holds a reference to the pool, so freeing any number of
    graphs never brings the pool's use count to zero while the runner still captures into it
    (PyTorch asserts ``use_count > 0`` when a pool id whose graphs were all freed is used again).
    Without it, a plain graph pool handle (owner None): the runner never reuses such a handle after
    its last graph is freed.
    """
    pool_cls = getattr(torch.cuda, "MemPool", None)
    if pool_cls is not None:
        try:
            owner = pool_cls()
            return owner, owner.id
        except Exception:  # noqa: BLE001 - fall back to a plain handle
            pass
    return None, torch.cuda.graph_pool_handle()


def new_cuda_graph(keep: bool):
    """``torch.cuda.CUDAGraph``; with ``keep``, one whose captured graph stays editable until its
    ``instantiate()`` (torch 2.8 and later; older torch: None)."""
    if not keep:
        return torch.cuda.CUDAGraph()
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return None
    return graph if hasattr(graph, "raw_cuda_graph") and hasattr(graph, "instantiate") else None


def graph_pool_bytes(pool_id) -> Optional[int]:
    """Bytes the CUDA caching allocator has reserved for this pool (None when torch cannot say)."""
    try:
        segments = torch.cuda.memory_snapshot(pool_id)
    except Exception:  # noqa: BLE001 - older torch: no per-pool snapshot
        return None
    if isinstance(segments, dict):
        segments = segments.get("segments", [])
    return int(sum(s.get("total_size", 0) for s in segments))


def end_allocate_to_pool(device_index: int, pool_id) -> None:
    """Stop routing this device's allocations to ``pool_id`` (after a capture that failed before its
    ``capture_end`` did it). A no-op when nothing is routed there."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device_index, pool_id)
    except Exception:  # noqa: BLE001 - "not currently recording to mempool": nothing to undo
        pass


def reset_rng_capture_state(device_index: int) -> None:
    """Give the device's default CUDA generator a fresh copy of its state (same seed and offset).

    A capture that fails between ``capture_begin`` and ``capture_end`` leaves the generator's state
    flagged as capturing, and every later random op in the process then fails ("Offset increment
    outside graph capture"); the copy carries seed and offset but not that flag.
    """
    gen = torch.cuda.default_generators[device_index]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except Exception:  # noqa: BLE001 - older torch without graph-safe states: nothing to reset
        pass
