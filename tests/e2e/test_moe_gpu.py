"""LoRA on routed experts on the GPU: mixed batches over Mixtral- and Qwen3-MoE-shaped models
through the Triton backend and CUDA graphs, against PEFT row by row (that row's adapter active).

float32 models compare greedy tokens exactly over many graphed steps; bfloat16 compares logits
with a bf16 tolerance (PEFT adds the merged delta to the expert weights in bf16; fastlora adds
the low-rank product to the projection's output)."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import peft_fastlora as fastlora
from _moe import EXPERTS, peft_row_by_row, with_expert_adapters

pytestmark = pytest.mark.gpu

VOCAB = 512
DEVICE = "cuda"
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, num_experts_per_tok=2)
ARCHS = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=8)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=192, moe_intermediate_size=80,
                                                            head_dim=32, num_experts=8, decoder_sparse_step=1,
                                                            norm_topk_prob=True)),
}
ADAPTERS = (("both", ["q_proj", "v_proj"], EXPERTS, 8), ("attn", ["q_proj", "o_proj"], None, 16),
            ("routed", [], EXPERTS, 16), ("wide", ["k_proj"], EXPERTS, 32))


def build(arch: str, dtype):
    torch.manual_seed(0)
    base = ARCHS[arch]().to(DEVICE, dtype).eval()
    base.generation_config.eos_token_id = None
    return with_expert_adapters(base, ADAPTERS, b_scale=0.1).to(dtype)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_graphed_generate_equals_peft_row_by_row(arch):
    model = build(arch, torch.float32)
    names = ["both", "__base__", "routed", "attn", "wide", "both", "routed", "wide"]
    x = torch.randint(1, VOCAB, (len(names), 9), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3))
    expected = peft_row_by_row(model, x, names, new_tokens=24)
    report = fastlora.patch(model)
    try:
        assert report.left_on_peft == [] and report.counts().get("experts") == 2, report
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=names,
                                 max_new_tokens=24, do_sample=False, pad_token_id=0)
        stats = fastlora.get_state(model).graph_runner.stats
    finally:
        fastlora.unpatch(model)
    assert torch.equal(out, expected)
    assert stats["replays"] >= 20 and stats["eager_steps"] == 0, stats


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_logits_as_close_to_fp32_as_peft(arch):
    """In bf16, fastlora's mixed batch is no further from the float32 answer (PEFT row by row)
    than PEFT's own bf16 rows are."""
    model = build(arch, torch.float32)
    names = ["routed", "both", "__base__", "wide", "attn", "routed"]
    x = torch.randint(1, VOCAB, (len(names), 33), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(4))
    exact = peft_row_by_row(model, x, names)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=x).logits.float()
    model.to(torch.bfloat16)
    peft_bf16 = peft_row_by_row(model, x, names)
    fastlora.patch(model)
    try:
        with torch.no_grad():
            out = model(input_ids=x, adapter_names=names).logits.float()
    finally:
        fastlora.unpatch(model)

    def rel(a):
        return ((a - exact).norm() / exact.norm()).item()

    assert rel(base) > 5e-2  # the adapters matter, so the comparison below means something
    assert rel(out) <= 1.5 * rel(peft_bf16) + 1e-3, (rel(out), rel(peft_bf16), rel(base))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_experts_without_adapters_as_grouped_gemms_in_graphs(arch):
    """A base MoE model (no adapters) patched: its experts take the grouped forward ("auto" on
    CUDA), its decode steps replay graphs, and greedy fp32 tokens equal transformers' own experts
    (the same model patched with ``grouped_experts=False``)."""
    torch.manual_seed(0)
    base = ARCHS[arch]().to(DEVICE, torch.float32).eval()
    base.generation_config.eos_token_id = None
    x = torch.randint(1, VOCAB, (6, 9), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(5))
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, pad_token_id=0)
    fastlora.patch(base, grouped_experts=False)
    with torch.no_grad():
        expected = base.generate(**kw)
    fastlora.unpatch(base)
    report = fastlora.patch(base)
    try:
        assert report.grouped_experts == 2, report
        with torch.no_grad():
            out = base.generate(**kw)
        stats = fastlora.get_state(base).graph_runner.stats
    finally:
        fastlora.unpatch(base)
    assert torch.equal(out, expected)
    assert stats["replays"] >= 20 and stats["eager_steps"] == 0, stats
