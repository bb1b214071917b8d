"""Rotary cos / sin from a table on the GPU: the gather kernel, the table against the module's own
forward (transformers' per-step math on CUDA), and greedy generate through captured graphs that
read it against PEFT's tokens, over calls whose caches (and so tables) grow."""

import importlib
import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora
from peft_fastlora.base_ops.rotary_tables import build_table
from peft_fastlora.ops import rotary_table as table_ops

from _helpers import count_calls
from _models import tiny_llama

pytestmark = pytest.mark.gpu
ROPES = {
    "default": dict(rope_type="default", rope_theta=500000.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256, rope_theta=500000.0),
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=512, rope_theta=10000.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 80, 128, 256])
def test_gather_kernel_equals_indexing(dtype, dim):
    length = 4099
    table = torch.randn(2, length, dim, device="cuda").to(dtype)
    for shape in ((1, 1), (128, 1), (3, 77)):
        pos = torch.randint(0, length, shape, device="cuda")
        cos, sin = table_ops.gather_cos_sin(table, pos)
        assert torch.equal(cos, table[0][pos]) and torch.equal(sin, table[1][pos])


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_equals_the_module_on_cuda(rope, dtype):
    module = tiny_llama(rope_parameters=ROPES[rope], max_position_embeddings=8192, hidden_size=512,
                        num_attention_heads=4).model.rotary_emb.cuda()
    forward = type(module).forward
    table = build_table(module, forward, 8192, dtype, torch.device("cuda"))
    x = torch.empty(0, dtype=dtype, device="cuda")
    for shape in ((1, 1), (128, 1), (5, 300), (1, 8192)):
        pos = torch.randint(0, 8192, shape, device="cuda")
        want = forward(module, x, pos)
        got = table_ops.gather_cos_sin(table, pos)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), (rope, shape)


def _model(rope):
    base = tiny_llama(0, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                      rope_parameters=ROPES[rope], max_position_embeddings=4096).to("cuda").eval()
    base.generation_config.eos_token_id = None
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False),
                           adapter_name="a0")
    model.add_adapter("a1", LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                       init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    return model.eval()


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_graphs_reading_the_table_equal_peft_over_growing_calls(rope, monkeypatch):
    model = _model(rope)
    calls = []  # (rows, prompt, new tokens): the later ones need longer caches (a new table)
    for rows, prompt, new in ((3, 9, 20), (6, 40, 300), (2, 700, 40), (5, 12, 24)):
        ids = torch.randint(1, 512, (rows, prompt), device="cuda")
        mask = torch.ones_like(ids)
        ids[1::2, :4], mask[1::2, :4] = 0, 0
        names = [["a0", "a1", "__base__"][i % 3] for i in range(rows)]
        calls.append((dict(input_ids=ids, attention_mask=mask, pad_token_id=0, do_sample=False,
                           max_new_tokens=new), names))
    with torch.no_grad():
        refs = [model.generate(**kw, adapter_names=names) for kw, names in calls]
        report = fastlora.patch(model)
        gathers = count_calls(monkeypatch,
                importlib.import_module("peft_fastlora.base_ops.rotary_tables"), ["gather_cos_sin"])
        got = [model.generate(**kw, adapter_names=names) for kw, names in calls]
        stats = fastlora.get_state(model).graph_runner.stats
        fastlora.unpatch(model)
    assert "cos/sin from a table in graphs x1" in str(report), report
    assert gathers["gather_cos_sin"] >= 2 * len(calls)  # a check and the capture per table, at least
    assert stats["captures"] >= 1 and stats["eager_steps"] == 0 and stats["rotary_table_off"] == {}, stats
    for (kw, _), ref, tokens in zip(calls, refs, got):
        assert torch.equal(tokens, ref), kw["input_ids"].shape
