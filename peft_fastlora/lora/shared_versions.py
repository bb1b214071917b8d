"""One version counter per adapter, for an engine step's question of which adapters' values moved.

An engine step copies into the stacks only the adapters whose parameters changed in place since
their last copy (``pool.ValueRefresher``), which it learns from the parameters' version counters:
one read per parameter, thousands a step with tens of adapters on a 32-layer model, and the bulk
of the step's bookkeeping (over PEFT's scattered tensors most reads miss the CPU's caches). Here
each adapter's parameters are re-homed onto one buffer per device and dtype
(``compat.modules.share_version_counter``: the same objects with the same values, now views of
the buffer, which share its version counter), so that one read per adapter answers the same
question. Parameters that cannot be re-homed keep their own counters and are read one by one.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..compat.modules import share_version_counter


class SharedVersions:
    """The parameters re-homed onto a buffer, each with that buffer."""

    def __init__(self):
        # id(parameter) -> (it, its buffer): held here, so an id stands for that parameter alone
        self._entries: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def share(self, adapters: Iterable[List[torch.Tensor]]) -> None:
        """Re-home each adapter's parameters (one list per adapter; one buffer per device and
        dtype) unless they are on one buffer of ours already, and forget every parameter not
        given (deleted adapters)."""
        entries = {}
        for params in adapters:
            groups: Dict[tuple, Dict[int, torch.Tensor]] = {}
            for p in params:  # (a parameter two layers share counts once)
                groups.setdefault((p.device, p.dtype), {})[id(p)] = p
            for group in groups.values():
                members = list(group.values())
                buffer = self._buffer_of(members)
                if buffer is None:
                    buffer = share_version_counter(members)
                if buffer is not None:
                    entries.update((id(p), (p, buffer)) for p in members)
        self._entries = entries

    def _buffer_of(self, members: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """The buffer that holds exactly these parameters, each still on it (None: none does)."""
        first = self._entries.get(id(members[0]))
        if first is None:
            return None
        buffer = first[1]
        for p in members:
            entry = self._entries.get(id(p))
            if entry is None or entry[1] is not buffer or not _on(p, buffer):
                return None
        return buffer if sum(p.numel() for p in members) == buffer.numel() else None

    @torch.no_grad()
    @torch.inference_mode(False)
    def release(self) -> None:
        """Give every parameter still on a buffer a storage of its own again (``unpatch``): the
        same objects and values, each owning exactly its data."""
        for p, buffer in self._entries.values():
            if _on(p, buffer):
                p.data = p.detach().clone()
                if buffer.is_cuda:  # freed below, while the clone may still be reading it
                    buffer.record_stream(torch.cuda.current_stream(buffer.device))
        self._entries = {}

    def witness(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose version counter tells whether ``t`` changed in place: its buffer while
        it is on it, else ``t`` itself."""
        entry = self._entries.get(id(t))
        return entry[1] if entry is not None and _on(t, entry[1]) else t


def _on(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
