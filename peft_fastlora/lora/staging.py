"""A staged fold: rows under a site's base weight that a folding call copies its adapters' A
blocks into.

With fewer slots than adapters, a site's A arena is sized for the largest adapters, not for those
a call uses, and storing all of it under the base weight would make every decode GEMM carry rows
no call reads. A staged site stores a smaller tail there instead (``FusedGroup.attach_tail`` with
``stage_rows``), sized for what a call of ``num_slots`` average adapters holds
(``Tuning.fold_stage_margin``); a call that folds copies its adapters' blocks into it, one after
the other, and the expand reads A's places from the staging table. A call whose blocks do not fit
keeps the fused kernel (``fits``).
"""

from __future__ import annotations

from array import array
from typing import Iterable, List, Sequence

import torch

from ..backend.packed import PackedWeights


def staging_rows(adapter_rows: Iterable[int], n_slots: int, margin: float) -> int:
    """Rows of a staging tail: what ``n_slots`` adapters of the average size (``adapter_rows``:
    each adapter's A rows at the site) hold, times ``margin``, in multiples of 8 (0: no adapters)."""
    sizes = [r for r in adapter_rows if r > 0]
    if not sizes:
        return 0
    rows = margin * n_slots * sum(sizes) / len(sizes)
    return -(-int(rows) // 8) * 8


class FoldStaging:
    """The staging rows of one site and the packed weights that read A from them.

    Args:
        rows: (staging rows, in) the tail of the site's base weight.
        packed: the site's packed weights with ``a`` = ``rows`` and its own ``a_rows`` table
            (num_slots, c), which ``stage`` points at the blocks it copied.
    """

    def __init__(self, rows: torch.Tensor, packed: PackedWeights):
        self.rows = rows
        self.packed = packed

    def fits(self, rows: int) -> bool:
        """A call whose adapters hold ``rows`` A rows here can fold."""
        return rows <= self.rows.shape[0]

    @torch.no_grad()
    def stage(self, arena: torch.Tensor, slots: Iterable[int], slot_a_rows: Sequence[List[int]],
              slot_ranks: Sequence[List[int]], cache: dict) -> None:
        """Copy the A blocks of these slots (from ``arena``, their current values) into the staging
        rows, one after the other, and point the staging table at them; the other rows keep what
        they held (no slot's table points there). ``slot_a_rows`` / ``slot_ranks``: each slot's
        first arena row and rank per module. ``cache``: the row indices and tables of recent
        layouts, shared by the sites (sites of one kind in every layer place alike)."""
        c, n_slots = self.packed.stack_num, len(slot_ranks)
        slots = sorted(set(slots))
        capacity = self.rows.shape[0]
        key = array("i", [capacity, c, n_slots] + [
            x for s in slots for x in (s, *slot_a_rows[s], *slot_ranks[s])]).tobytes()
        entry = cache.get(key)
        if entry is None:
            entry = self._layout(slots, slot_a_rows, slot_ranks, c, n_slots)
            if len(cache) >= 64:
                cache.clear()
            cache[key] = entry
        index, table = entry
        torch.index_select(arena, 0, index, out=self.rows)
        self.packed.a_rows.copy_(table)

    def _layout(self, slots, slot_a_rows, slot_ranks, c: int, n_slots: int):
        """(arena row of each staging row, (num_slots, c) staging table) on the rows' device."""
        index, table, at = [], [0] * (n_slots * c), 0
        for s in slots:
            for j, (row, rank) in enumerate(zip(slot_a_rows[s], slot_ranks[s])):
                if rank > 0:
                    index.extend(range(row, row + rank))
                    table[s * c + j] = at
                    at += rank
        if at > self.rows.shape[0]:
            raise ValueError(f"FoldStaging.stage: the slots' A rows ({at}) exceed the staging rows "
                             f"({self.rows.shape[0]}); check fits first")
        index += [0] * (self.rows.shape[0] - at)  # rows no table points to: any row
        device = self.rows.device
        return (_to_device(torch.tensor(index, dtype=torch.int64), device),
                _to_device(torch.tensor(table, dtype=torch.int32).view(n_slots, c), device))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without the host waiting for the stream (from pinned memory on CUDA;
    PyTorch's pinned allocator keeps the block until the copy is done)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
