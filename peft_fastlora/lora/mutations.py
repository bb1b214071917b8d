"""PEFT's adapter-changing methods of a patched model, serialised with fastlora's calls.

A continuous-batching engine steps in its own thread, and a server may add or delete adapters
from another while requests run. PEFT changes its modules one layer at a time; a step that read
them half-way would fail (and, in transformers' engine, fail every request in flight). Wrapped on
the model instance, these methods wait for the call or step in progress (and the GPU work of an
async engine step) and the next one sees the change whole.
"""

from __future__ import annotations

from ..instance_methods import InstancePatches

METHODS = ("add_adapter", "delete_adapter", "load_adapter", "set_adapter")


class AdapterMutationLock:
    """Installs the wrappers on ``state.model``; ``remove`` restores what was there."""

    def __init__(self, state):
        self._methods = InstancePatches()
        for name in METHODS:
            if not callable(getattr(state.model, name, None)):
                continue

            def make(original):
                def locked(model, *args, **kwargs):
                    with state.exclusive():
                        return original(*args, **kwargs)
                return locked

            self._methods.wrap(state.model, name, make)

    def remove(self):
        self._methods.restore()
