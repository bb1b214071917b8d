"""On the GPU: q/k/v and gate/up siblings without LoRA in one GEMM (``base_ops.fused_linears``),
through fastlora's decode graphs, in float32 so that tokens can be compared exactly: a plain model
patched alone over calls of changing batch sizes, and a PEFT model whose adapters skip gate/up."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora

from _models import left_padded_batch, tiny_llama

pytestmark = pytest.mark.gpu


def test_plain_model_fused_siblings_equal_the_model_over_changing_batches():
    model = tiny_llama(0, vocab_size=128).cuda()
    model.generation_config.eos_token_id = None
    layers = model.config.num_hidden_layers
    calls = [[5, 9, 3], [7], [4, 8, 2, 9, 6, 5, 3, 7, 9, 1, 2, 4, 6, 8, 3, 5, 7], [6, 6]]
    refs = []
    with torch.no_grad():
        for lengths in calls:
            batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=len(lengths)).items()}
            refs.append(model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=0))
        report = fastlora.patch(model)
        assert report.fused_base_groups == 2 * layers, report
        assert "siblings without LoRA in one GEMM: %d groups" % (2 * layers) in str(report)
        outs = []
        for lengths in calls:
            batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=len(lengths)).items()}
            outs.append(model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=0))
        stats = fastlora.get_state(model).graph_runner.stats
        fastlora.unpatch(model)
    assert stats["replays"] >= 80 and stats["eager_steps"] == 0, stats
    for lengths, out, ref in zip(calls, outs, refs):
        assert torch.equal(out, ref), f"call with rows {lengths}"
    attn = model.model.layers[0].self_attn
    assert "forward" not in attn.q_proj.__dict__  # unpatched: the class forwards, own storages
    # own storages again (two small clones may well lie side by side: compare storages, not addresses)
    assert attn.k_proj.weight.untyped_storage().data_ptr() != attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.q_proj.weight.untyped_storage().nbytes() == attn.q_proj.weight.numel() * 4


def test_peft_model_with_adapters_on_attention_only_fuses_gate_up_and_equals_peft():
    base = tiny_llama(1, vocab_size=128).cuda()
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"],
                                            init_lora_weights=False), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], init_lora_weights=False))
    model.eval()
    batch = {k: v.cuda() for k, v in left_padded_batch([5, 9, 3, 7]).items()}
    kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=0, adapter_names=["a", "__base__", "b", "a"])
    with torch.no_grad():
        ref = model.generate(**batch, **kw)
        report = fastlora.patch(model)
        out = model.generate(**batch, **kw)
        fastlora.unpatch(model)
    assert report.fused_base_groups == base.config.num_hidden_layers, report  # gate/up of each layer
    assert torch.equal(out, ref)
