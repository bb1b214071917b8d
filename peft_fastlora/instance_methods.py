"""The one way fastlora changes a model: attributes set on instances (never on their classes), each
recorded with what the instance had before, and put back by ``restore``.

Every patch of a user's object goes through an ``InstancePatches``: the patched model's
``generate`` and continuous-batching entry points, PEFT's adapter-changing methods, the forwards of
LoRA sites and of the base model's modules. ``unpatch`` restores them all;
``tests/e2e/test_unpatch_exact.py`` checks that nothing is left on any module of every test
architecture. (The static caches fastlora builds are its own objects and are given their
``update`` directly.)
"""

from __future__ import annotations

import functools
import types
from typing import Callable, List, Tuple

_ABSENT = object()


class InstancePatches:
    """Attributes set on instances, put back in reverse order by ``restore``."""

    def __init__(self):
        self._saved: List[Tuple[object, str, object]] = []  # (instance, name, its own value or _ABSENT)

    def __len__(self) -> int:
        return len(self._saved)

    def set(self, obj, name: str, value) -> None:
        """``obj.name = value`` on the instance, what it had recorded first."""
        self._saved.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, value)

    def bind(self, obj, name: str, function: Callable) -> None:
        """``function`` (taking the instance first) as the instance's method ``name``."""
        self.set(obj, name, types.MethodType(function, obj))

    def wrap(self, obj, name: str, make: Callable[[Callable], Callable]) -> Callable:
        """Install ``make(original)`` (a function taking the instance first) as the instance's
        ``name``; returns the original bound method."""
        original = getattr(obj, name)
        self.bind(obj, name, functools.wraps(original)(make(original)))
        return original

    def restore(self) -> None:
        """Every attribute back as it was (or gone, so the class's shows again), last set first."""
        while self._saved:
            obj, name, value = self._saved.pop()
            if value is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value
