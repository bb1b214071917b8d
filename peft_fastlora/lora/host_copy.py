"""Host tensors into their places on the GPU at a slot load: registered adapters' weights (from
pinned memory) and every pool's new tables.

A load fills one view per (site, module, A or B): hundreds per adapter on a large model. One
host-to-device copy each costs a driver call each on the host, whatever its size. So the views
whose host tensors share one storage (a registered adapter is stored as one pinned buffer, see
``store.build_stored``) cross to the device together, in one copy of that storage's span into a
staging buffer, and are then filled from it by one segment copy (``ops.segment_copy``: a view
costs the host three integers, not tensor objects). Everything is queued on the current stream:
the host never waits, and the staging memory goes back to the caching allocator in stream order.

A registered adapter's whole buffer does not depend on where the pools place it, so a load queues
its copy first (``prestage``), before the host's placement work, and the transfer runs meanwhile;
``copy_from_host`` then fills the runs of those buffers from the staging already on its way.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..compat.modules import foreach_copy
from ..kernel_support import kernel_runs_on
from .pool import HostRun, _storage_address, copy_values
from ..ops.segment_copy import segment_copy
from ..tuning import Tuning



def _extent(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` reads (its offset for an empty tensor)."""
    if t.is_contiguous():
        return t.storage_offset() + t.numel()
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


@torch.no_grad()
def prestage(buffers: Sequence[torch.Tensor], device: torch.device,
             tuning: Tuning) -> Dict[int, Tuple[torch.Tensor, int]]:
    """Queue copies of whole host buffers (1-D, pinned on CUDA) to ``device``, up to
    ``tuning.prestage_bytes`` in all (the rest take ``copy_from_host``'s own path: all of it stays
    live until the segment copy, and the caching allocator keeps it for the next load). Returns, by
    the address of each buffer's storage, (staging, where the storage's element 0 would sit in it)."""
    device = torch.device(device)
    if device.type not in tuning.staged_devices:
        return {}
    by_dtype: Dict[torch.dtype, list] = {}
    total = 0
    for b in buffers:
        if (device.type == "cuda" and not b.is_pinned()) or (device.type != "cuda" and not kernel_runs_on(b)):
            continue
        if total + b.numel() * b.element_size() > tuning.prestage_bytes:
            break
        total += b.numel() * b.element_size()
        by_dtype.setdefault(b.dtype, []).append(b)
    out = {}
    for dtype, group in by_dtype.items():
        staging = torch.empty(sum(b.numel() for b in group), dtype=dtype, device=device)
        at = 0
        for b in group:
            staging[at: at + b.numel()].copy_(b, non_blocking=True)
            out[_storage_address(b)] = (staging, at - b.storage_offset())
            at += b.numel()
    return out


@torch.no_grad()
def copy_from_host(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], runs: Sequence[HostRun] = (),
                   prestaged: Optional[Mapping[int, Tuple[torch.Tensor, int]]] = None,
                   tuning: Optional[Tuning] = None) -> None:
    """``dst.copy_(src)`` for each (device view, host tensor) pair, and each ``HostRun`` into its
    place, without host waits (``src`` pinned; unpinned ones are copied synchronously by torch,
    correctly). ``prestaged``: ``prestage``'s staging, which runs of those storages are filled from.
    Copies from one host storage are staged on ``tuning.staged_devices``, at most
    ``tuning.staging_bytes`` at once (a larger storage span gets its own)."""
    tuning = tuning if tuning is not None else Tuning()
    staged_devices = tuning.staged_devices
    # per host storage: (dst, src, src's first storage element, one past its last); every
    # tensor attribute is read once (the host's time per view is what a load costs)
    groups: Dict[tuple, list] = {}
    for dst, src in pairs:
        off = src.storage_offset()
        # the storage's address, without making a storage object per tensor (slow on the host)
        key = (src.data_ptr() - off * src.element_size(), src.dtype, dst.device)
        group = groups.get(key)
        if group is None:
            group = groups[key] = []
        group.append((dst, src, off, off + src.numel() if src.is_contiguous() else _extent(src)))
    run_groups: Dict[tuple, list] = {}
    from_staging: Dict[int, tuple] = {}  # id(staging) -> (staging, segments)
    for run in runs:  # their storage, offsets and device known in advance
        hit = prestaged.get(run.group[0]) if prestaged else None
        if hit is not None and hit[0].device == run.dst.device:
            entry = from_staging.get(id(hit[0]))
            if entry is None:
                entry = from_staging[id(hit[0])] = (hit[0], [])
            entry[1].extend((run.dst.data_ptr() + run.offset * run.dst.element_size(), hit[1] + run.src_offset,
                             run.numel))
            continue
        group = run_groups.get(run.group)
        if group is None:
            group = run_groups[run.group] = []
        group.append(run)
    direct, staged = [], []
    for (_, _, device), group in groups.items():
        # one storage: pinned or not as a whole
        if device.type in staged_devices and len(group) > 1 and (device.type != "cuda" or group[0][1].is_pinned()):
            staged.append((group, min(g[2] for g in group), max(g[3] for g in group)))
        else:
            direct += group
    for (_, device), group in run_groups.items():
        host = group[0].src
        if (device.type in staged_devices and len(group) > 1 and (device.type != "cuda" or host.is_pinned())
                and (device.type == "cuda" or kernel_runs_on(host))):
            staged.append((group, min(r.src_offset for r in group), max(r.src_offset + r.numel for r in group)))
        else:  # each as a view of its place
            direct += [(r.dst[r.offset: r.offset + r.numel].view(r.src.shape), r.src) for r in group]
    if direct:  # one copy each
        foreach_copy([g[0] for g in direct], [g[1] for g in direct], non_blocking=True)
    for staging, segments in from_staging.values():
        _segment_copy(staging, segments)
    batch, size = [], 0
    for group, lo, hi in staged:
        itemsize = _host_of(group).element_size()
        if batch and (size + hi - lo) * itemsize > tuning.staging_bytes:
            _staged_copy(batch)
            batch, size = [], 0
        batch.append((group, lo, hi))
        size += hi - lo
    if batch:
        _staged_copy(batch)


def _host_of(group) -> torch.Tensor:
    """A host tensor of the group's storage (groups hold pairs' entries or runs)."""
    return group[0].src if isinstance(group[0], HostRun) else group[0][1]


def _staged_copy(groups) -> None:
    """Groups of one storage each, with their spans ``(group, lo, hi)``: the spans into one
    staging buffer per dtype and device, one copy per group, then each view from its place in
    the buffer: runs and dense views of the staged dtype as runs of one segment copy, the rest by
    batched copies."""
    by_kind: Dict[tuple, list] = {}
    for entry in groups:
        first = entry[0][0]
        dst = first.dst if isinstance(first, HostRun) else first[0]
        by_kind.setdefault((_host_of(entry[0]).dtype, dst.device), []).append(entry)
    for (dtype, device), entries in by_kind.items():
        staging = torch.empty(sum(hi - lo for _, lo, hi in entries), dtype=dtype, device=device)
        runs = device.type == "cuda" or kernel_runs_on(staging)  # the segment kernel can take them
        itemsize = staging.element_size()
        segments, dsts, srcs, others, at = [], [], [], [], 0
        for group, lo, hi in entries:
            staging[at: at + hi - lo].copy_(_host_of(group).as_strided((hi - lo,), (1,), lo), non_blocking=True)
            base = at - lo
            if isinstance(group[0], HostRun):  # of the staged dtype and dense: runs (a pool checked)
                for run in group:
                    segments += (run.dst.data_ptr() + run.offset * itemsize, base + run.src_offset, run.numel)
                at += hi - lo
                continue
            for dst, src, off, _ in group:
                dense = dst.dtype == dtype and dst.is_contiguous() and src.is_contiguous()
                if dense and runs:
                    segments += (dst.data_ptr(), base + off, src.numel())
                    continue
                on_device = staging.as_strided(src.shape, src.stride(), base + off)
                if dense:
                    dsts.append(dst)  # same shapes, dense: one multi-tensor copy takes them all
                    srcs.append(on_device)
                else:
                    others.append((dst, on_device))
            at += hi - lo
        if segments:
            _segment_copy(staging, segments)
        if dsts:
            foreach_copy(dsts, srcs)
        if others:
            copy_values(others)


def _segment_copy(staging: torch.Tensor, segments: list) -> None:
    """Runs (destination address, element offset in ``staging``, length) of ``staging``'s dtype."""

    device = staging.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        segment_copy(staging, segments, staging.dtype)
