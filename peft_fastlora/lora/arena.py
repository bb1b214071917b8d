"""``RowArena``: where each slot's block of one stacked module lives in a site's packed arenas.

Units are rows of A (a block of rank r takes r rows, and r columns of B per output row, so
where every rank is a multiple of 8 every place is one too). First fit; when no gap is large enough but the free
total is, the arena is compacted (blocks slid down in address order) and the moves are returned,
so the pool can move those blocks' weights on the device. The capacity is the
sum of the largest blocks that could be resident at once, so a fit always exists after compaction.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Tuple


class RowArena:
    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.blocks: Dict[int, Tuple[int, int]] = {}  # slot -> (start, rows)
        # kept beside the blocks, so a load costs no sort or sum over every slot
        self._order: List[Tuple[int, int]] = []  # (start, rows), by address
        self._used = 0

    def used(self) -> int:
        return self._used

    def free(self, slot: int) -> None:
        block = self.blocks.pop(slot, None)
        if block is not None:
            del self._order[bisect.bisect_left(self._order, block)]
            self._used -= block[1]

    def _add(self, slot: int, block: Tuple[int, int]) -> None:
        self.blocks[slot] = block
        bisect.insort(self._order, block)
        self._used += block[1]

    def start_of(self, slot: int) -> int:
        return self.blocks[slot][0]

    def _first_fit(self, rows: int):
        at = 0
        for start, size in self._order:  # by address and disjoint: each block starts at or past ``at``
            if start - at >= rows:
                return at
            at = start + size
        return at if self.capacity - at >= rows else None

    def alloc(self, slot: int, rows: int) -> Dict[int, Tuple[int, int, int]]:
        """Give ``slot`` (which must hold no block) ``rows`` rows; returns the *other* slots whose
        blocks moved to make room, as slot -> (old start, new start, rows), in address order
        (empty unless the arena had to be compacted). Blocks only move down: moved in that order,
        none lands on a block not yet moved."""
        if slot in self.blocks:
            raise RuntimeError(f"RowArena: slot {slot} already holds a block")
        if rows > self.capacity - self.used():
            raise RuntimeError(f"RowArena: {rows} rows do not fit ({self.used()} of {self.capacity} used)")
        start = self._first_fit(rows)
        moved: Dict[int, Tuple[int, int, int]] = {}
        if start is None:
            at = 0
            for other, (old, size) in sorted(self.blocks.items(), key=lambda kv: kv[1][0]):
                if old != at:
                    self.blocks[other] = (at, size)
                    moved[other] = (old, at, size)
                at += size
            self._order = sorted(self.blocks.values())
            start = at
        self._add(slot, (start, rows))
        return moved
