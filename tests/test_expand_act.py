"""A folded gate/up site's expand and the act-mul in one launch (``ops.lora_expand_act``) under the
Triton interpreter: against its torch reference and against the two launches it replaces (the
wide expand, then ``act_mul``), with fresh random inputs, widths that cut column blocks, ranks of
1 to 128 (not multiples of 16, a module left out), one- to 16-row chunks, rows with no adapter,
a stale slot, both activations; bad inputs; and a tiny Llama through emulated decode graphs whose
gated MLPs take the path, equal to PEFT's tokens and logits."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from peft import LoraConfig, get_peft_model  # noqa: E402

import peft_fastlora as fastlora  # noqa: E402
from peft_fastlora.backend.triton import TritonLoRABackend  # noqa: E402
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode  # noqa: E402
from peft_fastlora.lora import sites  # noqa: E402
from peft_fastlora.ops import act_mul, lora_expand, lora_expand_act, lora_expand_act_reference  # noqa: E402

from _helpers import pack  # noqa: E402
from _models import left_padded_batch, tiny_llama  # noqa: E402
from test_triton_kernels import TOLERANCES, DTYPE_IDS, assert_close  # noqa: E402

CPU = torch.device("cpu")
# slot ranks per (gate, up): rank classes 1 to 128, an adapter on gate only, one on up only
RANKS = [[8, 8], [72, 40], [128, 24], [1, 0], [0, 17], [16, 16]]
COMPOSITIONS = {
    "one_row_each": [0, 1, 2, 3, NO_ADAPTER, 4, 5, 2],
    "skewed": [5] * 17 + [NO_ADAPTER, 0, 3] + [1] * 5 + [NO_ADAPTER] * 3,
    "all_base": [NO_ADAPTER] * 5,
    "one_adapter": [2],
}


def inputs(width, comp, dtype, seed):
    """(packed weights, ranks, scalings, y from the folded GEMM's columns, gate_up, token slots,
    the Triton backend with the batch prepared)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0, width, 2 * width]
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    r_max = int(ranks.max())
    scalings = (torch.rand(ranks.shape, generator=gen) * 2 + 0.25).float().contiguous()
    wi = COMPOSITIONS[comp]
    b = (torch.randn(len(RANKS), 2 * width, r_max, generator=gen) / 4).to(dtype)
    w = pack(torch.zeros(len(RANKS), 2 * r_max, 3, dtype=dtype), b, offsets, ranks, seed=seed)
    # the GEMM's output: gate, up, then one column per arena row (NaN where no slot's rows are)
    full = torch.randn(len(wi), 2 * width + w.a.shape[0], generator=gen).to(dtype)
    used = torch.zeros(w.a.shape[0], dtype=torch.bool)
    for s in range(len(RANKS)):
        for j in range(2):
            row = int(w.a_rows[s, j])
            used[row:row + int(ranks[s, j])] = True
    full[:, 2 * width:][:, ~used] = float("nan")
    tri = TritonLoRABackend(len(RANKS), CPU)
    fb = ForwardBatch(len(wi), [1] * len(wi), ForwardMode.DECODE, CPU)
    tri.prepare_lora_batch(fb, wi, [8] * len(RANKS), [1.0] * len(RANKS), use_cuda_graph=False)
    return w, ranks.contiguous(), scalings, full, torch.tensor(wi, dtype=torch.int32), tri


def run(tri, w, ranks, scalings, full, act, **kw):
    bi = tri.batch_info
    width = w.offsets[1]
    return lora_expand_act(full[:, 2 * width:], w.b, w.b_offs, w.a_rows, ranks, scalings, full[:, :2 * width],
                           bi.token_slot, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                           act=act, block_m=bi.block_m, max_rank=w.max_rank, b_align=w.align, **kw)


def two_launches(tri, w, ranks, scalings, full, act):
    """What the decode path ran before: the wide expand into the GEMM's output, then act_mul."""
    bi = tri.batch_info
    width = w.offsets[1]
    out = full[:, :2 * width].clone()
    lora_expand(full[:, 2 * width:], w.b, list(w.offsets), ranks, scalings, out, bi.sorted_token_ids,
                bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=bi.block_m, b_offs=w.b_offs, b_align=w.align,
                y_cols=w.a_rows, max_rank=w.max_rank, wide=True)
    return act_mul(out[:, :width], out[:, width:], act)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("comp", list(COMPOSITIONS))
@pytest.mark.parametrize("width", [300, 16])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_equals_reference_and_the_two_launches(dtype, atol, rtol, width, comp, act):
    w, ranks, scalings, full, tok, tri = inputs(width, comp, dtype, seed=width + len(comp))
    before = full.clone()
    got = run(tri, w, ranks, scalings, full, act)
    assert torch.equal(full.nan_to_num(7.0), before.nan_to_num(7.0)), "the GEMM's output was written"
    assert got.shape == (len(tok), width) and not got.isnan().any(), "a row unwritten or a read past a rank"
    want = lora_expand_act_reference(full[:, 2 * width:], w.b, w.b_offs, w.a_rows, ranks, scalings,
                                     full[:, :2 * width], tok, act=act)
    assert_close(got, want, atol, rtol, f"expand+act {comp} {act}")
    assert_close(got, two_launches(tri, w, ranks, scalings, full, act), atol, rtol, "against the two launches")
    none = tok < 0  # rows of no adapter: the act-mul of the base values, exactly
    base_only = act_mul(full[none, :width].contiguous(), full[none, width:2 * width].contiguous(), act)
    assert torch.equal(got[none], base_only)


def test_block_width_cuts_columns_and_a_stale_slot_adds_nothing():
    """A column block narrower than the width (blocks cut mid-way); a chunk whose slot is past the
    weights (a stale plan) still writes its rows, with no delta."""
    w, ranks, scalings, full, tok, tri = inputs(300, "skewed", torch.float32, seed=3)
    want = lora_expand_act_reference(full[:, 600:], w.b, w.b_offs, w.a_rows, ranks, scalings, full[:, :600], tok,
                                     act="silu")
    assert_close(run(tri, w, ranks, scalings, full, "silu", block_n=64), want, 1e-5, 1e-5, "block_n=64")
    bi = tri.batch_info
    stale = bi.chunk_slot.clone()
    first = int((stale >= 0).nonzero()[0])
    slot = int(stale[first])
    bi.chunk_slot[first] = len(RANKS) + 3
    try:
        got = run(tri, w, ranks, scalings, full, "silu")
    finally:
        bi.chunk_slot.copy_(stale)
    rows = bi.sorted_token_ids[bi.chunk_start[first]:bi.chunk_start[first] + bi.chunk_len[first]].long()
    assert (tok[rows] == slot).all()
    assert torch.equal(got[rows], act_mul(full[rows, :300].contiguous(), full[rows, 300:600].contiguous(), "silu"))


def test_bad_inputs_name_the_problem():
    w, ranks, scalings, full, tok, tri = inputs(16, "one_row_each", torch.float32, seed=0)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        run(tri, w, ranks, scalings, full, "relu")
    bi = tri.batch_info
    with pytest.raises(ValueError, match="row tiles of up to 16"):
        lora_expand_act(full[:, 32:], w.b, w.b_offs, w.a_rows, ranks, scalings, full[:, :32], bi.token_slot,
                        bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len, act="silu", block_m=32,
                        max_rank=w.max_rank)
    with pytest.raises(ValueError, match=r"gate_up \(8, 31\) must be \(s, 2 \* width\)"):
        lora_expand_act(full[:, 32:], w.b, w.b_offs, w.a_rows, ranks, scalings, full[:, :31], bi.token_slot,
                        bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len, act="silu", block_m=16,
                        max_rank=w.max_rank)
    with pytest.raises(ValueError, match="ranks must be a"):
        run(tri, w, ranks[:, :1], scalings, full, "silu")
    # the backend's entry: a site that is not two modules of one width
    odd = pack(torch.zeros(len(RANKS), 2 * 128, 3), torch.zeros(len(RANKS), 40, 128), [0, 16, 40], ranks, seed=1)
    with pytest.raises(ValueError, match="two modules of one width"):
        tri.run_packed_expand_act(full[:, 32:], odd, base_output=full[:, :40], act="silu", layer_ranks=ranks,
                                  layer_scalings=scalings)
    with pytest.raises(ValueError, match="unknown activation"):
        tri.run_packed_expand_act(full[:, 32:], w, base_output=full[:, :32], act="gelu", layer_ranks=ranks,
                                  layer_scalings=scalings)
    with pytest.raises(ValueError, match="input has 7 tokens"):
        tri.run_packed_expand_act(full[1:, 32:], w, base_output=full[1:, :32], act="silu", layer_ranks=ranks,
                                  layer_scalings=scalings)


def _same(got, want):
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_tiny_llama_mlps_take_it_through_emulated_graphs(monkeypatch):
    """Mixed ranks, an adapter on gate only and one on up only, "__base__" rows, left padding,
    through emulated graphs: PEFT's tokens and logits, the launch taken at every layer and step;
    with ``GATED_EXPAND`` off the same tokens through the members; an adapter added mid-way (the
    sites rebuilt, the MLPs' path replaced, not doubled); nothing left after unpatch."""
    from peft_fastlora import ops
    from peft_fastlora.patch import get_state

    base = tiny_llama(0, vocab_size=128)
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=4, target_modules=["gate_proj", "down_proj"],
                                      init_lora_weights=False))
    model.add_adapter("u", LoraConfig(r=24, lora_alpha=12, target_modules=["up_proj"], init_lora_weights=False))
    batch = left_padded_batch([5, 7, 3, 6, 4], seed=5)
    names = ["a", "__base__", "b", "a", "u"]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    calls = []
    original = ops.lora_expand_act
    monkeypatch.setattr(ops, "lora_expand_act", lambda *a, **k: calls.append(1) or original(*a, **k))
    layers = model.config.num_hidden_layers
    with fastlora.patched(model, backend="triton", fuse_silu_mul=True, fold_shrink=True,
                          cuda_graphs="emulate") as report, torch.no_grad():
        assert report.expand_act_mlps == layers and "expand and act-mul in one kernel" in str(report), report
        _same(model.generate(**batch, adapter_names=names, **kwargs), want)
        assert len(calls) >= layers * 3, calls  # every layer, each decode step (the prefill's tile is larger)
        monkeypatch.setattr(sites, "GATED_EXPAND", False)
        calls.clear()
        _same(model.generate(**batch, adapter_names=names, **kwargs), want)
        assert not calls
        monkeypatch.setattr(sites, "GATED_EXPAND", True)
        model.add_adapter("c", LoraConfig(r=8, lora_alpha=8, target_modules=["up_proj", "gate_proj"],
                                          init_lora_weights=False))
        names = ["c", "a", "__base__", "b", "c"]
        got = model.generate(**batch, adapter_names=names, **kwargs)
        assert len(get_state(model)._gated_mlps) == layers
        assert calls
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    _same(got, want)
    assert not any("_fastlora_gated" in m.__dict__ for m in model.modules())


def test_random_batches_of_the_interpreted_kernel_equal_the_two_launches():
    """Random widths, compositions and row counts (1-40: chunks of 1-16 rows, several chunks per
    slot), fresh weights each time: the one launch equals the two it replaces."""
    rng = random.Random(11)
    for trial in range(4):
        width = rng.choice([8, 40, 136])
        wi = [rng.choice([NO_ADAPTER, 0, 1, 2, 5]) for _ in range(rng.randint(1, 40))]
        COMPOSITIONS["_random"] = wi
        try:
            w, ranks, scalings, full, tok, tri = inputs(width, "_random", torch.float32, seed=100 + trial)
        finally:
            del COMPOSITIONS["_random"]
        for act in ("silu", "gelu_tanh"):
            assert_close(run(tri, w, ranks, scalings, full, act), two_launches(tri, w, ranks, scalings, full, act),
                         1e-5, 1e-5, f"trial {trial} {act} width {width} rows {len(wi)}")
