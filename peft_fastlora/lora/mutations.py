"""PEFT's adapter-changing methods of a patched model, serialised with fastlora's calls.

A continuous-batching engine steps in its own thread, and a server may add or delete adapters
from another while requests run. PEFT changes its modules one layer at a time; a step that read
them half-way would fail (and, in transformers' engine, fail every request in flight). Wrapped on
the model instance, these methods wait for the call or step in progress and the next one sees the
change whole.
"""

from __future__ import annotations

import functools
import types
from typing import Dict

METHODS = ("add_adapter", "delete_adapter", "load_adapter", "set_adapter")


class AdapterMutationLock:
    """Installs the wrappers on ``state.model``; ``remove`` restores what was there."""

    def __init__(self, state):
        self.model = state.model
        self._saved: Dict[str, object] = {}
        lock = state._call_lock
        for name in METHODS:
            original = getattr(self.model, name, None)
            if not callable(original):
                continue
            self._saved[name] = self.model.__dict__.get(name)

            @functools.wraps(original)
            def locked(model, *args, _original=original, **kwargs):
                with lock:
                    return _original(*args, **kwargs)

            setattr(self.model, name, types.MethodType(locked, self.model))

    def remove(self):
        for name, saved in self._saved.items():
            if saved is None:
                self.model.__dict__.pop(name, None)
            else:
                setattr(self.model, name, saved)
        self._saved = {}
