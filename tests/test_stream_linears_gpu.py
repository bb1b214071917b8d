"""On the GPU: the base model's decode GEMMs through the weight-streaming kernel
(``base_ops.stream_linears``), in a two-layer model of Llama-3-8B's widths (narrower layers keep
cuBLAS) with three adapters of mixed ranks, bf16: a decode-sized forward's logits and a mixed-adapter
``generate`` through the graphs, against PEFT's own mixed batch and against fastlora with the
kernel off."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora
import peft_fastlora.ops.stream_gemm as stream_ops

from _helpers import count_calls
from _models import left_padded_batch, tiny_llama

pytestmark = pytest.mark.gpu

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["a", "__base__", "b", "c", "a", "c"]


@pytest.fixture(scope="module")
def model():
    base = tiny_llama(3, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128).to("cuda", torch.bfloat16)
    base.generation_config.eos_token_id = None
    m = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=ALL, init_lora_weights=False),
                       adapter_name="a")
    m.add_adapter("b", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                  init_lora_weights=False))
    m.add_adapter("c", LoraConfig(r=32, lora_alpha=32, target_modules=ALL, init_lora_weights=False))
    return m.eval()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_decode_sized_forward_equals_peft(model, monkeypatch):
    ids = torch.randint(3, 128, (len(NAMES), 8), device="cuda")  # 48 rows: the kernel's size
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=NAMES).logits
        base = model.get_base_model()(input_ids=ids).logits
        report = fastlora.patch(model, stream_gemm=True)
        try:
            calls = count_calls(monkeypatch, stream_ops, ["stream_gemm"])
            out = model(input_ids=ids, adapter_names=NAMES).logits
        finally:
            fastlora.unpatch(model)
    assert "decode GEMMs streamed: fused groups and" in str(report), report
    # q/k/v and gate/up groups, o and down (folded or not) of both layers; the LM head keeps cuBLAS
    assert calls["stream_gemm"] >= 8, calls
    assert _rel(ref, base) > 1e-2  # the adapters matter, so the comparison below means something
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("lengths", [[5, 9, 3, 7, 2, 8], [6]])
def test_generate_through_graphs_equals_the_kernel_off(model, lengths):
    """The graphs' decode steps with the kernel give the logits of the same steps with cuBLAS, step
    after step while the tokens agree (bf16: a near tie may round the other way)."""
    names = NAMES[:len(lengths)]
    batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=len(lengths)).items()}
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, adapter_names=names, output_logits=True,
              return_dict_in_generate=True)
    results = {}
    with torch.no_grad():
        for on in (True, False):
            report = fastlora.patch(model, stream_gemm=on)
            try:
                results[on] = model.generate(**batch, **kw)
                stats = dict(fastlora.get_state(model).graph_runner.stats)
            finally:
                fastlora.unpatch(model)
            assert stats["replays"] >= 8, stats
            assert ("decode GEMMs streamed: off" in str(report)) != on, report
    width = batch["input_ids"].shape[1]
    a, b = results[True], results[False]
    compared = 0
    for step, (la, lb) in enumerate(zip(a.logits, b.logits)):
        if not torch.equal(a.sequences[:, width:width + step], b.sequences[:, width:width + step]):
            break
        assert _rel(la, lb) < 1e-2, f"step {step}"
        compared += 1
    assert compared >= 2
