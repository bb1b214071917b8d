"""QLoRA on the GPU: bitsandbytes bases (nf4 and int8) under PEFT's LoRA, generate through
fastlora's CUDA graphs against PEFT's mixed batch on an identical quantized model.

The 4-bit compute dtype is float32, so that greedy tokens can be compared exactly: the base matmul
is bitsandbytes' own on both sides, only the LoRA deltas differ in how they are computed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("bitsandbytes")

import peft_fastlora as fastlora  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from _graphs import generate_inputs  # noqa: E402
from _models import tiny_llama  # noqa: E402

pytestmark = pytest.mark.gpu

QUANT = {"nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
         "int8": dict(load_in_8bit=True),  # transformers' default outlier threshold, 6.0
         "int8_no_outliers": dict(load_in_8bit=True, llm_int8_threshold=0.0)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "llama")
    base = tiny_llama(0, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=8)
    base.generation_config.eos_token_id = None
    base.save_pretrained(folder)
    return folder


MIXED_ADAPTERS = ((8, TARGETS, False), (16, ["q_proj", "v_proj"], False), (4, TARGETS, True),
                  (32, ["o_proj", "down_proj"], False))


def quantized(saved, quant, dtype=torch.float32, adapters=MIXED_ADAPTERS):
    """The saved tiny Llama loaded by bitsandbytes on the GPU, with seeded adapters ``a0``, ``a1``,
    ... of these (rank, targets, lora_bias) (by default four, one with a bias on B)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(saved, device_map="cuda", dtype=dtype,
                                                    quantization_config=BitsAndBytesConfig(**QUANT[quant]))
        model = None
        for i, (r, targets, bias) in enumerate(adapters):
            torch.manual_seed(40 + i)
            cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, lora_bias=bias)
            model = get_peft_model(base, cfg, adapter_name=f"a{i}") if model is None else model
            if i:
                model.add_adapter(f"a{i}", cfg)
    with torch.no_grad():  # small B: random adapters nudge the random model instead of swamping it
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    return model.eval()


@pytest.mark.parametrize("quant", list(QUANT))
def test_quantized_base_in_graphs_equal_peft(saved, quant):
    """Greedy tokens over 24 steps equal PEFT's mixed batch; every LoRA site on fastlora's path.
    The 4-bit base's decode steps are replayed from CUDA graphs, and an 8-bit base's without an
    outlier threshold; with one (the default), its outlier search reads the activations back and
    cannot be captured: decided at patch time, decoded eagerly."""
    m, ref = quantized(saved, quant), quantized(saved, quant)
    names = ["a0", "__base__", "a1", "a2", "a3", "a2", "a0", "__base__"]
    inputs = generate_inputs(len(names))
    expected = ref.generate(**inputs, adapter_names=names, max_new_tokens=24)
    report = fastlora.patch(m)
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    out = m.generate(**inputs, adapter_names=names, max_new_tokens=24)
    assert torch.equal(out, expected)
    if quant != "int8":
        stats = fastlora.get_state(m).graph_runner.stats
        assert stats["replays"] >= 20 and stats["eager_steps"] == 0, stats
    else:
        assert report.cuda_graphs.startswith("off (") and "outlier threshold" in report.cuda_graphs, report.cuda_graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_deltas_beside_the_matmul_in_graphs(saved, dtype, monkeypatch):
    """An 8-bit base without an outlier threshold: each site's decode delta computed on a side
    stream beside the int8 GEMM (``lora.beside``, started while the graphs are captured: parallel
    branches of each graph, counted) and added by the dequantization's launch, replayed from CUDA
    graphs for two different mixes of adapters. fp32: greedy tokens equal PEFT's mixed batch.
    bf16: one forward's logits against PEFT's within bf16's tolerance."""
    from peft_fastlora.lora.beside import LoraBeside

    quant = "int8_no_outliers"
    m, ref = (quantized(saved, quant, dtype, adapters=[(4, TARGETS, False)] * 3 + [(16, TARGETS[:4], True)])
              for _ in range(2))
    report = fastlora.patch(m)
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    calls = []
    real = LoraBeside.start
    monkeypatch.setattr(LoraBeside, "start", lambda self: calls.append(1) or real(self))
    for names in (["a0", "__base__", "a1", "a2", "a3", "a2", "a0", "__base__"],
                  ["a3", "a3", "__base__", "a1", "a0", "a1", "a2", "a3"]):
        inputs = generate_inputs(len(names))
        if dtype == torch.float32:
            expected = ref.generate(**inputs, adapter_names=names, max_new_tokens=24)
            assert torch.equal(m.generate(**inputs, adapter_names=names, max_new_tokens=24), expected)
        else:
            fwd = {k: inputs[k] for k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                ours = m(**fwd, adapter_names=names).logits
                theirs = ref(**fwd, adapter_names=names).logits
            torch.testing.assert_close(ours, theirs, atol=5e-2, rtol=5e-2)
    if dtype == torch.float32:
        stats = fastlora.get_state(m).graph_runner.stats
        assert stats["replays"] >= 40 and stats["eager_steps"] == 0, stats
    assert len(calls) >= 4 * 2, len(calls)  # (tiny Llama: 2 layers of q/k/v, o, gate/up, down)


def test_an_error_beside_the_8bit_matmul_leaves_the_streams_whole(saved, monkeypatch):
    """An int8 GEMM that raises on the GPU while the delta runs on the side stream (an injected
    failure, an eager forward): the error reaches the caller, the side stream is joined, and later
    calls, eager and through graphs, equal PEFT's mixed batch in fp32."""
    from peft_fastlora.compat.bitsandbytes import JoinedInt8

    m, ref = (quantized(saved, "int8_no_outliers", adapters=[(4, TARGETS, False)] * 3) for _ in range(2))
    fastlora.patch(m)
    names = ["a0", "__base__", "a1", "a2"]
    inputs = generate_inputs(len(names))
    fwd = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    real = JoinedInt8.int8_gemm

    def failing_gemm(self, quantized):
        raise RuntimeError("injected: int8 GEMM failed")

    monkeypatch.setattr(JoinedInt8, "int8_gemm", failing_gemm)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        m(**fwd, adapter_names=names)
    monkeypatch.setattr(JoinedInt8, "int8_gemm", real)
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.testing.assert_close(m(**fwd, adapter_names=names).logits, ref(**fwd, adapter_names=names).logits,
                                   atol=1e-4, rtol=1e-4)
    expected = ref.generate(**inputs, adapter_names=names, max_new_tokens=12)
    assert torch.equal(m.generate(**inputs, adapter_names=names, max_new_tokens=12), expected)


def test_dora_over_an_nf4_base_in_graphs_equal_peft_row_by_row(saved):
    """QDoRA: a DoRA adapter over the nf4 base beside plain ones and base rows, through fastlora's
    graphs; PEFT refuses DoRA in a mixed batch, so each row is compared with PEFT's greedy tokens
    for that row alone with its adapter active."""
    models = []
    for _ in range(2):
        model = quantized(saved, "nf4")
        torch.manual_seed(50)
        model.add_adapter("dora", LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False,
                                             use_dora=True))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".dora." in n and "lora_B" in n:
                    p.mul_(0.05)
                if "lora_magnitude_vector.dora" in n:
                    p.mul_(torch.linspace(0.8, 1.2, p.numel(), device=p.device).view_as(p))
        models.append(model.eval())
    m, ref = models
    names = ["dora", "a0", "__base__", "dora", "a2", "dora"]
    inputs = generate_inputs(len(names))
    report = fastlora.patch(m)
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    out = m.generate(**inputs, adapter_names=names, max_new_tokens=16)
    for i, name in enumerate(names):
        row = {k: v[i:i + 1] if torch.is_tensor(v) else v for k, v in inputs.items()}
        if name == "__base__":
            with ref.disable_adapter():
                expected = ref.generate(**row, max_new_tokens=16)
        else:
            ref.set_adapter(name)
            expected = ref.generate(**row, max_new_tokens=16)
        assert torch.equal(out[i:i + 1, -16:], expected[:, -16:]), name
    assert fastlora.get_state(m).graph_runner.stats["replays"] > 0
