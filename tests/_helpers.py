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


SITE_KINDS = {3: "qkv", 2: "gate_up", 1: "linear"}  # a packed call's modules -> the site it serves


def count_backend_calls(monkeypatch, owner, names: Iterable[str]) -> Counter:
    """``count_calls`` on the backend's methods ``names`` and on ``run_packed_lora``, whose calls
    are also counted by the kind of site they serve ("qkv", "gate_up", "linear")."""
    counter = count_calls(monkeypatch, owner, [n for n in names if n != "run_packed_lora"])
    original = owner.run_packed_lora

    def counted(self, x, weights, *args, **kwargs):
        counter["run_packed_lora"] += 1
        counter[SITE_KINDS.get(weights.stack_num, "stacked")] += 1
        return original(self, x, weights, *args, **kwargs)

    monkeypatch.setattr(owner, "run_packed_lora", counted)
    return counter
