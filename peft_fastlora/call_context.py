"""What one call tells the LoRA layers, as one value: ``CallContext``.

A call is a ``generate`` call, a continuous-batching step or a plain forward. Its boundary (the
patched ``generate``, the engine's step, the model's forward pre-hook) builds the context once;
the layers take it at the start of their forward and pass it down. Nested scopes (a graph capture
inside a call, PEFT handing fastlora the call's adapter names) enter a derived copy and put the
previous one back on exit. The current context is per thread: a continuous-batching engine steps
in its own thread while a ``generate`` call runs in the caller's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

from .batch import TokenSegments


class ForwardBoundary:
    """A forward outside any call: its first LoRA layer that knows the batch's adapters does the
    call-boundary work (checks, values, the fold choice) once, for every layer of that forward."""

    def __init__(self, begin: Callable[[Sequence[str]], bool]):
        self._begin = begin  # adapter names -> whether the forward folds (what ``state.call`` does first)
        self.fold: Optional[bool] = None  # None until the boundary ran

    def run(self, adapter_names: Sequence[str]) -> None:
        if self.fold is None:
            self.fold = False  # a failed boundary is not retried by the next layer
            self.fold = self._begin(adapter_names)


@dataclass(frozen=True)
class CallContext:
    """One call's facts, as the layers read them.

    Attributes:
        checked: the call's boundary synced PEFT's adapters and copied their values; the layers
            skip those per-forward checks.
        fold: the per-call sites take the shrink from the folded GEMM (decided from the call's
            adapters, ``SlotLoader.decide_fold``).
        names: the per-row adapter names fastlora took in PEFT's place (None: PEFT passes them
            to each layer, or the forward has none).
        segments: the sequences of a continuous-batching forward (one row of tokens).
        graph_batch_info: inside a decode-graph capture or an emulated replay, the backend's static
            batch info the layers read (the runner refreshes it in place).
        boundary: a forward outside any call whose boundary runs at its first LoRA layer.
    """

    checked: bool = False
    fold: bool = False
    names: Optional[Tuple[str, ...]] = None
    segments: Optional[TokenSegments] = None
    graph_batch_info: Any = None
    boundary: Optional[ForwardBoundary] = None

    @property
    def graphed(self) -> bool:
        """Whether the layers are being captured (or replayed, emulated) in a decode graph."""
        return self.graph_batch_info is not None

    def folds(self) -> bool:
        """Whether the per-call sites fold in this forward (never in a continuous-batching step,
        whose adapters change from step to step: the engine's graphs are not keyed by the choice)."""
        if self.segments is not None:
            return False
        return self.fold or bool(self.boundary is not None and self.boundary.fold)

    def replace(self, **changes) -> "CallContext":
        return dataclasses.replace(self, **changes)


OUTSIDE = CallContext()  # no call: every forward checks for itself


class CallScope:
    """The current ``CallContext`` of each thread, for one patched model."""

    def __init__(self):
        self._local = threading.local()

    def current(self) -> CallContext:
        return getattr(self._local, "context", OUTSIDE)

    @contextlib.contextmanager
    def entered(self, context: CallContext) -> Iterator[CallContext]:
        """``context`` is the current one inside the block; the previous one again after it."""
        previous = self.current()
        self._local.context = context
        try:
            yield context
        finally:
            self._local.context = previous

    def begin_forward(self, boundary: ForwardBoundary, names: Optional[Tuple[str, ...]] = None) -> None:
        """A forward outside any call: its layers share ``boundary`` until the next forward or the
        end of the scope it runs in (a forward pre-hook cannot scope the forward itself)."""
        self._local.context = OUTSIDE.replace(boundary=boundary, names=names)
