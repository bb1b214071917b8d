"""Routed experts without LoRA as grouped GEMMs, on this model instance only.

The experts that LoRA adapts already run as grouped GEMMs over (token, chosen expert) pairs
(``lora.experts``); an experts module no adapter targets gets the same forward with the base
weights alone, in place of transformers' ``eager`` implementation (a loop over the experts a batch
hits, each one's tokens found on the host) and of its ``grouped_mm`` (its default; slower than these
kernels at decode sizes in the MoE benchmark). Only transformers' fused 3-D layout
(``compat.peft.expert_layout_blocker``) is changed; any other experts implementation (``batched_mm``,
fp8, a kernel from the hub) stays.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..compat.peft import expert_layout_blocker, is_param_wrapper, param_wrapper_chain
from ..instance_methods import InstancePatches
from ..kernel_support import kernel_runs_on
from ..lora.experts import grouped_experts_forward, routing_of


def _forward(original):
    def forward(self, hidden, *args, **kwargs):
        routing = routing_of(args, kwargs)
        weight = self.gate_up_proj
        if (routing is None or "adapter_names" in kwargs or torch.is_grad_enabled()
                or not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.dtype != weight.dtype
                or hidden.device != weight.device):
            return original(hidden, *args, **kwargs)  # training, or a call it does not know: transformers'
        top_k_index, top_k_weights = routing
        return grouped_experts_forward(self, hidden, top_k_index, top_k_weights, kernel_runs_on(hidden, weight))

    return forward


REPLACED = ("eager", "grouped_mm")  # transformers' experts implementations this forward takes over


def _implementation(experts: nn.Module) -> str:
    """The experts implementation transformers dispatches this module to."""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", None) or "eager"


def install_grouped_experts(root: nn.Module, patches: InstancePatches
                            ) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every experts module under ``root`` that no adapter targets the grouped forward.

    Returns (the modules changed, (class, reason) for experts modules left as they are).
    """
    adapted = set()  # experts under PEFT's parameter wrappers: fastlora's expert sites serve them
    for m in root.modules():
        if is_param_wrapper(m):
            adapted.add(id(param_wrapper_chain(m)[0]))
    done, skipped = [], {}
    for name, m in root.named_modules():
        gate_up = getattr(m, "gate_up_proj", None)
        if id(m) in adapted or not (isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3):
            continue
        cls = type(m).__name__
        why, implementation = expert_layout_blocker(m, {}), _implementation(m)
        if why is None and "forward" in m.__dict__:
            why = "it has an instance forward already"
        if why is None and implementation not in REPLACED:
            why = f"experts_implementation={implementation!r} (the model's choice)"
        if why is not None:
            skipped[cls] = why
            continue
        patches.bind(m, "forward", _forward(m.forward))
        done.append((name, m))
    return done, sorted(skipped.items())
