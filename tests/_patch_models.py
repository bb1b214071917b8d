"""The tiny Llama of ``e2e/test_patch_behaviour.py`` (vocabulary 96) and its adapters, built the same
way by the LoRA tests (slots, registered adapters, slot traffic) that compare a patched model with
PEFT's own on an identical copy.

``build`` gives a PEFT model with adapters "sql" (every linear, rank 4) and "chat" (q/v, rank 8) by
default; ``init_lora_weights=False`` (random, non-zero B) so that each adapter changes the output."""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig, get_peft_model

from _models import tiny_llama as _tiny_llama

VOCAB = 96
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))


def tiny_llama(seed: int = 0):
    return _tiny_llama(seed, vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64)


def lora(targets, r=4, alpha=8, **kw):
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **kw)


def with_lora(base, named_configs, seed: int):
    """``base`` wrapped by PEFT with each (name, LoraConfig), the i-th adapter's random values drawn
    after ``torch.manual_seed(seed + i)`` (PEFT's warnings silenced); ``base`` itself when there are
    none."""
    model = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (name, cfg) in enumerate(named_configs):
            torch.manual_seed(seed + i)
            if model is None:
                model = get_peft_model(base, cfg, adapter_name=name)
            else:
                model.add_adapter(name, cfg)
    return base if model is None else model


def build(adapters=(("sql", ALL, 4, {}), ("chat", ("q_proj", "v_proj"), 8, {}))):
    """A tiny Llama with the given (name, targets, rank, extra LoraConfig kwargs) adapters."""
    model = None
    for i, (name, targets, r, kw) in enumerate(adapters):
        torch.manual_seed(100 + i)
        if model is None:
            model = get_peft_model(tiny_llama(), lora(targets, r, 2 * r, **kw), adapter_name=name)
        else:
            model.add_adapter(name, lora(targets, r, 2 * r, **kw))
    return model.eval()


def logits(model, names=None, ids=IDS):
    kw = {} if names is None else {"adapter_names": names}
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits
