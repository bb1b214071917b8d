"""SiLU-gated MLPs with ``silu(gate) * up`` in one Triton launch, on this model instance only.

An MLP is changed only when its class's ``forward`` is, up to formatting, the Llama-family
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` and its ``act_fn`` is SiLU (Llama, Mistral,
Qwen2/3, ...). The instance forward still calls ``gate_proj``, ``up_proj`` and ``down_proj`` in
that order, so LoRA layers, fastlora's fused gate/up GEMM and PEFT's own path all keep working;
only the activation and the product become ``ops.silu_mul``, when the kernel takes the inputs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import List, Tuple

import torch
from torch import nn

from ._forwards import kernel_runs_on, set_instance_forward

_REFERENCE_FORWARD = '''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
'''
_REFERENCE_CODE = ast.dump(ast.parse(_REFERENCE_FORWARD).body[0])


def _is_silu(act) -> bool:
    cls = type(act)
    return cls is nn.SiLU or (cls.__module__ == "transformers.activations" and cls.__name__ == "SiLUActivation")


def is_silu_gated_mlp(module: nn.Module) -> bool:
    forward = type(module).__dict__.get("forward")
    if forward is None or not _is_silu(getattr(module, "act_fn", None)):
        return False
    if not all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(tree, ast.FunctionDef):
        return False
    for arg in tree.args.args:  # type annotations do not change what the code does
        arg.annotation = None
    tree.returns = None
    return ast.dump(tree) == _REFERENCE_CODE


def _kernel_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return False
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return False
    if gate.dtype not in (torch.float16, torch.bfloat16, torch.float32) or gate.dim() < 1:
        return False
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return False
    try:  # the rows must be one stride apart (true of slices of a fused projection output)
        gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
    except RuntimeError:
        return False
    return kernel_runs_on(gate, up)


def install_gated_mlps(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Give every SiLU-gated Llama-family MLP under ``root`` the fused activation; returns them."""
    from .ops.silu_mul import silu_mul

    def forward(self, x):
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        hidden = silu_mul(gate, up) if _kernel_applies(gate, up) else self.act_fn(gate) * up
        return self.down_proj(hidden)

    done = []
    for name, m in root.named_modules():
        if "forward" not in m.__dict__ and is_silu_gated_mlp(m):
            set_instance_forward(m, forward)
            done.append((name, m))
    return done
