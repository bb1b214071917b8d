"""Wrappers of an object's methods installed on that instance only (never on its class), and put
back as they were: the patched model's ``generate``, its continuous-batching entry points, PEFT's
adapter-changing methods."""

from __future__ import annotations

import functools
import types
from typing import Callable, Dict


class InstanceMethods:
    """The wrappers installed on one object; ``restore`` puts back whatever instance attribute
    each name had before (or none, so the class's method shows again)."""

    def __init__(self, obj):
        self.obj = obj
        self._saved: Dict[str, object] = {}

    def wrap(self, name: str, make: Callable[[Callable], Callable]) -> Callable:
        """Install ``make(original)`` (a function taking the object first) as the instance's
        ``name``; returns the original bound method."""
        original = getattr(self.obj, name)
        self._saved.setdefault(name, self.obj.__dict__.get(name))
        wrapper = functools.wraps(original)(make(original))
        setattr(self.obj, name, types.MethodType(wrapper, self.obj))
        return original

    def restore(self) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                self.obj.__dict__.pop(name, None)
            else:
                setattr(self.obj, name, saved)
        self._saved = {}
