"""RMSNorm modules served by one Triton kernel each (``ops.rms_norm``), on this model instance only.

A norm is changed only when its class's ``forward`` computes what the Llama-family one does
(``match.py``), whose numerics the kernel reproduces: Llama, Mistral, Qwen2, Qwen3, ... Gemma's
``(1 + weight)`` norm and anything else keep their own forward, and a class named like an RMSNorm
that does not match is reported with the reason. Inputs the kernel does not take (other devices,
gradients) go through the original forward.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..kernel_support import FLOAT_DTYPES, kernel_runs_on
from .install import set_instance_forward
from .match import mismatch, reference_shape

_REFERENCE = reference_shape('''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
''')


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        return False
    return kernel_runs_on(x, weight) and x.device == weight.device and x.stride(-1) == 1


def install_norms(root: nn.Module) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every Llama-family RMSNorm under ``root`` the one-kernel forward.

    Returns (the modules changed, (class, reason) for RMSNorm-named classes left as they are).
    """
    from ..ops.rms_norm import rms_norm

    done, skipped, verdicts = [], {}, {}
    for name, m in root.named_modules():
        cls = type(m)
        forward = cls.__dict__.get("forward")
        if "forward" in m.__dict__ or forward is None or "RMSNorm" not in cls.__name__:
            continue
        if cls not in verdicts:
            why = None
            if not (hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.Tensor)):
                why = "no variance_epsilon / weight"
            verdicts[cls] = why or mismatch(forward, _REFERENCE, f"{cls.__name__}.forward")
        if verdicts[cls] is not None:
            skipped[cls.__name__] = verdicts[cls]
            continue

        def fast_forward(self, hidden_states, _orig=m.forward):
            if not _kernel_applies(hidden_states, self.weight):
                return _orig(hidden_states)
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)

        set_instance_forward(m, fast_forward)
        done.append((name, m))
    return done, sorted(skipped.items())
