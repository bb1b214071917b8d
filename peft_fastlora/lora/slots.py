"""``AdapterRegistry``: the adapters fastlora serves, and the GPU slot of the stacks that holds each.

A row's slot is the same in every layer. With as many slots as adapters (the default) adapter i
lives in slot i for good. With fewer (``patch(max_loras_per_batch=M)``) the stacks hold M
adapters: before a call's forwards, ``assign`` puts the call's adapters in slots, taking the
least recently used others' slots when none is free, and the pools copy the newcomers in
(``SitePool.load``). The stacks keep their shapes and addresses, so captured graphs stay valid
across swaps; only slot contents, ranks and scalings change, in place.
"""

from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence, Tuple

BASE = "__base__"


def check_adapter_names(names) -> None:
    """``adapter_names`` holds one name per row: a single string is refused with ``ValueError``
    (PEFT would read it as a list of one-character names), and so is an array of names that is
    not flat."""
    if isinstance(names, (str, bytes)):
        raise ValueError(
            f"adapter_names must be a list with one adapter name per row ({BASE!r} for no adapter), "
            f"got the string {names!r}; for the same adapter on every row pass [{names!r}] * batch_size")
    if getattr(names, "ndim", 1) != 1:  # a NumPy array (or tensor) of names must be flat
        raise ValueError(f"adapter_names must hold one adapter name per row, got an array of shape "
                         f"{tuple(names.shape)}")


class AdapterRegistry:
    """Adapter names <-> slots of the stacks (on the GPU for a CUDA model), shared by every site of
    one model."""

    def __init__(self, names: Sequence[str], num_slots: Optional[int] = None):
        self.names: List[str] = sorted(names)
        self.index: Dict[str, int] = {n: i for i, n in enumerate(self.names)}
        n = len(self.names)
        self.num_slots = n if num_slots is None else min(n, int(num_slots))
        self.all_resident = self.num_slots == n
        # slot -> adapter name (None: free), and name -> slot for the adapters in a slot
        self.resident: List[Optional[str]] = list(self.names) if self.all_resident else [None] * self.num_slots
        self.slot: Dict[str, int] = {name: s for s, name in enumerate(self.resident) if name is not None}
        self._recent = collections.OrderedDict.fromkeys(self.slot)  # least recently used first
        self.stats = collections.Counter(loads=0, evictions=0)
        self.stats["load_seconds"] = 0.0

    def __len__(self) -> int:
        return len(self.names)

    def assign(self, adapter_names: Sequence[str]) -> List[Tuple[int, str]]:
        """Put these adapters in slots (names fastlora does not serve are left to the caller's
        checks); returns the (slot, name) pairs newly placed, whose weights must be loaded."""
        wanted = [n for n in dict.fromkeys(adapter_names) if n in self.index]
        if self.all_resident:
            return []
        if len(wanted) > self.num_slots:
            raise ValueError(
                f"{len(wanted)} distinct adapters in one batch exceed max_loras_per_batch={self.num_slots} "
                f"(the slots of the adapter stacks): split the batch, or patch with a larger max_loras_per_batch")
        keep, placed = set(wanted), []
        for name in wanted:
            if name in self.slot:
                self._recent.move_to_end(name)
                continue
            free = next((s for s, held in enumerate(self.resident) if held is None), None)
            if free is None:
                victim = next(v for v in self._recent if v not in keep)
                free = self.slot.pop(victim)
                del self._recent[victim]
                self.stats["evictions"] += 1
            self.resident[free] = name
            self.slot[name] = free
            self._recent[name] = None
            self.stats["loads"] += 1
            placed.append((free, name))
        return placed

    def release(self, placed: Sequence[Tuple[int, str]]) -> None:
        """Forget placements whose loading failed: their slots are free again, and the adapters
        will be loaded anew by the next call that uses them (never served from a half-written slot)."""
        for slot, name in placed:
            if self.slot.get(name) == slot:
                del self.slot[name]
                self._recent.pop(name, None)
                self.resident[slot] = None

    def slots_for(self, adapter_names: Sequence[str]) -> List[int]:
        """Each row's slot (-1: no adapter)."""
        names = set(adapter_names)  # (the rows' few names, looked up once each)
        unknown = sorted(n for n in names if n != BASE and n not in self.index)
        if unknown:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(unknown)}")
        try:
            slot_of = {n: -1 if n == BASE else self.slot[n] for n in names}
        except KeyError as e:
            raise RuntimeError(f"fastlora: adapter {e.args[0]!r} is not in a slot (assign first)") from None
        return list(map(slot_of.__getitem__, adapter_names))

    def describe(self, hidden: Sequence[str] = ()) -> str:
        """For the report: how the adapters are held (``hidden``: names not counted, such as
        ``from_folders``' placeholder adapter)."""
        if self.all_resident:
            return "all adapters"
        shown = len([n for n in self.names if n not in hidden])
        return f"{self.num_slots} for {shown} adapters, loaded on demand"
