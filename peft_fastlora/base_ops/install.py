"""Instance-level forwards: installing and removing them on one module (never on its class)."""

from __future__ import annotations

import types
from typing import Callable, List, Tuple

from torch import nn


def set_instance_forward(module: nn.Module, forward: Callable) -> None:
    """``forward`` (a function taking the module first) as this instance's forward only."""
    module.forward = types.MethodType(forward, module)


def remove_instance_forwards(modules: List[Tuple[str, nn.Module]]) -> None:
    """Undo ``set_instance_forward`` on (name, module) pairs: the class forward runs again."""
    for _, m in modules:
        m.__dict__.pop("forward", None)
