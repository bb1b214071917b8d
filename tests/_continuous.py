"""Shared by the continuous-batching tests (CPU and GPU): a small engine config, serving
requests through a started manager, and PEFT's own answer for one prompt alone, the oracle every
request is compared with."""

from __future__ import annotations

import dataclasses
import time
from typing import Collection, Dict, List, Sequence

import pytest
import torch

from _models import VOCAB


requires_cb = pytest.mark.skipif(
    not hasattr(__import__("transformers"), "ContinuousBatchingConfig"),
    reason="this transformers has no continuous batching")


def collect(manager, ids: Collection[str], timeout: float = 60.0,
            cancelled: Collection[str] = ()) -> Dict[str, List[int]]:
    """Tokens of the requests ``ids`` by id, once every one has finished without error (a
    cancelled one may deliver nothing)."""
    finished, deadline, cancelled = {}, time.monotonic() + timeout, set(cancelled)
    while len(finished) + len(cancelled - set(finished)) < len(ids):
        assert time.monotonic() < deadline, f"timed out: {len(finished)} of {len(ids)} finished"
        result = manager.get_result(timeout=0.5)
        if result is not None and result.is_finished():
            assert result.error is None, result.error
            finished[result.request_id] = list(result.generated_tokens)
    return finished


def random_traffic(manager, rng, names: Sequence[str], prompt_of, bursts: int = 10, timeout: float = 180.0):
    """Server-like traffic into a started manager: ``bursts`` bursts of 1-6 requests (random
    prompts from ``prompt_of(seed)``, adapters from ``names``, 1-16 new tokens), a tenth naming an
    adapter that does not exist (refused by name), some cancelled, short random pauses between
    bursts. Returns ``({request id: (prompt, name, new tokens)}, {id: tokens})`` of those that
    finished."""
    expected, cancelled = {}, set()
    for burst in range(bursts):
        for _ in range(rng.randint(1, 6)):
            prompt = prompt_of(rng.randint(0, 10**6))
            if rng.random() < 0.1:
                with pytest.raises(ValueError, match="non-existing adapter"):
                    manager.add_request(prompt, adapter_name=f"typo{burst}")
                continue
            name, new = rng.choice(names), rng.randint(1, 16)
            rid = manager.add_request(prompt, adapter_name=name, max_new_tokens=new)
            expected[rid] = (prompt, name, new)
            if rng.random() < 0.15:
                manager.cancel_request(rid)
                cancelled.add(rid)
        time.sleep(rng.random() * 0.03)
    return expected, collect(manager, list(expected), timeout, cancelled)


def assert_each_equals_peft(ref, expected, finished) -> None:
    """Every finished request's tokens (``random_traffic``'s results) equal PEFT's for its prompt alone."""
    for rid, tokens in finished.items():
        prompt, name, new = expected[rid]
        assert tokens == peft_alone(ref, prompt, name, new), (rid, name, len(prompt))


def serve(manager, requests, timeout: float = 120.0) -> List[List[int]]:
    """Add (prompt, adapter name, new tokens) requests to a started manager; their tokens in order."""
    ids = [manager.add_request(p, adapter_name=n, max_new_tokens=k) for p, n, k in requests]
    finished = collect(manager, ids, timeout)
    return [finished[i] for i in ids]


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
    """PEFT's greedy tokens for this prompt alone, with this adapter (``"__base__"``: none). A DoRA
    adapter, which PEFT refuses in ``adapter_names``, is made the active one for the call."""
    device = next(ref.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    dora = any(getattr(m, "use_dora", {}).get(name, False) for m in ref.modules())
    with torch.no_grad():
        if dora:
            ref.set_adapter(name)
            out = ref.generate(**kw)
        else:
            out = ref.generate(**kw, adapter_names=[name])
    return out[0, len(prompt):].tolist()
