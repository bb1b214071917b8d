"""DoRA adapters on fastlora's path, in mixed batches beside plain LoRA adapters and base rows.

PEFT refuses ``adapter_names`` when a DoRA adapter is in the batch, so the oracle is PEFT row by
row, with that row's adapter active (``disable_adapter`` for ``"__base__"`` rows), fp32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _patch_models import ALL, IDS, build, logits  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
ADAPTERS = (("sql", ALL, 4, {}), ("dora_qv", ("q_proj", "v_proj"), 4, {"use_dora": True}),
            ("dora_all", ALL, 8, {"use_dora": True}), ("chat", ("q_proj", "down_proj"), 2, {}))


def peft_rows(ref, names, ids=IDS):
    """PEFT's logits, each row alone with its own adapter active."""
    out = []
    with torch.no_grad():
        for i, name in enumerate(names):
            row = dict(input_ids=ids[i:i + 1], attention_mask=torch.ones_like(ids[i:i + 1]))
            if name == "__base__":
                with ref.disable_adapter():
                    out.append(ref(**row).logits)
            else:
                ref.set_adapter(name)
                out.append(ref(**row).logits)
    return torch.cat(out)


def dora_pair(biased_base: bool = False):
    """(patched model, PEFT reference) with ``ADAPTERS``; DoRA's magnitudes moved off their
    initial norms (a freshly made DoRA adapter's scale is 1 where B A is small)."""
    models = []
    for _ in range(2):
        model = build(adapters=ADAPTERS)
        torch.manual_seed(11)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
                if biased_base and name.endswith("base_layer.bias"):
                    p.normal_()
        models.append(model)
    return models


@pytest.mark.parametrize("names", [["dora_all", "sql", "__base__", "dora_qv"],
                                   ["chat", "dora_qv", "dora_all", "dora_all"],
                                   ["sql", "__base__", "chat", "sql"]])
def test_dora_rows_equal_peft_row_by_row(names):
    m, ref = dora_pair()
    report = fastlora.patch(m)
    assert report.adapter_fallbacks == [] and report.left_on_peft == [], report
    assert all(site.pool.dora is not None for site in get_state(m).sites if site.kind != "embedding")
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)


def _recomputed(m):
    return sum(site.pool.dora_tables.recomputed for site in get_state(m).sites if site.pool.dora_tables)


@pytest.mark.parametrize("edit", ["mul_", "data"])
def test_dora_scale_follows_values_edited_in_place(edit):
    """Calls with unchanged adapters compute no scale again; the magnitude or B edited in place
    (through the parameter, or its ``.data``, which bumps no version counter): the next call
    computes the edited adapter's scales again, and only those."""
    m, ref = dora_pair()
    fastlora.patch(m)
    names = ["dora_all", "dora_qv", "__base__", "sql"]
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)
    first = _recomputed(m)
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)
    assert _recomputed(m) == first > 0
    edited = 0
    for model in (m, ref):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".dora_all" in name and ("lora_magnitude_vector" in name or "lora_B" in name):
                    (p if edit == "mul_" else p.data).mul_(1.5)
                    edited += model is m and "lora_magnitude_vector" in name
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)
    assert _recomputed(m) == first + edited, (first, edited, _recomputed(m))  # dora_all's modules alone


def test_dora_in_slots_and_generate():
    """Three slots for four adapters: DoRA and plain adapters take turns in them; greedy tokens of a
    mixed batch equal PEFT's, row by row."""
    m, ref = dora_pair()
    fastlora.patch(m, max_loras_per_batch=3)
    for names in (["dora_all", "sql", "chat", "sql"], ["chat", "dora_qv", "__base__", "sql"],
                  ["dora_qv", "dora_all", "chat", "__base__"], ["sql", "dora_all", "dora_qv", "dora_all"]):
        torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)
    names = ["dora_all", "__base__", "sql", "dora_qv"]
    kw = dict(attention_mask=torch.ones_like(IDS), max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = m.generate(input_ids=IDS, adapter_names=names, **kw)
    for i, name in enumerate(names):
        row = dict(kw, attention_mask=kw["attention_mask"][i:i + 1])
        if name == "__base__":
            with ref.disable_adapter():
                want = ref.generate(input_ids=IDS[i:i + 1], **row)
        else:
            ref.set_adapter(name)
            want = ref.generate(input_ids=IDS[i:i + 1], **row)
        assert torch.equal(out[i:i + 1], want), (i, name)


def _biased_dora_models():
    """Two identical tiny Llamas with biased projections (DoRA's shift), ``ADAPTERS`` and an
    adapter with a bias on B sharing sites with the DoRA ones (both epilogues in one launch)."""
    from _models import tiny_llama as llama
    from _patch_models import VOCAB, lora, with_lora

    models = []
    for _ in range(2):
        base = llama(0, vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64,
                     attention_bias=True, mlp_bias=True)
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(generator=torch.Generator().manual_seed(len(name)))
        adapters = ADAPTERS + (("biased", ("q_proj", "down_proj"), 4, {"lora_bias": True}),)
        model = with_lora(base, [(name, lora(targets, r, 2 * r, **kw)) for name, targets, r, kw in adapters], seed=100)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name))))
        models.append(model.eval())
    return models


@pytest.mark.parametrize("backend,fold", [("torch_native", False), ("triton", False), ("triton", True)])
def test_dora_over_biased_layers_through_each_backend_and_the_fold(backend, fold):
    """Base layers with biases (the shift ``(1 - scale) * bias``), the Triton kernels (the
    interpreter) and the folded shrink: full-prompt and one-token forwards equal PEFT row by row."""
    from peft_fastlora import Tuning

    m, ref = _biased_dora_models()
    report = fastlora.patch(m, backend=backend, fold_shrink=fold, tuning=Tuning(fold_max_share=1e9))
    assert report.adapter_fallbacks == [], report
    names = ["dora_all", "biased", "__base__", "dora_qv"]
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)
    one = IDS[:, -1:]
    torch.testing.assert_close(logits(m, names, one), peft_rows(ref, names, one), **TOL)
    if fold:
        assert get_state(m).last_fold or report.shrink_folded.startswith("8 of"), report.shrink_folded


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_dora_on_the_embedding(backend):
    """DoRA on the input embedding (its magnitude over the norms of the table's columns plus the
    scaled ``B @ A``) beside DoRA and plain adapters on linear layers: equal to PEFT row by row."""
    adapters = ADAPTERS + (("dora_emb", ("embed_tokens", "q_proj"), 4, {"use_dora": True}),)
    models = []
    for _ in range(2):
        model = build(adapters=adapters)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name))))
        models.append(model)
    m, ref = models
    report = fastlora.patch(m, backend=backend)
    assert report.adapter_fallbacks == [], report
    emb = next(site for site in get_state(m).sites if site.kind == "embedding")
    assert emb.pool.dora is not None
    for names in (["dora_emb", "sql", "__base__", "dora_all"], ["dora_emb", "dora_emb", "chat", "dora_qv"]):
        torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)


def test_one_host_sync_a_call_for_every_site_with_dora(monkeypatch):
    """The slot loader checks every DoRA site's values in one ``sync_tables`` call (one host read)."""
    import peft_fastlora.lora.slot_loader as slot_loader

    seen = []
    real = slot_loader.sync_tables
    monkeypatch.setattr(slot_loader, "sync_tables", lambda pending: (seen.append(len(pending)), real(pending))[1])
    m, ref = dora_pair()
    fastlora.patch(m)
    names = ["dora_all", "dora_qv", "__base__", "sql"]
    torch.testing.assert_close(logits(m, names), peft_rows(ref, names), **TOL)
    sites = sum(site.pool.dora_tables is not None for site in get_state(m).sites)
    assert seen == [sites] and sites == 8, (seen, sites)  # qkv, o, gate_up, down of both layers
