"""The stop check of fastlora's greedy loop on calls its graphs serve: one device flag a step.

transformers' loop asks after every step whether all rows have finished, and its deferred check
reads that answer one step late. ``FlagStopCheck`` keeps that rule but is fed a single device flag
(every row finished), which steps that advance their own inputs (``step_advance``) produce in the
same launch: no reduction runs between steps.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

# devices whose streams order the flag's copy after the step (tests add "cpu" with a stand-in event)
DEVICE_TYPES = {"cuda"}


class FlagStopCheck:
    """transformers' deferred stop check for fastlora's greedy loop (``greedy_loop``) on a call its
    graphs serve, fed a device flag, ``done`` ((1,) or () bool: every row has finished), instead
    of the rows' flags: on steps that advance their own inputs the flag comes out of the same
    launch (``step_advance``), so no reduction runs between steps. transformers' rule: the flag of
    one step is read at the next, and the one extra step run meanwhile is undone (``finish``).
    The cache is fastlora's, reset by the next call: nothing to roll back. No streamer: the greedy
    loop takes none."""

    def __init__(self, device: torch.device, max_length: Optional[int], runner):
        pinned = device.type == "cuda"
        self.slots = deque((torch.zeros((), dtype=torch.bool, pin_memory=pinned),
                            torch.Event(device=device, blocking=True)) for _ in range(2))
        self.max_length = max_length
        self.runner = runner
        self.first_step = True
        self.stop_reported = False

    def __call__(self, done: torch.Tensor, length: int) -> bool:
        flag, copied = self.slots[0]
        flag.copy_(done.reshape(()), non_blocking=True)
        copied.record()
        self.slots.rotate()
        flag_before, copied_before = self.slots[0]
        copied_before.synchronize()
        if not self.first_step:
            self.stop_reported = bool(flag_before)
        self.first_step = False
        return self.stop_reported or (self.max_length is not None and length >= self.max_length)

    def finish(self) -> int:
        """Steps to undo (1 where the loop ran one past the step that finished every row)."""
        for _, copied in self.slots:
            copied.synchronize()
        undo = 1 if self.stop_reported else 0
        self.runner.note_deferred_stop(undo)
        return undo


def flag_check_applies(device: torch.device, runner, is_assistant: bool) -> bool:
    """Whether ``greedy_loop`` checks its stops with ``FlagStopCheck`` (a call fastlora's graphs
    serve, on a device whose copies an event orders), where transformers' deferred check would run."""
    return runner is not None and device.type in DEVICE_TYPES and not is_assistant
