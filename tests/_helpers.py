"""Small helpers shared by the test files."""

from __future__ import annotations

from collections import Counter
from typing import Iterable


def count_calls(monkeypatch, owner, names: Iterable[str]) -> Counter:
    """Wrap ``owner.<name>`` (a class or a module) for each name so that every call is counted
    in the returned Counter, then runs the original. ``monkeypatch`` undoes it after the test."""
    counter = Counter()
    for name in names:
        original = getattr(owner, name)

        def counted(*args, _orig=original, _name=name, **kwargs):
            counter[_name] += 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return counter
