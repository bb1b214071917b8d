"""RMSNorm modules served by one Triton kernel each (``ops.rms_norm``), on this model instance only.

A norm is changed only when its class's code computes what one of the two forms the kernel
reproduces does (``match.py``): the Llama family's (Llama, Mistral, Qwen2, Qwen3, ...) or Gemma's
``(1 + weight)`` form, upcast and multiplied in float32 (Gemma 2, Gemma 3's text norms, ...).
Anything else keeps its own forward, and a class named like an RMSNorm that does not match is
reported with the reason. Inputs the kernel does not take (other devices,
gradients) go through the original forward.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from ..instance_methods import InstancePatches
from ..kernel_support import FLOAT_DTYPES, kernel_runs_on
from .match import mismatch, reference_shape
from ..ops.rms_norm import rms_norm

_REFERENCE = reference_shape('''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
''')


# Gemma's form: the forward and the ``_norm`` it calls
_GEMMA_FORWARD = reference_shape('''
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
''')
_GEMMA_NORM = reference_shape('''
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
''')


def _verdict(cls, m) -> Tuple[Optional[str], Optional[str]]:
    """(form, None) where the class computes a form the kernel reproduces ("llama" or "gemma"),
    else (None, why)."""
    forward = cls.__dict__["forward"]
    if not isinstance(getattr(m, "weight", None), torch.Tensor):
        return None, "no weight"
    if hasattr(m, "variance_epsilon"):
        why = mismatch(forward, _REFERENCE, f"{cls.__name__}.forward")
        return ("llama", None) if why is None else (None, why)
    norm = getattr(cls, "_norm", None)
    if hasattr(m, "eps") and norm is not None:
        why = mismatch(forward, _GEMMA_FORWARD, f"{cls.__name__}.forward") or \
            mismatch(norm, _GEMMA_NORM, f"{cls.__name__}._norm")
        return ("gemma", None) if why is None else (None, why)
    return None, "no variance_epsilon (Llama's form) or eps and _norm (Gemma's)"


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        return False
    return kernel_runs_on(x, weight) and x.device == weight.device and x.stride(-1) == 1


def install_norms(root: nn.Module, patches: InstancePatches) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every RMSNorm of a form the kernel reproduces under ``root`` the one-kernel forward.

    Returns (the modules changed, (class, reason) for RMSNorm-named classes left as they are).
    """

    done, skipped, verdicts = [], {}, {}
    for name, m in root.named_modules():
        cls = type(m)
        forward = cls.__dict__.get("forward")
        if "forward" in m.__dict__ or forward is None or "RMSNorm" not in cls.__name__:
            continue
        if cls not in verdicts:
            verdicts[cls] = _verdict(cls, m)
        form, why = verdicts[cls]
        if form is None:
            skipped[cls.__name__] = why
            continue

        if form == "llama":
            def fast_forward(self, hidden_states, _orig=m.forward):
                if not _kernel_applies(hidden_states, self.weight):
                    return _orig(hidden_states)
                return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        else:
            def fast_forward(self, x, _orig=m.forward):
                if not _kernel_applies(x, self.weight):
                    return _orig(x)
                return rms_norm(x, self.weight, self.eps, unit_offset=True)

        fast_forward.rms_form = form
        patches.bind(m, "forward", fast_forward)
        done.append((name, m))
    return done, sorted(skipped.items())


def norm_form(module: nn.Module) -> Optional[str]:
    """"llama" or "gemma" while ``module`` runs the forward ``install_norms`` gave it, else None."""
    return getattr(getattr(module.__dict__.get("forward"), "__func__", None), "rms_form", None)


def norm_eps(module: nn.Module, form: str) -> float:
    return module.variance_epsilon if form == "llama" else module.eps


def norm_kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _kernel_applies(x, weight)
