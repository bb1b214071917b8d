"""Instance-level forwards of the small-op kernels (norms, rotary, gated MLPs): installing and
removing them, and whether a Triton kernel can run on given tensors."""

from __future__ import annotations

import os
import types
from typing import Callable, List, Tuple

import torch
from torch import nn


def kernel_runs_on(*tensors: torch.Tensor) -> bool:
    """All tensors on CUDA, or on the CPU under the Triton interpreter (the CPU tests)."""
    if all(t.is_cuda for t in tensors):
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and all(t.device.type == "cpu" for t in tensors)


def set_instance_forward(module: nn.Module, forward: Callable) -> None:
    """``forward`` (a function taking the module first) as this instance's forward only."""
    module.forward = types.MethodType(forward, module)


def remove_instance_forwards(modules: List[Tuple[str, nn.Module]]) -> None:
    """Undo ``set_instance_forward`` on (name, module) pairs: the class forward runs again."""
    for _, m in modules:
        m.__dict__.pop("forward", None)
