"""DoRA's per-slot column tables for one site (``PackedWeights.dora``): a DoRA adapter's output in
module j is ``scale * (W x + s B A x) + bias``, applied by the expand's epilogue as
``(base + delta) * scale + shift`` with ``shift = (1 - scale) * bias``; plain slots hold ones and
zeros.

``scale`` is the magnitude over the row norms of ``W + s B A`` (PEFT's formula, in the stacks'
dtype), which reads the whole base weight (dequantized, over a 4-bit or torchao base). It is computed again
only where its inputs changed since the last time: for PEFT's adapters, the identity, address,
shape and value of A, B and the magnitude (values compared on the device with a copy taken then:
``sync_tables`` reads every site's comparisons back in one host sync per call that uses a DoRA
adapter; an engine step compares only where their version counters moved, as it copies values),
the scaling, and the base weight's address and version counter; for registered adapters
(immutable) only when their slot is loaded again. Base weights edited in place through ``.data``
(which bumps no version counter) are not noticed.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..compat.adapters import base_bias, dora_base_weight, dora_dense_weight, dora_scale, dora_sources
from ..compat.modules import version_of, versions_of

# module index -> (its LoRA layer, a registered adapter's magnitude on the device; None: PEFT's)
Sources = Dict[int, Tuple[nn.Module, Optional[torch.Tensor]]]


class DoraTables:
    """The (scale, shift) tables of one site and what their rows were computed from."""

    def __init__(self, num_slots: int, offsets: List[int], device: torch.device):
        self.offsets = list(offsets)
        self.scale = torch.ones(num_slots, self.offsets[-1], dtype=torch.float32, device=device)
        self.shift = torch.zeros(num_slots, self.offsets[-1], dtype=torch.float32, device=device)
        self.recomputed = 0  # rows computed (module and slot) over the tables' life: tests and probes
        # (slot, j) -> (the host facts, copies of A, B and the magnitude (PEFT's adapters) or None,
        # their version counters then or None)
        self._seen: Dict[Tuple[int, int], Tuple[tuple, Optional[Tuple[torch.Tensor, ...]], Optional[tuple]]] = {}

    @property
    def tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.shift

    def nbytes(self) -> int:
        copies = sum(t.numel() * t.element_size() for _, snap, _ in self._seen.values() if snap for t in snap)
        return 2 * self.scale.numel() * 4 + copies

    def reset(self, slot: int) -> None:
        """``slot`` takes another adapter: plain until ``sync`` computes a DoRA adapter's columns."""
        self.scale[slot].fill_(1.0)
        self.shift[slot].zero_()
        for key in [k for k in self._seen if k[0] == slot]:
            del self._seen[key]

    def stale(self, entries: Iterable[Tuple[int, int, str, Sources]], registered_views: Callable,
              versions_suffice: bool = False):
        """Of these (slot, module j, adapter, its sources): the rows to compute again (their host facts
        changed), and the rows whose values must be compared with the copies taken last time
        (``sync_tables`` compares every site's at once). ``registered_views(slot, j)``: (A, B,
        scaling) of a registered adapter as its slot holds them. ``versions_suffice`` (an engine
        step): a row whose A, B and magnitude kept their version counters is not compared."""
        work, compare = [], []
        for slot, j, name, (layer, magnitude) in entries:
            if magnitude is None:
                a, b, scaling, m = dora_sources(layer, name)
            else:
                a, b, scaling = registered_views(slot, j)
                m = magnitude
            weight = dora_base_weight(layer)
            facts = (weight.data_ptr(), version_of(weight), tuple(weight.shape), float(scaling),
                     *((t.data_ptr(), tuple(t.shape), t.dtype) for t in (a, b, m)))
            seen = self._seen.get((slot, j))
            item = (slot, j, layer, weight, a, b, float(scaling), m, facts, magnitude is None)
            if seen is None or seen[0] != facts:
                work.append(item)
            elif seen[1] is not None and not (versions_suffice and seen[2] is not None
                                              and seen[2] == versions_of((a, b, m))):
                compare.append((item, seen[1]))  # PEFT's: its values against the copies taken then
        return work, compare

    @torch.no_grad()
    def compute(self, work, dtype: torch.dtype) -> None:
        """The scale and shift of these rows (``stale``'s items), and what they were computed from."""
        for slot, j, layer, _, a, b, scaling, m, facts, copy in work:
            lo, hi = self.offsets[j], self.offsets[j + 1]
            g = dora_scale(dora_dense_weight(layer), a, b, scaling, m, dtype).float()
            self.scale[slot, lo:hi].copy_(g)
            bias = base_bias(layer)
            if bias is None:
                self.shift[slot, lo:hi].zero_()
            else:
                self.shift[slot, lo:hi].copy_((1.0 - g) * bias.float())
            self._seen[(slot, j)] = (facts, tuple(t.detach().clone() for t in (a, b, m)) if copy else None,
                                     versions_of((a, b, m)))
            self.recomputed += 1


@torch.no_grad()
def sync_tables(pending) -> None:
    """Bring several sites' tables up to date: ``pending`` holds (tables, their ``stale`` work and
    compare lists, the stacks' dtype) per site. Every site's value comparisons are read back in one
    host sync, then the rows whose inputs changed are computed."""
    compares = [(k, item, snap) for k, (_, _, compare, _) in enumerate(pending) for item, snap in compare]
    changed = []
    if compares:
        changed = torch.stack([torch.stack([(now != then).any() for now, then in zip((it[4], it[5], it[7]), snap)]).any()
                               for _, it, snap in compares]).tolist()
    for k, (tables, work, _, dtype) in enumerate(pending):
        work = work + [it for (site, it, _), c in zip(compares, changed) if c and site == k]
        tables.compute(work, dtype)
