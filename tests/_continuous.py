"""Shared by the continuous-batching tests (CPU and GPU): a small engine config and PEFT's own
answer for one prompt alone, the oracle every request is compared with."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

import torch

from _models import VOCAB


def cb_config(**overrides):
    """A ``ContinuousBatchingConfig`` sized for tiny models (no auto-sizing from free memory, which
    on CPU builds a multi-GB attention mask). ``page``: tokens per cache page, whatever the
    field is called in this transformers version."""
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw = dict(num_blocks=64, max_batch_tokens=64, max_requests_per_batch=16)
    page = overrides.pop("page", 16)
    kw["page_size" if "page_size" in fields else "block_size"] = page
    kw.update(overrides)
    return ContinuousBatchingConfig(**kw)


def greedy_config(new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def random_prompts(lengths: Sequence[int], seed: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in lengths]


def peft_alone(ref, prompt: Sequence[int], name: str, new_tokens: int) -> List[int]:
    """PEFT's greedy tokens for this prompt alone, with this adapter (``"__base__"``: none)."""
    device = next(ref.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=[name],
                           max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
