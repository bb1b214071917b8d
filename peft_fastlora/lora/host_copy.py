"""Host tensors into their places on the GPU at a slot load: registered adapters' weights (from
pinned memory) and every pool's new tables.

A load fills one view per (site, module, A or B): hundreds per adapter on a large model. One
host-to-device copy each costs a driver call each on the host, whatever its size. So the views
whose host tensors share one storage (a registered adapter is stored as one pinned buffer, see
``store.build_stored``) cross to the device together, in one copy of that storage's span into a
staging buffer, and are then filled from it by device-to-device copies that ``torch._foreach_copy_``
batches into a few launches. Everything is queued on the current stream: the host never waits,
and the staging memory goes back to the caching allocator in stream order.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from .pool import copy_values

STAGING_BYTES = 256 << 20  # at most this much staging at once (a larger storage span gets its own)
STAGED_DEVICES = ("cuda",)  # where staging pays (tests add "cpu" to run the staged path)


def _extent(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` reads (its offset for an empty tensor)."""
    if t.is_contiguous():
        return t.storage_offset() + t.numel()
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


@torch.no_grad()
def copy_from_host(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each (device view, host tensor) pair, without host waits (``src``
    pinned; unpinned ones are copied synchronously by torch, correctly)."""
    groups: Dict[tuple, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        # the storage's address, without making a storage object per tensor (slow on the host)
        key = (src.data_ptr() - src.storage_offset() * src.element_size(), src.dtype, dst.device)
        groups.setdefault(key, []).append((dst, src))
    direct, staged = [], []
    for (_, _, device), group in groups.items():
        # one storage: pinned or not as a whole
        if device.type in STAGED_DEVICES and len(group) > 1 and (device.type != "cuda" or group[0][1].is_pinned()):
            staged.append(group)
        else:
            direct += group
    if direct:  # one copy each
        dsts, srcs = zip(*direct)
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
    batch, size = [], 0
    for group in staged:
        span = max(_extent(s) for _, s in group) - min(s.storage_offset() for _, s in group)
        itemsize = group[0][1].element_size()
        if batch and (size + span) * itemsize > STAGING_BYTES:
            _staged_copy(batch)
            batch, size = [], 0
        batch.append(group)
        size += span
    if batch:
        _staged_copy(batch)


def _staged_copy(groups) -> None:
    """Groups of one dtype and device each (one host storage per group): their spans into one
    staging buffer, one copy per group, then each view from its place in the buffer."""
    by_kind: Dict[tuple, list] = {}
    for group in groups:
        dst, src = group[0]
        by_kind.setdefault((src.dtype, dst.device), []).append(group)
    for (dtype, device), kind_groups in by_kind.items():
        spans = [(min(s.storage_offset() for _, s in g), max(_extent(s) for _, s in g)) for g in kind_groups]
        staging = torch.empty(sum(hi - lo for lo, hi in spans), dtype=dtype, device=device)
        dsts, srcs, others, at = [], [], [], 0
        for group, (lo, hi) in zip(kind_groups, spans):
            host = group[0][1]
            staging[at: at + hi - lo].copy_(host.as_strided((hi - lo,), (1,), lo), non_blocking=True)
            for dst, src in group:
                on_device = staging.as_strided(src.shape, src.stride(), at + src.storage_offset() - lo)
                if dst.dtype == dtype and dst.is_contiguous() and src.is_contiguous():
                    dsts.append(dst)  # same shapes, dense: one multi-tensor copy takes them all
                    srcs.append(on_device)
                else:
                    others.append((dst, on_device))
            at += hi - lo
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if others:
            copy_values(others)
