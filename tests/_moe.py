"""What the MoE tests share: PEFT adapters on attention and routed experts (``target_parameters``)
over a base model, and the oracle, PEFT row by row with that row's adapter active (PEFT refuses
expert adapters in ``adapter_names``)."""

from __future__ import annotations

import contextlib

import torch
from peft import LoraConfig

from _patch_models import with_lora

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def with_expert_adapters(base, adapters, b_scale: float):
    """``base`` under PEFT with these (name, target_modules, target_parameters, rank) adapters,
    each seeded, random (B times ``b_scale``), in eval mode."""
    model = with_lora(base, [(name, LoraConfig(r=r, lora_alpha=2 * r, target_modules=modules or None,
                                               target_parameters=params, init_lora_weights=False))
                             for name, modules, params, r in adapters], seed=10)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(b_scale)
    return model.eval()


def peft_row_by_row(model, x, names, new_tokens=None):
    """Each row of ``x`` alone through PEFT with its adapter active (none for ``"__base__"``): the
    logits in float32, or the tokens of greedy ``generate`` when ``new_tokens``."""
    outs = []
    with torch.no_grad():
        for i, name in enumerate(names):
            row = x[i: i + 1]
            if name != "__base__":
                model.set_adapter(name)
            with model.disable_adapter() if name == "__base__" else contextlib.nullcontext():
                if new_tokens is None:
                    outs.append(model(input_ids=row).logits.float())
                else:
                    outs.append(model.generate(input_ids=row, attention_mask=torch.ones_like(row), do_sample=False,
                                               max_new_tokens=new_tokens, pad_token_id=0))
    return torch.cat(outs)
