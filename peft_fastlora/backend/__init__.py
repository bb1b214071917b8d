"""Backend registry: ``get_backend(name)`` and ``available_backends()``."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional

import torch

from .. import kernel_support
from .base import BaseLoRABackend

# name -> "module:Class", imported on first use so that importing fastlora never imports Triton
_REGISTRY: Dict[str, str] = {
    "torch_native": "peft_fastlora.backend.torch_native:TorchNativeLoRABackend",
    "triton": "peft_fastlora.backend.triton:TritonLoRABackend",
}


def _triton_runs_on(device: torch.device) -> Optional[str]:
    """Why the Triton backend cannot serve a model on ``device`` (None: it can)."""
    missing = kernel_support.triton_missing()
    if missing is not None:
        return f"{missing} (CUDA builds of torch bring it; or pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and kernel_support.interpreting():
        return None
    return (f"its kernels need CUDA tensors, the model is on {device.type} (on a CPU, Triton's "
            "interpreter runs them, slowly, when TRITON_INTERPRET=1 is set before peft_fastlora is "
            "imported)")


def available_backends(device=None) -> list[str]:
    """Backends that can serve a model on ``device`` (default: CUDA when there is a GPU, else the
    CPU): ``torch_native`` everywhere, ``triton`` on CUDA (or on the CPU under Triton's interpreter)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return [n for n in _REGISTRY if n != "triton" or _triton_runs_on(device) is None]


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``"auto"`` is ``triton`` on CUDA when Triton is installed, else ``torch_native``; a backend
    named explicitly that cannot run on ``device`` is refused here, at patch time."""
    if name == "auto":
        return "triton" if device.type == "cuda" and kernel_support.triton_missing() is None else "torch_native"
    check_backend_name(name)
    if name == "triton":
        why = _triton_runs_on(device)
        if why is not None:
            raise ValueError(f"backend 'triton' cannot serve this model: {why}; use backend='torch_native'")
    return name


def check_backend_name(name: str) -> None:
    """A name that is no backend raises ``ValueError``, listing the backends (those that can run
    here and the others, with the reason)."""
    if name == "auto" or name in _REGISTRY:
        return
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    notes = []
    for other in _REGISTRY:
        why = _triton_runs_on(here) if other == "triton" else None
        notes.append(other if why is None else f"{other} (not here: {why})")
    raise ValueError(f"unknown backend {name!r}; the backends are 'auto', {', '.join(notes)}")


def get_backend(name: str) -> Callable[..., BaseLoRABackend]:
    """The backend class registered under ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["BaseLoRABackend", "available_backends", "check_backend_name", "get_backend", "resolve_backend_name"]
