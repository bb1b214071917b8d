"""The batch info of the current forward: ``BatchInfos``.

The first LoRA layer of a forward asks for the batch description (``backend.prepare_lora_batch``:
rows grouped into chunks by slot); the other layers of that forward, and later forwards of the same
adapters, shape and slots (the eager decode steps of a call), reuse it. A layer on another device
(accelerate's ``device_map``) reads a copy made once per batch info.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence

import torch

from ..batch import ForwardBatch, TokenSegments
from .slot_loader import SlotLoader


class BatchInfos:
    """Batch infos built on demand and kept while they fit.

    Args:
        backend: the model's current LoRA backend (it builds the batch infos).
        device: the model's current device (where the batch infos live).
        slots: the adapters' slots and ranks.
    """

    def __init__(self, backend: Callable[[], object], device: Callable[[], torch.device], slots: SlotLoader):
        self._backend, self._device, self._slots = backend, device, slots
        self._key = None  # what ``_info`` was built for: (names, rows, tokens per row) or the segments
        self._info = None
        self._copies: Dict[torch.device, tuple] = {}  # device -> (batch info, its copy there)

    def clear(self) -> None:
        """The slots moved or the stacks were rebuilt: build again when next asked."""
        self._key = self._info = None

    def holds(self, adapter_names: Sequence[str], rows: int, tokens_per_row: int) -> bool:
        """Whether the batch info at hand was built for this layout (by an earlier layer of the
        forward, which saw its rows and tokens apart)."""
        return self._key == (tuple(adapter_names), rows, tokens_per_row)

    def for_rows(self, adapter_names: Sequence[str], rows: int, tokens_per_row: int):
        """``rows`` rows of ``tokens_per_row`` tokens each, row i with ``adapter_names[i]``."""
        # by value, not by list identity: a caller may reuse one list and change it in place
        key = (tuple(adapter_names), rows, tokens_per_row)
        if self._key != key:
            fb = ForwardBatch.from_shape(rows, tokens_per_row, self._device())
            self._build(fb, self._slots.registry.slots_for(adapter_names), key)
        return self._info

    def for_segments(self, segments: TokenSegments):
        """A continuous-batching forward: one row holding every sequence's tokens."""
        if self._key is not segments:
            fb, slots = segments.forward_batch(self._slots.registry.slots_for(segments.names), self._device())
            self._build(fb, slots, segments)
        return self._info

    def on(self, info, device: torch.device):
        """``info`` on ``device`` (a copy made once per batch info where it is another device)."""
        if device == self._device():
            return info
        cached = self._copies.get(device)
        if cached is None or cached[0] is not info:
            cached = self._copies[device] = (info, info.to(device))
        return cached[1]

    def _build(self, fb: ForwardBatch, slots, key) -> None:
        ranks = self._slots.slot_ranks()
        self._info = self._backend().prepare_lora_batch(fb, slots, ranks, [1.0] * len(ranks), use_cuda_graph=False)
        self._key = key
