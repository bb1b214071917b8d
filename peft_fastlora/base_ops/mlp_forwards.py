"""SiLU-gated MLPs with ``silu(gate) * up`` in one Triton launch (``ops.silu_mul``), on this model
instance only.

An MLP is changed only when its class's ``forward`` computes the Llama-family
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (``match.py``) and its ``act_fn`` is SiLU (Llama,
Mistral, Qwen2/3, ...). The instance forward still calls ``gate_proj``, ``up_proj`` and
``down_proj`` in that order, so LoRA layers, fastlora's fused gate/up GEMM and PEFT's own path all
keep working; only the activation and the product become one kernel, when it takes the inputs.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..kernel_support import FLOAT_DTYPES, kernel_runs_on
from .install import candidates, set_instance_forward
from .match import mismatch, reference_shape

_REFERENCE = reference_shape('''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
''')


def _is_silu(act) -> bool:
    cls = type(act)
    return cls is nn.SiLU or (cls.__module__ == "transformers.activations" and cls.__name__ == "SiLUActivation")


def _kernel_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return False
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return False
    if gate.dtype not in FLOAT_DTYPES or gate.dim() < 1:
        return False
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return False
    try:  # the rows must be one stride apart (true of slices of a fused projection output)
        gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
    except RuntimeError:
        return False
    return kernel_runs_on(gate, up)


def _fast_forward(self, x):
    from ..ops.silu_mul import silu_mul

    gate = self.gate_proj(x)
    up = self.up_proj(x)
    hidden = silu_mul(gate, up) if _kernel_applies(gate, up) else self.act_fn(gate) * up
    return self.down_proj(hidden)


def install_gated_mlps(root: nn.Module) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every SiLU-gated Llama-family MLP under ``root`` the fused activation.

    Returns (the modules changed, (class, reason) for gate/up/down MLPs left as they are).
    """
    done, skipped, verdicts = [], {}, {}
    for name, m, forward in candidates(root, ("gate_proj", "up_proj", "down_proj")):
        cls = type(m)
        if not _is_silu(getattr(m, "act_fn", None)):
            skipped[cls.__name__] = f"activation {type(getattr(m, 'act_fn', None)).__name__} is not SiLU"
            continue
        if cls not in verdicts:
            verdicts[cls] = mismatch(forward, _REFERENCE, f"{cls.__name__}.forward")
        if verdicts[cls] is not None:
            skipped[cls.__name__] = verdicts[cls]
            continue
        set_instance_forward(m, _fast_forward)
        done.append((name, m))
    return done, sorted(skipped.items())
