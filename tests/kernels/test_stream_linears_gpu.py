"""On the GPU: the base model's decode GEMMs through the weight-streaming kernel
(``base_ops.stream_linears``), in small models of Llama-3-8B's and Llama-3.2-1B's widths with
three adapters of mixed ranks, bf16: a decode-sized forward's logits and a mixed-adapter
``generate`` through the graphs, against PEFT's own mixed batch and against fastlora with the
kernel off."""

from __future__ import annotations

import importlib
import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora

from _helpers import count_calls
from _models import left_padded_batch, tiny_llama

pytestmark = pytest.mark.gpu

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["a", "__base__", "b", "c", "a", "c"]


# Llama-3-8B's widths, and Llama-3.2-1B's (q/k/v, o and down narrower than NARROW_N: split-K tiles)
WIDTHS = {"8b": dict(hidden_size=4096, intermediate_size=14336), "1b": dict(hidden_size=2048, intermediate_size=8192)}


@pytest.fixture(scope="module", params=sorted(WIDTHS))
def model(request):
    base = tiny_llama(3, **WIDTHS[request.param], num_attention_heads=32,
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


def _steps_as_close_as_cublas(results, ref_key, width, steps):
    """Step after step while the three decodes' tokens agree (bf16: a near tie may round the other
    way), the kernel's logits (``results[True]``) no further from ``results[ref_key]``'s than
    cuBLAS's (``results[False]``); at least two steps compared."""
    compared = 0
    for step in range(steps):
        seqs = [results[k].sequences[:, width:width + step] for k in (ref_key, True, False)]
        if not (torch.equal(seqs[0], seqs[1]) and torch.equal(seqs[0], seqs[2])):
            break
        ref = results[ref_key].logits[step]
        err_on, err_off = _rel(results[True].logits[step], ref), _rel(results[False].logits[step], ref)
        assert err_on < 1.5 * err_off + 2e-3 and err_on < 3e-2, (step, err_on, err_off)
        compared += 1
    assert compared >= 2


def _count_folds(monkeypatch):
    """What each decoder layer's ``took_add`` answered (the residual folded into down's GEMM or not)."""
    import peft_fastlora.base_ops.stream_linears as sl

    seen, original = [], sl.StreamLinears.took_add

    def took_add(self):
        seen.append(original(self))
        return seen[-1]

    monkeypatch.setattr(sl.StreamLinears, "took_add", took_add)
    return seen


def test_decode_sized_forward_as_close_to_peft_as_cublas(model, monkeypatch):
    """bf16 logits of an 8B-wide model carry about 1% of rounding against PEFT's whatever the GEMM:
    the kernel's must be no further from PEFT's than fastlora's with cuBLAS (a wrong tile, range or
    split sum would be orders of magnitude off)."""

    narrow = model.get_base_model().config.hidden_size < fastlora.Tuning().stream_narrow_n
    # rows the kernel takes: 48 for the wide layers, 24 for the narrow ones
    ids = torch.randint(3, 128, (len(NAMES), 4 if narrow else 8), device="cuda")
    outs = {}
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=NAMES).logits
        base = model.get_base_model()(input_ids=ids).logits
        for on in (True, False):
            report = fastlora.patch(model, stream_gemm=on)
            try:
                calls = count_calls(monkeypatch,
                        importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["stream_gemm"])
                folds = _count_folds(monkeypatch)
                outs[on] = model(input_ids=ids, adapter_names=NAMES).logits
            finally:
                fastlora.unpatch(model)
                monkeypatch.undo()
            if on:
                assert "decode GEMMs streamed: fused groups and" in str(report), report
                # q/k/v and gate/up groups, o and down of both layers; the LM head keeps cuBLAS
                assert calls["stream_gemm"] >= 8, calls
                assert folds == [True, True], folds  # both layers' MLP residual add rode in down's GEMM
            else:
                assert calls["stream_gemm"] == 0, calls
    assert _rel(ref, base) > 1e-2  # the adapters matter, so the comparison below means something
    err_on, err_off = _rel(outs[True], ref), _rel(outs[False], ref)
    assert err_on < 1.5 * err_off + 2e-3 and err_on < 3e-2, (err_on, err_off)


@pytest.mark.parametrize("lengths", [[5, 9, 3, 7, 2, 8], [6]])
def test_generate_through_graphs_as_close_to_peft_as_cublas(model, lengths):
    """The graphs' decode steps with the kernel against PEFT's own mixed batch, step after step while
    the tokens agree (bf16: a near tie may round the other way), no further from it than the same
    steps with cuBLAS."""
    names = NAMES[:len(lengths)]
    batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=len(lengths)).items()}
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, adapter_names=names, output_logits=True,
              return_dict_in_generate=True)
    results = {}
    with torch.no_grad():
        results["peft"] = model.generate(**batch, **kw)
        for on in (True, False):
            report = fastlora.patch(model, stream_gemm=on)
            try:
                results[on] = model.generate(**batch, **kw)
                stats = dict(fastlora.get_state(model).graph_runner.stats)
            finally:
                fastlora.unpatch(model)
            assert stats["replays"] >= 8, stats
            assert ("decode GEMMs streamed: off" in str(report)) != on, report
    _steps_as_close_as_cublas(results, "peft", batch["input_ids"].shape[1], 12)


def test_base_model_gate_up_and_activation_in_one_gemm_as_close_to_hf_as_cublas(monkeypatch):
    """No adapters: each MLP's gate/up pair is a plain fused group, and the graphs' decode steps take
    ``act(gate) * up`` from one streaming GEMM (no act-mul kernel) and fold the residual into down;
    logits against transformers' own eager decode, no further from it than fastlora with cuBLAS."""
    import peft_fastlora.base_ops.stream_linears as sl

    base = tiny_llama(4, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128).to("cuda", torch.bfloat16).eval()
    base.generation_config.eos_token_id = None
    batch = {k: v.cuda() for k, v in left_padded_batch([5, 9, 3], seed=7).items()}
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    seen, original = [], sl.StreamLinears.gated

    def gated(self, *args):
        out = original(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(sl.StreamLinears, "gated", gated)
    folds = _count_folds(monkeypatch)
    results = {}
    with torch.no_grad():
        results["hf"] = base.generate(**batch, **kw)
        for on in (True, False):
            seen.clear()
            folds.clear()
            fastlora.patch(base, stream_gemm=on)
            try:
                results[on] = base.generate(**batch, **kw)
            finally:
                fastlora.unpatch(base)
            if on:
                assert seen and all(seen), seen
                assert folds and all(folds), folds
            else:
                assert not seen and not folds
    _steps_as_close_as_cublas(results, "hf", batch["input_ids"].shape[1], 10)


def test_generate_at_96_rows_through_the_tma_kernel_as_close_to_peft_as_cublas(model, monkeypatch):
    """96 rows of mixed adapters: the graphs' decode steps take the TMA kernel (a tile for every
    class here, whatever the committed table holds; split K on the deep and square layers, the
    residual fold on down) and stay as close to PEFT's own mixed batch as with cuBLAS."""
    from peft_fastlora.ops.tma_gemm import TmaConfig

    tiles = {"deep": TmaConfig(128, 64, 4, 8, 4), "square": TmaConfig(64, 128, 2, 4, 4),
             "tall": TmaConfig(128, 64, 1, 8, 4), "wide": TmaConfig(256, 64, 1, 8, 3)}
    tuning = fastlora.Tuning(tma_tiles={cls: c._asdict() for cls, c in tiles.items()})
    lengths = [int(v) for v in torch.randint(2, 10, (96,), generator=torch.Generator().manual_seed(5))]
    names = [NAMES[i % len(NAMES)] for i in range(96)]
    batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=11).items()}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=names, output_logits=True,
              return_dict_in_generate=True)
    results = _reference_then_tma_on_and_off(monkeypatch, model, "peft", batch, kw, tuning)
    _rows_as_close_as_cublas(results, "peft", batch["input_ids"].shape[1], 6)


def _reference_then_tma_on_and_off(monkeypatch, model, ref_key, batch, kw, tuning=None):
    """``model``'s own ``generate`` (under ``ref_key``), then fastlora's with its kernels on (True) and
    off (False): the TMA GEMM called with them on only."""

    results = {}
    with torch.no_grad():
        results[ref_key] = model.generate(**batch, **kw)
        for on in (True, False):
            calls = count_calls(monkeypatch,
                    importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["tma_gemm"])
            with fastlora.patched(model, stream_gemm=on, tuning=tuning):
                results[on] = model.generate(**batch, **kw)
            assert (calls["tma_gemm"] > 0) == on, calls
    return results


def _rows_as_close_as_cublas(results, ref_key, width, steps):
    """``_steps_as_close_as_cublas`` row by row, for batches where some row's near tie is likely to
    round another way within a few steps: at each step the rows whose tokens so far agree in all
    three decodes, the kernel's logits there no further from the reference's than cuBLAS's; at
    least three decode steps over at least half the rows."""
    compared = 0
    rows = results[ref_key].sequences.shape[0]
    for step in range(steps):
        seqs = [results[k].sequences[:, width:width + step] for k in (ref_key, True, False)]
        agree = (seqs[0] == seqs[1]).all(1) & (seqs[0] == seqs[2]).all(1)
        if agree.sum() < rows // 2:
            break
        ref = results[ref_key].logits[step][agree]
        err_on, err_off = _rel(results[True].logits[step][agree], ref), _rel(results[False].logits[step][agree], ref)
        assert err_on < 1.5 * err_off + 2e-3 and err_on < 3e-2, (step, int(agree.sum()), err_on, err_off)
        compared += 1
    assert compared >= 4, compared  # the prefill's logits and three decode steps


@pytest.mark.parametrize("rows", [96, 70])
def test_base_model_at_65_128_rows_takes_the_tables_gated_tile_as_close_to_hf_as_cublas(monkeypatch, rows):
    """No adapters, 65-128 rows: where the committed tile table has a ``glu`` tile, each graphed
    decode step's gate/up and activation is one TMA GEMM; logits against transformers' own eager
    decode, row by row, no further from it than fastlora with cuBLAS."""
    import peft_fastlora.base_ops.stream_linears as sl

    if "glu" not in sl.tma_tiles():
        pytest.skip("the committed table has no gated tile")
    base = tiny_llama(4, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128).to("cuda", torch.bfloat16).eval()
    base.generation_config.eos_token_id = None
    lengths = [int(v) for v in torch.randint(2, 10, (rows,), generator=torch.Generator().manual_seed(rows))]
    batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=rows).items()}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    results = _reference_then_tma_on_and_off(monkeypatch, base, "hf", batch, kw)
    _rows_as_close_as_cublas(results, "hf", batch["input_ids"].shape[1], 6)


def test_generate_at_96_rows_gate_up_in_one_launch_as_close_to_peft_as_without(model, monkeypatch):
    """96 rows of mixed adapters (ranks 16 and 32 on gate/up, one adapter not there), the committed
    tiles: the gate/up site takes ``ops.glu_lora`` (shrink, deltas and act-mul in one launch) in the
    prefill and the graphs' decode steps, and stays as close to PEFT's own mixed batch as the folded
    GEMM, expand and act-mul it replaces (the table without its gated tile)."""
    import peft_fastlora.base_ops.stream_linears as sl

    if model.config.intermediate_size != WIDTHS["8b"]["intermediate_size"]:
        pytest.skip("the committed gated tile starts at 8B's reduction (K = 4,096)")
    lengths = [int(v) for v in torch.randint(2, 10, (96,), generator=torch.Generator().manual_seed(6))]
    names = [NAMES[i % len(NAMES)] for i in range(96)]
    batch = {k: v.cuda() for k, v in left_padded_batch(lengths, seed=12).items()}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=names, output_logits=True,
              return_dict_in_generate=True)
    results = {}
    with torch.no_grad():
        results["peft"] = model.generate(**batch, **kw)
        committed = {cls: dict(t.config._asdict(), min_k=t.min_k) for cls, t in sl.tma_tiles().items()}
        for on in (True, False):
            tuning = fastlora.Tuning(tma_tiles=committed if on else {k: v for k, v in committed.items() if k != "glu"})
            calls = count_calls(monkeypatch,
                    importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["glu_lora"])
            with fastlora.patched(model, stream_gemm=True, tuning=tuning) as report:
                assert report.stream_lora_gated_mlps > 0 and "LoRA gate/up, its shrink" in str(report)
                results[on] = model.generate(**batch, **kw)
            assert (calls["glu_lora"] > 0) == on, calls
    _rows_as_close_as_cublas(results, "peft", batch["input_ids"].shape[1], 6)
