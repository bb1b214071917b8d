"""The GPU work of async engine steps, which outlasts the steps' calls.

With the engine's async batching a step returns once its forward is launched, and the engine
thread lets go of fastlora's call lock while the GPU still reads the stacks, the slots and the
batch-info buffers. Whoever takes the lock to change them (an adapter added, deleted, registered;
a rebuild) first waits for that work here.
"""

from __future__ import annotations

from typing import Dict

import torch


class InFlightSteps:
    """One event per batch processor, recorded on its compute stream after each step's launch.
    Used under the model's call lock."""

    def __init__(self):
        self._events: Dict[int, torch.cuda.Event] = {}

    def launched(self, processor, stream) -> None:
        """A step of ``processor`` was launched on ``stream`` (nothing to record off CUDA)."""
        if isinstance(stream, torch.cuda.Stream):
            event = torch.cuda.Event()
            event.record(stream)
            self._events[id(processor)] = event

    def wait(self) -> None:
        """Return once the GPU work of every step launched so far is done."""
        events, self._events = self._events, {}
        for event in events.values():
            event.synchronize()
