"""RMSNorm modules of the model served by one Triton kernel each, on this model instance only.

A norm is replaced only when its class's ``forward`` is, to the character, the Llama-family one
whose numerics ``ops.rms_norm`` reproduces (Llama, Mistral, Qwen2, Qwen3, ...): found by what the
code does, not by a list of model names. Gemma's ``(1 + weight)`` norm and anything else keep their
own forward. Inputs the kernel does not take (CPU tensors outside the interpreter, gradients)
go through the original forward.
"""

from __future__ import annotations

import inspect
from typing import List, Tuple

import torch
from torch import nn

from ._forwards import kernel_runs_on, set_instance_forward

_REFERENCE_FORWARD = '''    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
'''


def _is_llama_rms_norm(module: nn.Module) -> bool:
    forward = type(module).__dict__.get("forward")
    if forward is None or not hasattr(module, "variance_epsilon") or not hasattr(module, "weight"):
        return False
    try:
        return inspect.getsource(forward) == _REFERENCE_FORWARD
    except (OSError, TypeError):
        return False


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return False
    return kernel_runs_on(x, weight) and x.device == weight.device and x.stride(-1) == 1


def install_norms(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Give every Llama-family RMSNorm under ``root`` the one-kernel forward; returns them."""
    from .ops.rms_norm import rms_norm

    done = []
    for name, m in root.named_modules():
        if "forward" in m.__dict__ or not _is_llama_rms_norm(m):
            continue

        def forward(self, hidden_states, _orig=m.forward):
            if not _kernel_applies(hidden_states, self.weight):
                return _orig(hidden_states)
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)

        set_instance_forward(m, forward)
        done.append((name, m))
    return done
