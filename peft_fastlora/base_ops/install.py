"""Instance-level forwards: installing and removing them on one module (never on its class)."""

from __future__ import annotations

import types
from typing import Callable, Iterator, List, Sequence, Tuple

from torch import nn


def set_instance_forward(module: nn.Module, forward: Callable) -> None:
    """``forward`` (a function taking the module first) as this instance's forward only."""
    module.forward = types.MethodType(forward, module)


def remove_instance_forwards(modules: List[Tuple[str, nn.Module]]) -> None:
    """Undo ``set_instance_forward`` on (name, module) pairs: the class forward runs again."""
    for _, m in modules:
        m.__dict__.pop("forward", None)


def candidates(root: nn.Module, parts: Sequence[str]) -> Iterator[Tuple[str, nn.Module, Callable]]:
    """(name, module, its class's forward) of every module under ``root`` that has the submodules
    ``parts`` and no instance forward yet (someone else's, or one of ours)."""
    for name, m in root.named_modules():
        forward = type(m).__dict__.get("forward")
        if "forward" in m.__dict__ or forward is None:
            continue
        if all(isinstance(getattr(m, n, None), nn.Module) for n in parts):
            yield name, m, forward
