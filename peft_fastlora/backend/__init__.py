"""Backend registry: ``get_backend(name)`` and ``available_backends()``."""

from __future__ import annotations

import importlib
from typing import Callable, Dict

import torch

from .base import BaseLoRABackend

# name -> "module:Class", imported on first use so that importing fastlora never imports Triton
_REGISTRY: Dict[str, str] = {
    "torch_native": "peft_fastlora.backend.torch_native:TorchNativeLoRABackend",
    "triton": "peft_fastlora.backend.triton:TritonLoRABackend",
}


def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def available_backends() -> list[str]:
    """Backends that can run here (``triton`` needs the triton package)."""
    return [n for n in _REGISTRY if n != "triton" or _triton_usable()]


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``"auto"`` is ``triton`` on CUDA when Triton is installed, else ``torch_native``."""
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_usable() else "torch_native"
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(_REGISTRY)} or 'auto'")
    return name


def get_backend(name: str) -> Callable[..., BaseLoRABackend]:
    """The backend class registered under ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["BaseLoRABackend", "available_backends", "get_backend", "resolve_backend_name"]
