"""LoRA over bitsandbytes bases (QLoRA): 4-bit (nf4, fp4, with and without double quantization)
and 8-bit ``Linear`` layers under PEFT's LoRA. The base matmul stays bitsandbytes' own; the LoRA
deltas take fastlora's path. The oracle: PEFT's mixed batch on an identical quantized model, fp32
on the CPU (bitsandbytes runs there).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("bitsandbytes")

import peft_fastlora as fastlora  # noqa: E402
from peft_fastlora.lora.beside import LoraBeside  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from _patch_models import IDS, VOCAB, logits, lora, tiny_llama, with_lora  # noqa: E402

QUANT = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "nf4_double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}
KIND = {"nf4": "nf4", "nf4_double": "nf4", "fp4": "fp4", "int8": "int8"}
INT8_NO_OUTLIERS = dict(load_in_8bit=True, llm_int8_threshold=0.0)
ADAPTERS = (("sql", ("q_proj", "v_proj", "down_proj"), 4, {}), ("chat", ("q_proj", "o_proj", "gate_proj"), 8, {}),
            ("biased", ("v_proj", "up_proj"), 2, {"lora_bias": True}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "llama")
    tiny_llama().save_pretrained(folder)
    return folder


def quantized(saved, quant, adapters=ADAPTERS):
    """A PEFT model over the saved tiny Llama loaded by bitsandbytes with ``quant`` (a name of
    ``QUANT`` or ``BitsAndBytesConfig`` fields)."""
    fields = QUANT[quant] if isinstance(quant, str) else quant
    extra = {"bnb_4bit_compute_dtype": torch.float32} if "load_in_4bit" in fields else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(saved, device_map="cpu",
                                                    quantization_config=BitsAndBytesConfig(**fields, **extra))
    for module in base.modules():
        # on CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place at its first forward
        # for a CPU kernel that computes in bf16 (whatever the compute dtype) and fails on layers under
        # 64 inputs. The fp32 oracle needs the portable path: both models here keep it
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return with_adapters(base, adapters, seed=200)


def with_adapters(base, adapters, seed: int):
    """``base`` wrapped by PEFT with these (name, targets, rank, LoraConfig extras), each seeded;
    ``base`` itself when there are none."""
    return with_lora(base, [(name, lora(targets, r, 2 * r, **kw)) for name, targets, r, kw in adapters],
                     seed).eval()


@pytest.mark.parametrize("quant", list(QUANT))
def test_quantized_layers_on_fastlora_path_equal_peft(saved, quant):
    m, ref = quantized(saved, quant), quantized(saved, quant)
    report = fastlora.patch(m)
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    # gate and up both carry LoRA: one site over their own matmuls; q and v (k has none) one each
    kind = KIND[quant]
    assert report.counts() == {f"linear_{kind}": 8, f"gate_up_{kind}": 2}, report.counts()
    assert f"12 LoRA layers in 10 sites (2 gate_up_{kind}, 8 linear_{kind})" in str(report), report
    for names in (["sql", "chat", "__base__", "biased"], ["biased", "biased", "sql", "__base__"]):
        torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(ref, ["sql"] * 4), logits(ref, ["__base__"] * 4))  # the deltas matter


ALL_SIBLINGS = (("sql", ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 4, {}),
                ("chat", ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"), 8, {"lora_bias": True}),
                ("wide", ("k_proj", "up_proj"), 16, {}))


@pytest.mark.parametrize("quant", ["nf4", "int8", "torchao"])
def test_quantized_siblings_share_one_lora_call(saved, quant, monkeypatch):
    """q/k/v and gate/up whose members all carry LoRA over one kind of quantized base: each member
    keeps its own matmul, their LoRA is one stacked call (one shrink and one expand for the group,
    not one per member), and the logits and greedy tokens equal PEFT's mixed batch."""
    from peft_fastlora.backend.base import BaseLoRABackend

    # (PEFT's torchao layers take no lora_bias)
    adapters = tuple((n, t, r, {}) for n, t, r, _ in ALL_SIBLINGS) if quant == "torchao" else ALL_SIBLINGS
    build = (lambda: _torchao(adapters)) if quant == "torchao" else (lambda: quantized(saved, quant, adapters))
    m, ref = build(), build()
    report = fastlora.patch(m, cuda_graphs="emulate")
    assert report.counts() == {f"qkv_{quant}": 2, f"gate_up_{quant}": 2, f"linear_{quant}": 4}, report.counts()
    assert report.left_on_peft == [] and report.adapter_fallbacks == [], report
    backend = fastlora.get_state(m).backend
    calls = []
    real = type(backend).run_packed_lora
    monkeypatch.setattr(type(backend), "run_packed_lora", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert isinstance(backend, BaseLoRABackend)
    for names in (["sql", "chat", "__base__", "wide"], ["wide", "wide", "chat", "__base__"]):
        calls.clear()
        torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)
        assert len(calls) == 2 * 4, len(calls)  # per layer: q/k/v, o, gate/up, down
    kw = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=6, do_sample=False, pad_token_id=0)
    names = ["chat", "__base__", "sql", "wide"]
    assert torch.equal(m.generate(**kw, adapter_names=names), ref.generate(**kw, adapter_names=names))
    fastlora.unpatch(m)
    torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 6.0])
def test_8bit_siblings_share_one_bitsandbytes_matmul(saved, threshold, monkeypatch):
    """bitsandbytes' 8-bit weights are quantized row by row, so q/k/v (gate/up) with LoRA share one
    8-bit matmul over their rows joined: 4 matmuls a layer instead of 7, the members' int8 rows views
    of the joined ones (no second copy), the logits PEFT's mixed batch's, with outlier columns
    (threshold 0.5 finds some in this model) and without. ``unpatch`` gives each layer its own rows."""
    import bitsandbytes as bnb

    quant = dict(load_in_8bit=True, llm_int8_threshold=threshold)
    m, ref = quantized(saved, quant, ALL_SIBLINGS), quantized(saved, quant, ALL_SIBLINGS)
    report = fastlora.patch(m)
    assert report.counts() == {"qkv_int8": 2, "gate_up_int8": 2, "linear_int8": 4}, report.counts()
    assert report.quantized_joined == [(f"base_model.model.model.layers.{i}.{p}", None) for i in (0, 1)
                                       for p in ("self_attn.qkv", "mlp.gate_up")], report.quantized_joined
    assert "quantized siblings in one matmul: 4 of 4 groups" in str(report), report
    attn = m.get_base_model().model.layers[0].self_attn
    joined = fastlora.get_state(m).groups[0].joined
    assert joined is not None and joined.intact()
    for layer, (lo, hi) in zip((attn.q_proj, attn.k_proj, attn.v_proj), zip(joined.offsets, joined.offsets[1:])):
        rows = layer.base_layer.state.CB
        assert rows.data_ptr() == joined.rows[lo:hi].data_ptr() and layer.base_layer.weight.data_ptr() == rows.data_ptr()
    # every 8-bit matmul quantizes its input once, bitsandbytes' own or split into its steps
    outliers = []
    found = bnb.functional.int8_vectorwise_quant
    monkeypatch.setattr(bnb.functional, "int8_vectorwise_quant",
                        lambda *a, **k: (lambda r: outliers.append(r[2] is not None and r[2].numel() > 0) or r)(found(*a, **k)))
    for names in (["sql", "chat", "__base__", "wide"], ["wide", "wide", "chat", "__base__"]):
        outliers.clear()
        out = logits(m, names)
        assert len(outliers) == 2 * 4, len(outliers)  # per layer: q/k/v, o, gate/up, down
        torch.testing.assert_close(out, logits(ref, names), atol=1e-5, rtol=1e-5)
        assert len(outliers) == 2 * 4 + 2 * 7, len(outliers)  # PEFT's: one per layer
        assert any(outliers) == (threshold == 0.5), outliers  # the outlier path ran where it should
    kw = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=6, do_sample=False, pad_token_id=0)
    names = ["chat", "__base__", "sql", "wide"]
    assert torch.equal(m.generate(**kw, adapter_names=names), ref.generate(**kw, adapter_names=names))
    if threshold == 0.0:  # an adapter added after patch: the stacks rebuilt, the rows joined again
        for model in (m, ref):
            torch.manual_seed(7)
            model.add_adapter("late", lora(("k_proj", "up_proj"), 4, 8))
        names = ["late", "sql", "__base__", "late"]
        torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)
        assert joined.rows is None  # the old join let go of its rows
        joined = fastlora.get_state(m).groups[0].joined
        assert joined is not None and joined.intact()
    fastlora.unpatch(m)
    assert joined.rows is None
    ptrs = {layer.base_layer.state.CB.data_ptr() for layer in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(ptrs) == 3 and all(layer.base_layer.weight.data_ptr() == layer.base_layer.state.CB.data_ptr()
                                  for layer in (attn.q_proj, attn.k_proj, attn.v_proj))
    torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)


def test_8bit_siblings_without_lora_share_one_matmul(saved, monkeypatch):
    """The base model's own q/k/v and gate/up over bitsandbytes' 8-bit weights (no LoRA: what
    ``fuse`` gives a base model on CUDA) share one 8-bit matmul a group, and o / down are held as
    groups of one (on a GPU fastlora dequantizes their products), with the logits the model's
    own; removed, each layer has its own rows again and its own forward."""
    import bitsandbytes as bnb

    from peft_fastlora.base_ops.fused_linears import install_fused_linears
    from peft_fastlora.instance_methods import InstancePatches

    model, ref = (quantized(saved, INT8_NO_OUTLIERS, adapters=()) for _ in range(2))
    patches = InstancePatches()
    done, skipped, groups = install_fused_linears(model, patches)
    assert len(groups) == 8 and len(done) == 14 and skipped == [], (done, skipped)
    assert sorted(g.group.kind for g in groups) == ["gate_up"] * 2 + ["linear"] * 4 + ["qkv"] * 2
    calls = []
    real = bnb.matmul
    monkeypatch.setattr(bnb, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = logits(model)
    assert len(calls) == 2 * 4, len(calls)
    torch.testing.assert_close(out, logits(ref), atol=1e-5, rtol=1e-5)
    # a layer given rows of its own (a reload): the group no longer joined, each layer its own matmul
    attn = model.model.layers[1].self_attn
    attn.k_proj.state.CB = attn.k_proj.weight.data = attn.k_proj.state.CB.clone()
    calls.clear()
    torch.testing.assert_close(logits(model), logits(ref), atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * 4 + 2 + 2 * 7, len(calls)  # that layer's q/k/v: three; PEFT-free ref: 14
    patches.restore()
    for g in groups:
        g.remove()
    attn = model.model.layers[0].self_attn
    assert len({m.state.CB.data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) == 3
    assert "forward" not in attn.q_proj.__dict__
    torch.testing.assert_close(logits(model), logits(ref), atol=1e-5, rtol=1e-5)


LOW_RANKS = (("sql", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 2, {}),
             ("chat", ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), 1, {}))


def _count_beside(monkeypatch) -> list:
    """Each LoRA delta the sites start beside an 8-bit matmul (``lora.beside``), counted."""
    calls = []
    real = LoraBeside.start
    monkeypatch.setattr(LoraBeside, "start", lambda self: calls.append(1) or real(self))
    return calls


@pytest.mark.parametrize("quant", ["int8_no_outliers", "int8", "nf4"])
def test_8bit_deltas_computed_beside_the_matmul(saved, quant, monkeypatch):
    """A decode-sized forward (at most 256 tokens) over 8-bit layers without an outlier threshold
    starts each site's LoRA delta beside the input's quantization and the int8 GEMM
    (``lora.beside``: on a GPU a parallel branch) and dequantizes the product with it: at every site
    of every call, equal to PEFT's mixed batch, rows of no adapter included, greedy ``generate``
    token for token, and after an adapter is added. A longer forward, and the bases with an outlier
    threshold or 4-bit weights, run the matmul and then the LoRA, as equal."""
    m, ref = (quantized(saved, INT8_NO_OUTLIERS if quant == "int8_no_outliers" else quant, LOW_RANKS)
              for _ in range(2))
    fastlora.patch(m)
    calls = _count_beside(monkeypatch)
    per_call = 8 if quant == "int8_no_outliers" else 0  # 2 layers x (q/k/v, o, gate/up, down)
    for names in (["sql", "chat", "__base__", "sql"], ["__base__"] * 4, ["chat"] * 4):
        torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)
    assert len(calls) == 3 * per_call, len(calls)
    names = ["chat", "__base__", "sql", "chat"]
    kw = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=5, do_sample=False,
              adapter_names=names)
    assert torch.equal(m.generate(**kw), ref.generate(**kw))
    for model in (m, ref):
        torch.manual_seed(7)
        model.add_adapter("big", lora(("q_proj", "down_proj"), 16, 16))
    calls.clear()
    names = ["big", "sql", "__base__", "chat"]
    torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)
    assert len(calls) == per_call, len(calls)
    calls.clear()
    long_ids = torch.randint(3, VOCAB, (5, 60), generator=torch.Generator().manual_seed(3))
    names = ["big", "sql", "__base__", "chat", "sql"]
    torch.testing.assert_close(logits(m, names, long_ids), logits(ref, names, long_ids), atol=1e-5, rtol=1e-5)
    assert calls == []


def test_an_error_beside_the_8bit_matmul_propagates_and_the_next_call_is_whole(saved, monkeypatch):
    """An int8 GEMM that raises while the delta is being computed beside it (an injected failure):
    the caller gets the error, the branch is joined, and the next call equals PEFT's mixed batch."""
    from peft_fastlora.compat.bitsandbytes import JoinedInt8

    m, ref = (quantized(saved, INT8_NO_OUTLIERS, LOW_RANKS) for _ in range(2))
    fastlora.patch(m)
    joins = []
    real_join, real_gemm = LoraBeside.join, JoinedInt8.int8_gemm
    monkeypatch.setattr(LoraBeside, "join", lambda self: joins.append(1) or real_join(self))

    def failing_gemm(self, quantized):
        raise RuntimeError("injected: int8 GEMM failed")

    monkeypatch.setattr(JoinedInt8, "int8_gemm", failing_gemm)
    names = ["sql", "chat", "__base__", "sql"]
    with pytest.raises(RuntimeError, match="injected"):
        logits(m, names)
    assert joins == [1]
    monkeypatch.setattr(JoinedInt8, "int8_gemm", real_gemm)
    torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_8bit_joined_siblings_under_random_adapter_traffic(saved, seed):
    """A user's random sequence over an 8-bit model: mixed calls, adapters added and deleted,
    unpatch and patch again. Every call equals PEFT's mixed batch; while patched, every group whose
    members all carry LoRA reads joined rows; unpatched, each layer owns its rows."""
    import random

    rng = random.Random(seed)
    m, ref = (quantized(saved, INT8_NO_OUTLIERS, ALL_SIBLINGS) for _ in range(2))
    fastlora.patch(m)
    patched, names, added = True, ["sql", "chat", "wide"], 0
    for step in range(10):
        op = rng.choice(["call", "call", "add", "delete", "repatch"])
        if op == "add":
            added += 1
            targets = rng.choice([("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("k_proj", "down_proj")])
            rank = rng.choice([2, 4, 8])
            for model in (m, ref):
                torch.manual_seed(1000 + added)
                model.add_adapter(f"n{added}", lora(targets, rank, 8))
            names.append(f"n{added}")
        elif op == "delete" and len(names) > 1:  # (not PEFT's active adapter, "sql": PEFT needs it)
            gone = names.pop(rng.randrange(1, len(names)))
            for model in (m, ref):
                model.delete_adapter(gone)
        elif op == "repatch":
            if patched:
                fastlora.unpatch(m)
                layers = [layer for block in m.get_base_model().model.layers
                          for layer in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj)]
                rows = [getattr(layer, "base_layer", layer).state.CB for layer in layers]
                assert len({r.untyped_storage().data_ptr() for r in rows}) == len(rows), step  # each its own
            else:
                fastlora.patch(m)
            patched = not patched
        row_names = [rng.choice(names + ["__base__"]) for _ in range(4)]
        torch.testing.assert_close(logits(m, row_names), logits(ref, row_names), atol=1e-5, rtol=1e-5,
                                   msg=lambda e: f"step {step} ({op}, {row_names}): {e}")
        if patched:
            groups = [g for g in fastlora.get_state(m).groups if g.separate]
            assert all(g.joined_intact() for g in groups), step


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_quantized_generate_with_emulated_graphs_and_slots(saved, quant):
    """Greedy tokens through the decode graph runner (emulated on the CPU) and two slots for three
    adapters, equal to PEFT's mixed batch."""
    m, ref = quantized(saved, quant), quantized(saved, quant)
    fastlora.patch(m, cuda_graphs="emulate", max_loras_per_batch=2)
    kw = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=6, do_sample=False, pad_token_id=0)
    for names in (["sql", "__base__", "chat", "sql"], ["biased", "chat", "biased", "__base__"]):
        assert torch.equal(m.generate(**kw, adapter_names=names), ref.generate(**kw, adapter_names=names)), names
    assert fastlora.get_state(m).graph_runner.stats["replays"] > 0


def _magnitudes_moved(model, seed: int):
    """DoRA's magnitudes moved off their initial norms (a fresh DoRA adapter's scale is 1 where B A
    is small), the same in every copy made with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.rand(p.shape, generator=gen) + 0.5)
    return model


def _dora_quantized(saved, quant, adapters):
    """``quantized`` with DoRA's magnitudes moved off their initial norms."""
    return _magnitudes_moved(quantized(saved, quant, adapters), 11)


@pytest.mark.parametrize("quant", ["nf4", "nf4_double", "fp4"])
def test_dora_over_a_quantized_base_in_mixed_batches(saved, quant):
    """QDoRA: DoRA adapters over a bitsandbytes base, on fastlora's path beside plain and biased
    adapters and base rows, q/k/v and gate/up siblings sharing one LoRA call: its column norms read
    the dequantized weight as PEFT's DoRA layer does. PEFT refuses DoRA in a mixed batch; the
    oracle is PEFT row by row with that row's adapter active."""
    from test_dora import peft_rows

    adapters = ALL_SIBLINGS[:2] + (("dora", ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"), 4,
                                    {"use_dora": True}), ("dora_o", ("o_proj",), 8, {"use_dora": True}))
    m, ref = _dora_quantized(saved, quant, adapters), _dora_quantized(saved, quant, adapters)
    report = fastlora.patch(m)
    assert report.adapter_fallbacks == [] and report.left_on_peft == [], report
    kind = KIND[quant]
    assert report.counts() == {f"qkv_{kind}": 2, f"gate_up_{kind}": 2, f"linear_{kind}": 4}, report.counts()
    for names in (["dora", "sql", "__base__", "dora_o"], ["chat", "dora", "dora", "__base__"]):
        torch.testing.assert_close(logits(m, names), peft_rows(ref, names), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(peft_rows(ref, ["dora"] * 4), peft_rows(ref, ["__base__"] * 4))


def test_dora_over_an_8bit_base_stays_on_peft(saved):
    m = quantized(saved, "int8", ADAPTERS[:1] + (("dora", ("q_proj",), 4, {"use_dora": True}),))
    report = fastlora.patch(m)
    assert {(a, r) for _, a, r in report.adapter_fallbacks} == {("dora", "DoRA over a quantized Linear8bitLt")}, report


def test_dora_over_a_quantized_base_follows_magnitude_edits(saved):
    """DoRA's column scale is computed once and again only when its inputs change: an edited
    magnitude is followed at the next call."""
    from test_dora import peft_rows

    adapters = (("dora", ("q_proj", "v_proj"), 4, {"use_dora": True}),)
    m, ref = _dora_quantized(saved, "nf4", adapters), _dora_quantized(saved, "nf4", adapters)
    fastlora.patch(m)
    names = ["dora", "__base__", "dora", "dora"]
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for model in (m, ref):
            for name, p in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    p.mul_(1.7)
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", ["nf4", "int8_joined", "int8_low_ranks"])
def test_quantized_continuous_batching_per_request(saved, quant, monkeypatch):
    """transformers' engine over a 4-bit base, over an 8-bit one whose q/k/v and gate/up share
    one 8-bit matmul, and over an 8-bit one whose every site has adapters: each request with its
    own adapter, every step on fastlora's path (the 8-bit sites' deltas computed beside the
    matmul, counted), equal to PEFT alone."""
    from _continuous import cb_config, greedy_config, peft_alone, requires_cb

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    if quant == "nf4":
        m, ref = quantized(saved, "nf4"), quantized(saved, "nf4")
        names = ["sql", "biased", "__base__", "chat"]
    elif quant == "int8_joined":
        m, ref = (quantized(saved, INT8_NO_OUTLIERS, ALL_SIBLINGS) for _ in range(2))
        names = ["sql", "wide", "__base__", "chat"]
    else:
        m, ref = (quantized(saved, INT8_NO_OUTLIERS, LOW_RANKS) for _ in range(2))
        names = ["chat", "sql", "__base__", "chat"]
    report = fastlora.patch(m)
    calls = _count_beside(monkeypatch)
    assert report.continuous_batching == "on", report
    why_not = {why for _, why in report.quantized_joined}
    assert why_not == ({"nf4 weights: one matmul a member"} if quant == "nf4" else {None}), report.quantized_joined
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 13, 2, 9)]  # the tiny vocabulary
    out = m.generate_batch(prompts, generation_config=greedy_config(5),
                           continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=names)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert out[f"req_{i}"].generated_tokens == peft_alone(ref, prompt, name, 5), (i, name)
    assert (len(calls) > 0) == (quant != "nf4"), len(calls)


def _torchao(targets=(("sql", ("q_proj", "v_proj"), 4, {}), ("chat", ("q_proj", "down_proj", "gate_proj"), 8, {}))):
    """A tiny Llama whose decoder linears torchao quantized (int8 weight-only: nn.Linear keeps a
    tensor-subclass weight), with PEFT's adapters (``lora.torchao`` layers) when ``targets``."""
    torchao = pytest.importorskip("torchao.quantization")
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao.quantize_(model.model, torchao.Int8WeightOnlyConfig())
    return with_adapters(model, targets, seed=300)


def test_torchao_bases_on_fastlora_path_equal_peft():
    """LoRA layers over torchao-quantized bases: the base matmul torchao's, the deltas fastlora's;
    their quantized siblings are never fused (a tensor subclass cannot be concatenated or streamed)."""
    m, ref = _torchao(), _torchao()
    report = fastlora.patch(m)
    assert report.counts() == {"linear_torchao": 8} and report.left_on_peft == [], report
    assert all("a quantized weight (Int8Tensor)" in why for _, why in report.fusion_blocked), report.fusion_blocked
    for names in (["sql", "chat", "__base__", "sql"], ["chat", "chat", "__base__", "sql"]):
        torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)


def _torchao_dora():
    """``_torchao`` with a DoRA adapter beside a plain one, its magnitudes moved off their initial
    norms (the same in every copy)."""
    targets = (("sql", ("q_proj", "v_proj"), 4, {}),
               ("dora", ("q_proj", "v_proj", "down_proj"), 4, {"use_dora": True}))
    return _magnitudes_moved(_torchao(targets), 12)


def test_dora_over_a_torchao_base_in_mixed_batches():
    """DoRA adapters over torchao's int8 weights beside plain ones and base rows: the column norms
    read the weight dequantized as PEFT's DoRA layer does; PEFT row by row is the oracle."""
    from test_dora import peft_rows

    m, ref = _torchao_dora(), _torchao_dora()
    report = fastlora.patch(m)
    assert report.adapter_fallbacks == [] and report.left_on_peft == [], report
    for names in (["dora", "sql", "__base__", "dora"], ["__base__", "dora", "sql", "sql"]):
        torch.testing.assert_close(logits(m, names), peft_rows(ref, names), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(peft_rows(ref, ["dora"] * 4), peft_rows(ref, ["__base__"] * 4))


def test_dora_over_a_torchao_base_through_the_engine():
    """The same adapters served per request by transformers' engine: each equal to PEFT alone."""
    from _continuous import cb_config, greedy_config, peft_alone, requires_cb

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    m, ref = _torchao_dora(), _torchao_dora()
    fastlora.patch(m)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 12, 3)]
    names = ["dora", "__base__", "sql"]
    out = m.generate_batch(prompts, generation_config=greedy_config(5),
                           continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=names)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert out[f"req_{i}"].generated_tokens == peft_alone(ref, prompt, name, 5), (i, name)


def test_torchao_base_model_alone_is_left_as_it_is():
    """A torchao-quantized model without PEFT: fastlora's base-model kernels skip its quantized
    layers (stream_gemm asked for: only the plain LM head takes it), and generate equals the
    unpatched model's."""
    m, ref = _torchao(()), _torchao(())
    report = fastlora.patch(m, cuda_graphs="emulate", stream_gemm=True)
    kw = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(**kw), ref.generate(**kw)), report
    streamed = [name for name, _ in fastlora.get_state(m).base_ops.stream.modules]
    assert streamed == ["lm_head"] and report.fused_base_groups == 0, (streamed, report)  # the plain LM head alone


def _registered_from(saved, donor, name: str, folder):
    """(patched nf4 model with ``donor``'s adapter ``name`` registered by name from its saved
    folder, PEFT's nf4 model with the same folder loaded)."""
    m, ref = quantized(saved, "nf4"), quantized(saved, "nf4")
    donor.save_pretrained(str(folder))  # an adapter not named "default": into its own folder
    fastlora.patch(m)
    fastlora.register_adapter(m, name, str(folder / name))
    ref.load_adapter(str(folder / name), adapter_name=name)
    return m, ref.eval()


def test_adapters_registered_by_name_over_a_quantized_base(saved, tmp_path):
    """A saved adapter registered by name on a 4-bit model (on single layers and on gate/up, which
    share one LoRA call): its shapes checked against the layers' (not the packed weight's), served
    beside PEFT's adapters, equal to the same folder loaded into PEFT."""
    donor = quantized(saved, "nf4", (("extra", ("q_proj", "down_proj", "gate_proj", "up_proj"), 4, {"lora_bias": True}),))
    with torch.no_grad():
        for name, p in donor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    m, ref = _registered_from(saved, donor, "extra", tmp_path)
    names = ["extra", "sql", "__base__", "extra"]
    torch.testing.assert_close(logits(m, names), logits(ref, names), atol=1e-5, rtol=1e-5)


def test_graphs_are_off_over_an_8bit_base_with_outliers_with_the_reason(saved):
    """bitsandbytes' 8-bit matmul with an outlier threshold (transformers' default) looks for
    outlier columns on the host, which a CUDA graph cannot capture: the decode plan turns graphs off
    up front (a CUDA model faked: the CPU model's plan is decided as a GPU one would be), instead of
    failing a capture per shape. With ``llm_int8_threshold=0.0`` there is no search, and no
    blocker; nor over a 4-bit base."""
    import types

    from peft_fastlora.decode.generate import graphs_wanted

    m = quantized(saved, "int8")
    report = fastlora.patch(m, cuda_graphs="emulate")  # emulated graphs replay eagerly: allowed
    assert report.cuda_graphs == "emulated", report.cuda_graphs
    state = fastlora.get_state(m)
    as_gpu = types.SimpleNamespace(options=types.SimpleNamespace(cuda_graphs=True), device=torch.device("cuda"),
                                   inner=state.inner, lora_plan=state.lora_plan)
    why = graphs_wanted(as_gpu)
    assert why is not None and why.startswith("14 bitsandbytes 8-bit layers with an outlier threshold"), why
    assert "not capturable" in why and "llm_int8_threshold=0.0" in why, why
    for other in (INT8_NO_OUTLIERS, "nf4"):
        as_gpu.inner = quantized(saved, other).get_base_model()
        assert graphs_wanted(as_gpu) is None, other
    # the continuous-batching engine's graphs decide the same, up front
    for quant, blocked in (("int8", True), (INT8_NO_OUTLIERS, False)):
        m = quantized(saved, quant)
        fastlora.patch(m)
        why = fastlora.get_state(m).continuous.graphs_blocker()
        assert (why is not None and "outlier threshold" in why) if blocked else why is None, (quant, why)


def test_a_dora_adapter_registered_by_name_over_a_4bit_base(saved, tmp_path):
    """A saved DoRA adapter registered by name on a 4-bit model: its column scale computed from the
    dequantized weight and its slot's A and B, equal to the same folder loaded into PEFT (row by
    row: PEFT refuses DoRA in a mixed batch)."""
    from test_dora import peft_rows

    donor = _dora_quantized(saved, "nf4", (("qdora", ("q_proj", "gate_proj", "up_proj"), 4, {"use_dora": True}),))
    m, ref = _registered_from(saved, donor, "qdora", tmp_path)
    names = ["qdora", "sql", "__base__", "qdora"]
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(peft_rows(ref, ["qdora"] * 4), peft_rows(ref, ["__base__"] * 4))


def test_a_dora_adapter_registered_by_name_over_a_torchao_base(tmp_path):
    """A saved DoRA adapter registered by name on a torchao model: equal to the same folder loaded
    into PEFT, row by row."""
    from test_dora import peft_rows

    _torchao_dora().save_pretrained(str(tmp_path))  # its adapters, each in its own folder
    m, ref = _torchao(), _torchao()
    fastlora.patch(m)
    fastlora.register_adapter(m, "dora", str(tmp_path / "dora"))
    ref.load_adapter(str(tmp_path / "dora"), adapter_name="dora")
    ref.eval()
    names = ["dora", "sql", "__base__", "dora"]
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(peft_rows(ref, ["dora"] * 4), peft_rows(ref, ["__base__"] * 4))
