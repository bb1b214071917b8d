"""``test_generate_hostile_inputs.py``'s calls on the GPU: real CUDA graphs and Triton kernels in
float32, the patched model against PEFT on an identical copy (tokens compared exactly, hidden
states and logits within float32 kernel rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.compat.generate import cache_kwarg_name, generation_output_cache

from _patch_models import IDS, build

pytestmark = pytest.mark.gpu

NAMES = ["sql", "chat", "__base__", "sql"]
F32 = {"atol": 1e-4, "rtol": 1e-4}


def pair(device: str = "cuda", graphs=True, eager_attention: bool = False):
    """A patched model and PEFT's on identical copies, on ``device``."""
    m, ref = build().to(device), build().to(device)
    if eager_attention:
        for model in (m, ref):
            model.base_model.model.config._attn_implementation = "eager"
    report = fastlora.patch(m, cuda_graphs=graphs)
    assert report.left_on_peft == [], report
    return m, ref


def inputs(device: str = "cuda", rows: int = 4):
    ids = IDS[:rows].to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 4, "do_sample": False}


def generate(model, **kw):
    with torch.no_grad():
        return model.generate(**kw)


def check_numpy_names(device="cuda", graphs=True):
    m, ref = pair(device, graphs)
    got = generate(m, **inputs(device), adapter_names=np.array(NAMES))
    assert torch.equal(got, generate(ref, **inputs(device), adapter_names=NAMES))
    assert get_state(m).graph_runner.stats["replays"] > 0


def check_use_cache_false(device="cuda", graphs=True):
    m, ref = pair(device, graphs)
    kw = dict(inputs(device), adapter_names=NAMES, use_cache=False)
    assert torch.equal(generate(m, **kw), generate(ref, **kw))
    assert get_state(m).graph_runner.stats["eager_reasons"] == {"use_cache=False": 1}


def check_hidden_states(flag, device="cuda", graphs=True):
    m, ref = pair(device, graphs, eager_attention=True)
    kw = dict(inputs(device), adapter_names=NAMES, return_dict_in_generate=True, **{flag: True})
    got, want = generate(m, **kw), generate(ref, **kw)
    assert torch.equal(got.sequences, want.sequences)
    field = "hidden_states" if flag == "output_hidden_states" else "attentions"
    assert len(getattr(got, field)) == len(getattr(want, field)) == 4
    for step, step_ref in zip(getattr(got, field), getattr(want, field), strict=True):
        for t, t_ref in zip(step, step_ref, strict=True):
            torch.testing.assert_close(t, t_ref, **F32)


def check_returned_cache(rows, device="cuda", graphs=True):
    m, ref = pair(device, graphs)
    other = torch.randint(3, 96, IDS.shape, generator=torch.Generator().manual_seed(9)).to(device)
    names = NAMES[:rows]
    outs = []
    for model in (m, ref):
        first = generate(model, **inputs(device, rows), adapter_names=names, return_dict_in_generate=True)
        generate(model, input_ids=other, attention_mask=torch.ones_like(other), max_new_tokens=4,
                 do_sample=False, adapter_names=["chat"] * 4)
        cache = generation_output_cache(first)  # (``cache`` from transformers 5.2x, ``past_key_values`` before)
        assert cache.get_seq_length() == IDS.shape[1] + 3
        outs.append(generate(model, input_ids=first.sequences, attention_mask=torch.ones_like(first.sequences),
                             max_new_tokens=3, do_sample=False, adapter_names=names,
                             **{cache_kwarg_name(model.base_model.model): cache}))
    assert get_state(m).graph_runner.stats["replays"] > 0
    assert torch.equal(outs[0], outs[1])


def check_num_return_sequences(device="cuda", graphs=True):
    """Two sequences a row from a generation config, sampled with ``top_k=1`` so that the draws do
    not depend on the kernels' rounding (greedy refuses several sequences)."""
    m, ref = pair(device, graphs)
    config = GenerationConfig(do_sample=True, top_k=1, num_return_sequences=2, max_new_tokens=4,
                              pad_token_id=0, eos_token_id=2)
    ids = IDS.to(device)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=[n for n in NAMES for _ in range(2)],
              generation_config=config)
    got, want = generate(m, **kw), generate(ref, **kw)
    assert got.shape == want.shape == (8, IDS.shape[1] + 4)
    assert torch.equal(got, want)
    assert get_state(m).graph_runner.stats["replays"] > 0


def check_config_without_length(device="cuda", graphs=True):
    m, ref = pair(device, graphs)
    ids = IDS.to(device)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=NAMES,
              generation_config=GenerationConfig(do_sample=False))
    got, want = generate(m, **kw), generate(ref, **kw)
    assert got.shape == want.shape == (4, IDS.shape[1] + 20)
    assert torch.equal(got, want)
    assert get_state(m).graph_runner.stats["replays"] > 0


def test_adapter_names_as_a_numpy_array():
    check_numpy_names()


def test_use_cache_false_decodes_eagerly():
    check_use_cache_false()


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_each_steps_hidden_states_are_its_own(flag):
    check_hidden_states(flag)


@pytest.mark.parametrize("rows", [4, 3])
def test_the_returned_cache_outlives_the_next_call(rows):
    check_returned_cache(rows)


def test_num_return_sequences_from_a_generation_config():
    check_num_return_sequences()


def test_a_generation_config_without_a_length():
    check_config_without_length()
