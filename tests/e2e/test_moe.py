"""LoRA on mixture-of-experts models: adapters on the routed experts' 3-D parameters (PEFT's
``target_parameters``) beside attention adapters, in mixed batches, for Mixtral, Qwen3-MoE and
Qwen2-MoE. PEFT refuses such adapters in ``adapter_names``, so the oracle is PEFT row by row with
that row's adapter active (or none for ``"__base__"``), fp32 on the CPU, on an identical model."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from peft import LoraConfig
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

import peft_fastlora as fastlora
from _moe import EXPERTS, peft_row_by_row, with_expert_adapters

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2)


def _mixtral():
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=40, num_local_experts=5))


def _qwen3():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, head_dim=8,
                                              num_experts=6, decoder_sparse_step=1, norm_topk_prob=True))


def _qwen2():
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=16, num_experts=6,
                                              decoder_sparse_step=1))


ARCHS = {"mixtral": _mixtral, "qwen3_moe": _qwen3, "qwen2_moe": _qwen2}
# (name, target_modules, target_parameters, rank): adapters on attention and experts, one on
# attention only (the experts give it nothing), one on experts only
ADAPTERS = (("both", ["q_proj", "v_proj"], EXPERTS, 4), ("attn", ["q_proj", "o_proj"], None, 8),
            ("routed", [], EXPERTS, 8))


def build(arch: str, adapters=ADAPTERS):
    torch.manual_seed(0)
    base = ARCHS[arch]().eval()
    base.generation_config.eos_token_id = None
    return with_expert_adapters(base, adapters, b_scale=4.0)  # each adapter moves the logits visibly


def ids(rows: int, length: int = 7, seed: int = 1):
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_mixed_logits_equal_peft_row_by_row(arch):
    m, ref = build(arch), build(arch)
    report = fastlora.patch(m)
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    assert report.counts().get("experts") == 2, report.counts()
    names = ["both", "__base__", "routed", "attn", "both", "routed"]
    x = ids(len(names))
    with torch.no_grad():
        got = m(input_ids=x, adapter_names=names).logits
    torch.testing.assert_close(got, peft_row_by_row(ref, x, names), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the expert adapters matter
        ref.set_adapter("routed")
        with_experts = ref(input_ids=x[:1]).logits
        with ref.disable_adapter():
            assert not torch.allclose(with_experts, ref(input_ids=x[:1]).logits, atol=1e-3)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_adapters_naming_the_mlp_projections_only(arch):
    """Adapters that name gate_proj / up_proj / down_proj in ``target_modules`` and no
    ``target_parameters``: PEFT 0.22 puts them on the fused experts too (earlier PEFT on the shared
    expert only, or nowhere in Qwen3-MoE's MLP); whatever PEFT built is served as PEFT serves it."""
    mlp = ["gate_proj", "up_proj", "down_proj"]
    adapters = (("a", mlp + ["q_proj"], None, 4), ("b", mlp + ["k_proj"], None, 8))
    m, ref = build(arch, adapters), build(arch, adapters)
    report = fastlora.patch(m)
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    names = ["a", "b", "__base__", "b"]
    x = ids(len(names), seed=5)
    with torch.no_grad():
        got = m(input_ids=x, adapter_names=names).logits
    torch.testing.assert_close(got, peft_row_by_row(ref, x, names), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_generate_equal_peft_row_by_row(backend):
    """Greedy tokens of a mixed batch through ``generate`` (the Triton backend under the
    interpreter: the grouped kernel and its device-side plan), equal to PEFT row by row."""
    m, ref = build("qwen3_moe"), build("qwen3_moe")
    fastlora.patch(m, backend=backend)
    names = ["routed", "both", "__base__", "attn"]
    x = ids(len(names), length=5, seed=3)
    with torch.no_grad():
        got = m.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=names, max_new_tokens=6,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(got, peft_row_by_row(ref, x, names, new_tokens=6))


def test_emulated_graphs_and_fewer_slots_than_adapters():
    """Two slots for three adapters (the experts' stacks follow the slots as adapters move) and the
    decode graph runner emulated on the CPU."""
    m, ref = build("mixtral"), build("mixtral")
    fastlora.patch(m, cuda_graphs="emulate", max_loras_per_batch=2, backend="triton")
    x = ids(4, length=5, seed=4)
    for names in (["both", "__base__", "routed", "both"], ["attn", "routed", "attn", "__base__"],
                  ["both", "both", "attn", "attn"]):
        with torch.no_grad():
            got = m.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=names, max_new_tokens=5,
                             do_sample=False, pad_token_id=0)
        assert torch.equal(got, peft_row_by_row(ref, x, names, new_tokens=5)), names
    assert fastlora.get_state(m).graph_runner.stats["replays"] > 0


def test_values_changed_between_calls_are_served():
    """An expert adapter's factors edited in place after a call: the next call uses the new values."""
    m, ref = build("mixtral"), build("mixtral")
    fastlora.patch(m)
    names = ["routed", "both"]
    x = ids(2, seed=5)
    with torch.no_grad():
        m(input_ids=x, adapter_names=names)
        for model in (m, ref):
            for n, p in model.named_parameters():
                if "experts" in n and "lora_B.routed" in n:
                    p.mul_(-2.0)
        got = m(input_ids=x, adapter_names=names).logits
    torch.testing.assert_close(got, peft_row_by_row(ref, x, names), atol=1e-5, rtol=1e-5)


def test_unsupported_expert_layout_stays_on_peft_with_its_reason():
    m = build("mixtral")
    for module in m.modules():
        if type(module).__name__ == "MixtralExperts":
            module.has_bias = True  # a layout fastlora does not serve (as gpt-oss' experts)
    report = fastlora.patch(m)
    reasons = {why for _, why in report.left_on_peft}
    assert reasons == {"MixtralExperts with has_bias=True"}, report.left_on_peft
    with torch.no_grad(), pytest.raises(ValueError, match="mixed adapter batches"):
        m(input_ids=ids(2), adapter_names=["both", "attn"])  # PEFT's own refusal, not a wrong answer


def test_unpatch_restores_the_experts_forward():
    m = build("qwen2_moe")
    outer = m.base_model.model.model.layers[0].mlp.experts
    before = outer.__dict__.get("forward")
    fastlora.patch(m)
    assert outer.__dict__.get("forward") is not None
    fastlora.unpatch(m)
    assert outer.__dict__.get("forward") is before
    x = ids(1)
    with torch.no_grad(), pytest.raises(ValueError, match="mixed adapter batches"):
        m(input_ids=x, adapter_names=["both"])  # PEFT's path again


def test_continuous_batching_per_request():
    """transformers' engine: each request with its own adapter, the experts' deltas by token,
    equal to PEFT alone on each prompt."""
    from _continuous import cb_config, greedy_config, requires_cb

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    m, ref = build("qwen3_moe"), build("qwen3_moe")
    report = fastlora.patch(m)
    assert report.continuous_batching == "on", report
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 2, 7)]
    names = ["routed", "both", "__base__", "attn"]
    out = m.generate_batch(prompts, generation_config=greedy_config(5),
                           continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=names)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        alone = peft_row_by_row(ref, torch.tensor([prompt]), [name], new_tokens=5)
        assert out[f"req_{i}"].generated_tokens == alone[0, len(prompt):].tolist(), (i, name)


def _saved(tmp_path, name: str, adapter, seed: int) -> str:
    """``adapter`` trained (random B) on its own model and saved under ``tmp_path/name``."""
    donor = build("mixtral", (adapter,))
    with torch.no_grad():
        for n, p in donor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed + len(n)))
    donor.save_pretrained(str(tmp_path / "saved"), selected_adapters=[adapter[0]])
    return str(tmp_path / "saved" / adapter[0]) if adapter[0] != "default" else str(tmp_path / "saved")


def test_expert_adapters_registered_by_name(tmp_path):
    """Saved adapters on attention and experts registered by name (one with a larger rank than the
    PEFT adapters: the expert stacks grow for it), beside PEFT's own, with three slots for five
    adapters; equal to the same folders loaded into PEFT, row by row."""
    m, ref = build("mixtral"), build("mixtral")
    folders = {"extra": _saved(tmp_path / "e", "extra", ("extra", ["q_proj", "o_proj"], EXPERTS, 16), 3),
               "more": _saved(tmp_path / "m", "more", ("more", ["v_proj"], EXPERTS, 2), 4)}
    fastlora.patch(m, max_loras_per_batch=3)
    fastlora.register_adapters(m, folders)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, folder in folders.items():
            ref.load_adapter(folder, adapter_name=name)
    ref.eval()
    x = ids(4, seed=6)
    for names in (["extra", "__base__", "more", "extra"], ["routed", "more", "both", "more"],
                  ["extra", "extra", "attn", "__base__"]):
        with torch.no_grad():
            got = m(input_ids=x, adapter_names=names).logits
        torch.testing.assert_close(got, peft_row_by_row(ref, x, names), atol=1e-5, rtol=1e-5, msg=str(names))


def test_from_folders_with_expert_adapters(tmp_path):
    """A base MoE model and a folder of saved expert adapters: the scaffold adapter targets the
    experts' parameters too, and generate equals PEFT with the folders loaded."""
    root = tmp_path / "adapters"
    for name, adapter, seed in (("one", ("one", ["q_proj"], EXPERTS, 4), 5), ("two", ("two", [], EXPERTS, 8), 6)):
        folder = _saved(tmp_path / name, name, adapter, seed)
        root.mkdir(exist_ok=True)
        os.rename(folder, root / name)
    torch.manual_seed(0)
    base = ARCHS["mixtral"]().eval()
    base.generation_config.eos_token_id = None
    m = fastlora.from_folders(base, str(root))
    torch.manual_seed(0)
    ref_base = ARCHS["mixtral"]().eval()
    ref_base.generation_config.eos_token_id = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from peft import PeftModel
        ref = PeftModel.from_pretrained(ref_base, str(root / "one"), adapter_name="one")
        ref.load_adapter(str(root / "two"), adapter_name="two")
    ref.eval()
    names = ["two", "one", "__base__", "two"]
    x = ids(4, length=5, seed=7)
    with torch.no_grad():
        got = m.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=names, max_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(got, peft_row_by_row(ref, x, names, new_tokens=4))


def test_a_model_cast_after_patch_is_served_in_its_new_dtype():
    """``model.to(torch.bfloat16)`` after ``patch``: the experts' stacks follow the weights, and the
    mixed batch is no further from the float32 answer than PEFT's own bf16 rows are."""
    m, ref = build("qwen3_moe"), build("qwen3_moe")
    fastlora.patch(m)
    names = ["routed", "both", "__base__", "attn"]
    x = ids(4, seed=8)
    exact = peft_row_by_row(ref, x, names)
    with torch.no_grad():
        m(input_ids=x, adapter_names=names)
        m.to(torch.bfloat16)
        ref.to(torch.bfloat16)
        got = m(input_ids=x, adapter_names=names).logits.float()
    assert fastlora.get_state(m).expert_sites[0].stacks["gate_up_proj"].a.dtype == torch.bfloat16
    peft_bf16 = peft_row_by_row(ref, x, names)

    def rel(t):
        return ((t - exact).norm() / exact.norm()).item()

    assert rel(got) <= 1.5 * rel(peft_bf16) + 1e-3, (rel(got), rel(peft_bf16))


def test_random_calls_and_bad_inputs():
    """Random calls as a server makes them (batch sizes, prompt lengths, adapter mixes, lengths to
    generate; two slots for three adapters, emulated graphs, the grouped kernel), each row equal
    to PEFT alone; bad adapter names are refused with PEFT's message, and the next call is served."""
    m, ref = build("qwen3_moe"), build("qwen3_moe")
    fastlora.patch(m, cuda_graphs="emulate", max_loras_per_batch=2, backend="triton")
    rng = torch.Generator().manual_seed(11)
    adapters = ["both", "attn", "routed", "__base__"]
    for call in range(5):
        rows = int(torch.randint(1, 6, (1,), generator=rng))
        chosen = [adapters[int(i)] for i in torch.randperm(4, generator=rng)[:2]]
        names = [chosen[int(i)] for i in torch.randint(0, 2, (rows,), generator=rng)]
        length, new = int(torch.randint(2, 9, (1,), generator=rng)), int(torch.randint(1, 5, (1,), generator=rng))
        x = ids(rows, length=length, seed=100 + call)
        with torch.no_grad():
            got = m.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=names, max_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        assert torch.equal(got, peft_row_by_row(ref, x, names, new_tokens=new)), (call, names)
        if call == 2:
            with torch.no_grad(), pytest.raises(ValueError, match="non-existing adapter"):
                m(input_ids=x, adapter_names=["nope"] * rows)
            with torch.no_grad(), pytest.raises(ValueError, match="Length of `adapter_names`"):
                m(input_ids=x, adapter_names=names + ["both"])  # one name too many


# the same MLP modules in both: PEFT 0.22 maps gate_proj / up_proj onto the experts' fused parameters and
# refuses adapters whose expert parameters differ
SHARED = (("a", ["q_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"], EXPERTS, 4),
          ("b", ["gate_proj", "up_proj", "down_proj", "k_proj"], EXPERTS, 8))


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_qwen2_moe_shared_expert_adapters(backend):
    """Qwen2-MoE hands its shared expert the forward's tokens flattened, (rows x tokens, hidden):
    its LoRA layers serve each token with its row's adapter (PEFT's mixed batch refuses the
    shape), in plain forwards, graphed generate and continuous batching."""
    from _continuous import cb_config, greedy_config, requires_cb

    m, ref = build("qwen2_moe", SHARED), build("qwen2_moe", SHARED)
    report = fastlora.patch(m, backend=backend, cuda_graphs="emulate")
    assert report.left_on_peft == [] and report.counts()["gate_up"] == 2, report
    names = ["a", "b", "__base__", "a"]
    x = ids(4, seed=9)
    with torch.no_grad():
        got = m(input_ids=x, adapter_names=names).logits
        tokens = m.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=names, max_new_tokens=4,
                            do_sample=False, pad_token_id=0)
    torch.testing.assert_close(got, peft_row_by_row(ref, x, names), atol=1e-5, rtol=1e-5)
    assert torch.equal(tokens, peft_row_by_row(ref, x, names, new_tokens=4))
    if requires_cb.args[0]:
        return
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 2)]
    out = m.generate_batch(prompts, generation_config=greedy_config(3),
                           continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=["b", "a", "__base__"])
    for i, (prompt, name) in enumerate(zip(prompts, ["b", "a", "__base__"])):
        alone = peft_row_by_row(ref, torch.tensor([prompt]), [name], new_tokens=3)
        assert out[f"req_{i}"].generated_tokens == alone[0, len(prompt):].tolist(), (i, name)


def test_a_registered_expert_adapter_of_the_wrong_shape_is_refused(tmp_path):
    """A saved expert adapter whose A does not split into the layer's experts is refused, naming
    the module and the shapes the layer takes; nothing is registered."""
    from safetensors.torch import load_file, save_file

    m = build("mixtral")
    fastlora.patch(m)
    folder = _saved(tmp_path, "bad", ("bad", ["q_proj"], EXPERTS, 4), 1)
    weights = load_file(os.path.join(folder, "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("mlp.experts.lora_A.weight"))
    weights[key] = weights[key][:-1]  # one row short of experts x rank
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"mlp\.experts' has A .*its base layer takes A \(5 x r, \d+\)"):
        fastlora.register_adapter(m, "bad", folder)
    assert "bad" not in fastlora.get_state(m).stored


# ---- experts that no adapter targets: grouped GEMMs instead of transformers' eager loop --------------
ATTENTION_ONLY = (("attn", ["q_proj", "o_proj"], None, 8), ("attn2", ["v_proj"], None, 4))


def _experts_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_experts_without_adapters_run_as_grouped_gemms(arch):
    """Attention-only adapters on an MoE model: its experts, which PEFT leaves alone, take the
    grouped forward (the Triton kernel under the interpreter). PEFT's own mixed batch is the oracle
    (it serves attention-only adapters in ``adapter_names``); greedy tokens through emulated decode
    graphs equal; unpatch gives the experts their class's forward back."""
    m, ref = build(arch, ATTENTION_ONLY), build(arch, ATTENTION_ONLY)
    report = fastlora.patch(m, grouped_experts=True, cuda_graphs="emulate")
    assert report.grouped_experts == 2 and "routed experts as grouped GEMMs x2" in str(report), report
    calls = []
    for e in _experts_modules(m):
        inner = e.forward
        e.__dict__["forward"] = lambda *a, inner=inner, **k: (calls.append(1), inner(*a, **k))[1]
    names = ["attn", "__base__", "attn2", "attn"]
    x = ids(len(names))
    with torch.no_grad():
        got, want = m(input_ids=x, adapter_names=names).logits, ref(input_ids=x, adapter_names=names).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    kw = dict(attention_mask=torch.ones_like(x), adapter_names=names, max_new_tokens=5, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(m.generate(input_ids=x, **kw), ref.generate(input_ids=x, **kw))
    assert calls and fastlora.get_state(m).graph_runner.stats["replays"] > 0
    for e in _experts_modules(m):
        del e.__dict__["forward"]  # (the counting wrapper above)
    fastlora.unpatch(m)
    assert not any("forward" in e.__dict__ for e in _experts_modules(m))


def test_grouped_experts_where_they_apply():
    """Off the GPU "auto" keeps transformers' experts; LoRA'd experts stay with their expert sites;
    an experts implementation the model chose stays, with the reason in the report."""
    m = build("mixtral", ATTENTION_ONLY)
    report = fastlora.patch(m)
    assert report.grouped_experts == 0 and report.base_ops_off["grouped_experts"] == "the model is not on CUDA"
    fastlora.unpatch(m)
    mixed = build("mixtral")  # every experts module under expert adapters
    report = fastlora.patch(mixed, grouped_experts=True)
    assert report.grouped_experts == 0 and report.counts().get("experts") == 2, report
    chosen = build("qwen3_moe", ATTENTION_ONLY)
    chosen.config._experts_implementation = "batched_mm"
    report = fastlora.patch(chosen, grouped_experts=True)
    assert report.grouped_experts == 0
    assert "experts_implementation='batched_mm' (the model's choice)" in str(report), report
    with pytest.raises(ValueError, match="grouped_experts must be True, False or 'auto'"):
        fastlora.patch(build("mixtral", ATTENTION_ONLY), grouped_experts="yes")


def test_an_expert_adapter_added_after_grouped_experts():
    """Experts given the grouped forward at patch time, then an adapter on them added: its expert
    sites serve it over that forward, equal to PEFT row by row; unpatch leaves no forward behind."""
    m, ref = build("mixtral", ATTENTION_ONLY), build("mixtral", ATTENTION_ONLY)
    assert fastlora.patch(m, grouped_experts=True).grouped_experts == 2
    for model in (m, ref):
        torch.manual_seed(7)
        model.add_adapter("late", LoraConfig(r=4, target_parameters=EXPERTS, init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n and ".late" in n:
                    p.mul_(4.0)
    names = ["late", "attn", "__base__", "late"]
    x = ids(len(names))
    with torch.no_grad():
        got = m(input_ids=x, adapter_names=names).logits
    torch.testing.assert_close(got, peft_row_by_row(ref, x, names), atol=1e-5, rtol=1e-5)
    assert len(fastlora.get_state(m).expert_sites) == 2
    fastlora.unpatch(m)
    assert not any("forward" in e.__dict__ for e in _experts_modules(m))
