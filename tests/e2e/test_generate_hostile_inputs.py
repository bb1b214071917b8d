"""``generate`` and forwards called with inputs PEFT's own mixed batch accepts but that are off the
common path: the patched model gives PEFT's tokens and outputs, and what it hands back is the
caller's. Each test compares a patched model with PEFT on an identical copy; graphed calls run
with ``cuda_graphs="emulate"`` (the decode-graph runner without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.compat.generate import cache_kwarg_name, generation_output_cache

from _patch_models import IDS, build, logits

MASK = torch.ones_like(IDS)
NAMES = ["sql", "chat", "__base__", "sql"]
GREEDY = dict(attention_mask=MASK, max_new_tokens=4, do_sample=False)


def pair(**options):
    m, ref = build(), build()
    fastlora.patch(m, **options)
    return m, ref


def generate(model, **kw):
    with torch.no_grad():
        return model.generate(**kw)


def test_adapter_names_as_a_numpy_array_equals_peft():
    """PEFT takes any sequence of names (it iterates, compares and slices them)."""
    m, ref = pair()
    names = np.array(NAMES)
    graphed, graphed_ref = pair(cuda_graphs="emulate")
    assert torch.equal(generate(graphed, input_ids=IDS, **GREEDY, adapter_names=names),
                       generate(graphed_ref, input_ids=IDS, **GREEDY, adapter_names=NAMES))
    torch.testing.assert_close(logits(m, names), logits(ref, NAMES), atol=1e-5, rtol=1e-5)
    assert torch.equal(generate(m, input_ids=IDS, **GREEDY, adapter_names=names),
                       generate(ref, input_ids=IDS, **GREEDY, adapter_names=NAMES))


def test_adapter_names_as_a_numpy_array_skip_pefts_per_call_hooks(monkeypatch):
    """fastlora serves an array of names as it serves a list: PEFT hooks no layer for the call."""
    m, ref = pair()
    hooked = []
    real = torch.nn.Module.register_forward_pre_hook

    def spy(module, *args, **kwargs):
        hooked.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", spy)
    expected = logits(ref, NAMES)
    assert hooked, "the spy must see PEFT hooking its layers"
    hooked.clear()
    torch.testing.assert_close(logits(m, np.array(NAMES)), expected, atol=1e-5, rtol=1e-5)
    assert hooked == []
    with pytest.raises(ValueError, match="non-existing adapter"):
        logits(m, np.array(["sql", "nope", "chat", "sql"]))
    with pytest.raises(ValueError, match=r"one adapter name per row, got an array of shape \(2, 2\)"):
        logits(m, np.array([["sql", "chat"], ["sql", "chat"]]))


@pytest.mark.parametrize("where", ["keyword", "generation_config", "model"])
def test_use_cache_false_on_a_graphed_model_equals_peft(where):
    """Without a cache every step feeds the whole sequence: a cache handed in by the graphs would
    be written again at every step."""
    m, ref = pair(cuda_graphs="emulate")
    kw = dict(input_ids=IDS, **GREEDY, adapter_names=NAMES)
    if where == "keyword":
        kw["use_cache"] = False
    elif where == "generation_config":
        kw["generation_config"] = GenerationConfig(use_cache=False, pad_token_id=0, eos_token_id=2)
    else:
        for model in (m, ref):
            model.generation_config.use_cache = False
    assert torch.equal(generate(m, **kw), generate(ref, **kw))
    assert get_state(m).graph_runner.stats["eager_reasons"] == {"use_cache=False": 1}


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_each_steps_hidden_states_are_its_own(flag):
    """``return_dict_in_generate`` with per-step hidden states or attentions: every step's tensors
    equal PEFT's (a replayed step's outputs would be the graph's buffers, overwritten by the next)."""
    m, ref = build(), build()
    for model in (m, ref):
        model.base_model.model.config._attn_implementation = "eager"  # attentions need eager
    fastlora.patch(m, cuda_graphs="emulate")
    kw = dict(input_ids=IDS, **GREEDY, adapter_names=NAMES, return_dict_in_generate=True, **{flag: True})
    got, want = generate(m, **kw), generate(ref, **kw)
    field = "hidden_states" if flag == "output_hidden_states" else "attentions"
    steps, steps_ref = getattr(got, field), getattr(want, field)
    assert len(steps) == len(steps_ref) == 4
    for step, step_ref in zip(steps, steps_ref):
        assert len(step) >= 2  # a tensor per layer
        for t, t_ref in zip(step, step_ref, strict=True):
            torch.testing.assert_close(t, t_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [4, 3])
def test_the_returned_cache_outlives_the_next_call(rows):
    """The cache ``return_dict_in_generate`` hands back is the caller's: another call in between
    does not change it, it holds the call's rows only (3 rows run in a graph bucket of 4), and
    generation continued from it equals PEFT's."""
    m, ref = pair(cuda_graphs="emulate")
    other = torch.randint(3, 96, IDS.shape, generator=torch.Generator().manual_seed(9))
    ids, names = IDS[:rows], NAMES[:rows]
    outs = []
    for model in (m, ref):
        first = generate(model, input_ids=ids, **dict(GREEDY, attention_mask=MASK[:rows]), adapter_names=names,
                         return_dict_in_generate=True)
        generate(model, input_ids=other, **GREEDY, adapter_names=["chat"] * 4)  # another call in between
        cache = generation_output_cache(first)  # (``cache`` from transformers 5.2x, ``past_key_values`` before)
        assert cache.get_seq_length() == ids.shape[1] + 3
        assert tuple(cache.layers[0].keys.shape) == (rows, 2, ids.shape[1] + 3, 8)
        outs.append(generate(model, input_ids=first.sequences, attention_mask=torch.ones_like(first.sequences),
                             max_new_tokens=3, do_sample=False, adapter_names=names,
                             **{cache_kwarg_name(model.base_model.model): cache}))
    assert get_state(m).graph_runner.stats["replays"] > 0
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("where", ["generation_config", "model"])
def test_num_return_sequences_from_a_generation_config_on_a_graphed_model(where):
    """Sampling with ``num_return_sequences=2`` set in a generation config, not as a keyword: the
    graphs' cache holds every returned row (it held the input rows only, and transformers failed
    deep in the cache's update), and the sequences equal PEFT's."""
    m, ref = pair(cuda_graphs="emulate")
    kw = dict(input_ids=IDS, attention_mask=MASK, adapter_names=[n for n in NAMES for _ in range(2)])
    if where == "generation_config":
        kw["generation_config"] = GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=4,
                                                   pad_token_id=0, eos_token_id=2)
    else:
        for model in (m, ref):
            model.generation_config.update(do_sample=True, num_return_sequences=2)
        kw["max_new_tokens"] = 4
    outs = []
    for model in (m, ref):
        torch.manual_seed(3)
        outs.append(generate(model, **kw))
    assert outs[0].shape == (8, IDS.shape[1] + 4)
    assert torch.equal(outs[0], outs[1])
    assert get_state(m).graph_runner.stats["replays"] == 3


@pytest.mark.parametrize("model_sets", [False, True])
def test_a_generation_config_without_a_length_on_a_graphed_model(model_sets):
    """A generation config that sets no length: the model's ``max_new_tokens`` where it has one,
    else transformers' default length past the prompt (fastlora sized its cache with ``int(None)``)."""
    m, ref = pair(cuda_graphs="emulate")
    if model_sets:
        for model in (m, ref):
            model.generation_config.max_new_tokens = 3
    kw = dict(input_ids=IDS, attention_mask=MASK, adapter_names=NAMES,
              generation_config=GenerationConfig(do_sample=False))
    got, want = generate(m, **kw), generate(ref, **kw)
    assert got.shape == want.shape == (4, IDS.shape[1] + (3 if model_sets else 20))
    assert torch.equal(got, want)
