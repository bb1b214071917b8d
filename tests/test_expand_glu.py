"""The gate/up expand with the gated activation in one launch (``ops.lora_expand_glu``) against
torch (the torch backend's expand, then ``act(gate) * up``) and against the two kernels it
replaces (``lora_expand`` then ``act_mul``), under the Triton interpreter: fresh random inputs,
widths that cut the column tiles, ranks of several classes (one past the first rank block), a
module with rank 0, chunks of one to 16 rows and a 17th, rows with no adapter, the shrink read
from a folded GEMM's columns, both activations, a stale plan and bad inputs."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.backend.torch_native import TorchNativeLoRABackend  # noqa: E402
from peft_fastlora.backend.triton import TritonLoRABackend  # noqa: E402
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode  # noqa: E402

from _helpers import pack  # noqa: E402
from test_triton_kernels import TOLERANCES, DTYPE_IDS, assert_close  # noqa: E402

CPU = torch.device("cpu")
# gate/up width, and each slot's (gate rank, up rank): 72 takes a second rank block of 64, 0 an
# adapter on gate only
SITES = {
    "wide_mixed": (300, [[16, 16], [72, 40], [1, 0], [33, 8]]),
    "narrow_r16": (37, [[16, 16], [16, 16], [16, 16], [16, 16]]),
}
COMPOSITIONS = {  # each row's slot
    "one_row_each": [0, 1, 2, 3, NO_ADAPTER, 3, 2],
    "skewed": [1] * 17 + [NO_ADAPTER, 0, 3] + [2] * 5,
    "all_base": [NO_ADAPTER] * 5,
    "base_tiles": [NO_ADAPTER] * 18 + [0] + [NO_ADAPTER] * 3,  # past one row tile of rows with no adapter
    "base_programs": [0] * 3 + [NO_ADAPTER] * 64 + [2] * 3,  # two programs' row tiles (BASE_TILES)
}


def inputs(site, comp, dtype, seed, tail=5):
    n, slot_ranks = SITES[site]
    return make_inputs(n, slot_ranks, COMPOSITIONS[comp], dtype, seed, tail=tail)


def make_inputs(n, slot_ranks, wi, dtype, seed, device=CPU, tail=5, graph_buffers=False):
    """Gate/up of width ``n``, each slot's (gate, up) ranks, each row's slot ``wi``: the packed
    weights, a shrink ``y`` (NaN past each rank and in rows with no adapter), the GEMM output
    ``full`` (gate, up, then ``tail`` columns) and both backends prepared (the Triton one's plan
    in its graph buffers with ``graph_buffers``)."""
    offsets = [0, n, 2 * n]
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    r_max = int(ranks.max())
    scalings = (torch.rand(ranks.shape, generator=gen) * 2 + 0.25).float()
    tok = torch.tensor(wi)
    y = torch.randn(len(wi), 2 * r_max, generator=gen)
    b = torch.randn(len(slot_ranks), 2 * n, r_max, generator=gen) / 4
    for s in range(len(slot_ranks)):
        for j in range(2):
            b[s, offsets[j]:offsets[j + 1], int(ranks[s, j]):] = float("nan")
            y[tok == s, j * r_max + int(ranks[s, j]):(j + 1) * r_max] = float("nan")
    y[tok < 0] = float("nan")
    full = torch.randn(len(wi), 2 * n + tail, generator=gen) * 2
    fb = ForwardBatch(len(wi), [1] * len(wi), ForwardMode.DECODE, device)
    tri, ref = TritonLoRABackend(len(slot_ranks), device), TorchNativeLoRABackend(len(slot_ranks), device)
    if graph_buffers:
        tri.init_cuda_graph_batch_info(len(wi), 1)
    for be in (tri, ref):
        be.prepare_lora_batch(fb, wi, ranks[:, 0].tolist(), [1.0] * len(slot_ranks),
                              use_cuda_graph=graph_buffers and be is tri)
    ranks, scalings, y, b, full = (t.to(device) for t in (ranks, scalings, y, b, full))
    w = pack(torch.zeros(len(slot_ranks), 2 * r_max, 3, dtype=dtype, device=device), b.to(dtype), offsets, ranks,
             seed=seed)
    return offsets, ranks, scalings, y.to(dtype), b.to(dtype), full.to(dtype), w, tri, ref


def folded_y(y, w, ranks):
    """y's columns moved to each (slot, module)'s A rows, NaN everywhere else (a GEMM over [W; A])."""
    r_max = w.max_rank
    out = torch.full((y.shape[0], w.a.shape[0] + 3), float("nan"), dtype=y.dtype, device=y.device)[:, 3:]
    for s in range(ranks.shape[0]):
        for j in range(2):
            rk, row = int(ranks[s, j]), int(w.a_rows[s, j])
            out[:, row:row + rk] = y[:, j * r_max:j * r_max + rk]
    return out


def reference(ref, y, b, offsets, ranks, scalings, full, act):
    from peft_fastlora.ops import act_mul_reference

    n = offsets[1]
    expanded = ref._expand_checked(y, b, offsets, full[:, :2 * n].clone(), ranks, scalings, ref.batch_info)
    return act_mul_reference(expanded[:, :n], expanded[:, n:], act)


def run(tri, w, y, offsets, ranks, scalings, full, act, folded, out=None, **kw):
    from peft_fastlora.ops.lora_expand_glu import lora_expand_glu

    bi = tri.batch_info
    return lora_expand_glu(y, w.b, offsets, ranks, scalings, full, bi.token_slot, bi.sorted_token_ids,
                           bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=bi.block_m, act=act,
                           b_offs=w.b_offs, b_align=w.align, y_cols=w.a_rows if folded else None,
                           max_rank=w.max_rank, out=out, **kw)


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("comp", list(COMPOSITIONS))
@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_equals_torch_and_the_two_kernels(dtype, atol, rtol, site, comp, folded):
    from peft_fastlora.ops import act_mul, lora_expand

    offsets, ranks, scalings, y, b, full, w, tri, ref = inputs(site, comp, dtype, seed=len(site) * 7 + len(comp))
    act = "silu" if len(comp) % 2 else "gelu_tanh"
    n = offsets[1]
    before = full.clone()
    y_in = folded_y(y, w, ranks) if folded else y
    out = torch.full((full.shape[0], n), float("nan"), dtype=dtype)  # every row must be written
    got = run(tri, w, y_in, offsets, ranks, scalings, full, act, folded, out=out)
    assert got is out
    assert torch.equal(full, before), "the base output was written"
    assert not got.isnan().any(), "a row left unwritten, or a read past a rank or a slot's columns"
    assert_close(got, reference(ref, y, b, offsets, ranks, scalings, full, act), atol, rtol, f"{site} {comp}")
    bi = tri.batch_info
    kw = dict(b_offs=w.b_offs, b_align=w.align)
    if folded:
        kw.update(y_cols=w.a_rows, max_rank=w.max_rank)
    two = lora_expand(y_in, w.b, offsets, ranks, scalings, full[:, :2 * n].clone(), bi.sorted_token_ids,
                      bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=bi.block_m, **kw)
    assert_close(got, act_mul(two[:, :n], two[:, n:], act), atol, rtol, f"{site} {comp} against the two kernels")


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_rank16_equals_the_two_kernels_bit_for_bit(dtype, atol, rtol):
    """One rank block, one dot: the same sums and the same roundings as ``lora_expand`` then
    ``act_mul``."""
    from peft_fastlora.ops import act_mul, lora_expand

    offsets, ranks, scalings, y, b, full, w, tri, ref = inputs("narrow_r16", "skewed", dtype, seed=11)
    n, bi = offsets[1], tri.batch_info
    got = run(tri, w, y, offsets, ranks, scalings, full, "silu", False)
    two = lora_expand(y, w.b, offsets, ranks, scalings, full[:, :2 * n].clone(), bi.sorted_token_ids, bi.chunk_slot,
                      bi.chunk_start, bi.chunk_len, block_m=bi.block_m, b_offs=w.b_offs, b_align=w.align, wide=False)
    assert torch.equal(got, act_mul(two[:, :n], two[:, n:], "silu"))


def test_stale_plan_rows_get_the_product_without_a_delta():
    """Tables of fewer slots than the plan uses (a plan left from before a pool shrank): the rows of
    the missing slots get ``act(gate) * up`` and nothing read past the tables."""
    from peft_fastlora.ops import act_mul_reference

    dtype = torch.float32
    offsets, ranks, scalings, y, b, full, w, tri, ref = inputs("wide_mixed", "one_row_each", dtype, seed=3)
    n, kept = offsets[1], 2
    w.a_rows, w.b_offs = w.a_rows[:kept], w.b_offs[:kept]
    got = run(tri, w, y, offsets, ranks[:kept], scalings[:kept], full, "silu", False)
    tok = torch.tensor(COMPOSITIONS["one_row_each"])
    stale = tok >= kept
    plain = act_mul_reference(full[:, :n], full[:, n:2 * n], "silu")
    assert torch.allclose(got[stale], plain[stale], atol=1e-6, rtol=1e-6)
    want = reference(ref, y, b, offsets, ranks, scalings, full, "silu")
    assert_close(got[~stale], want[~stale], 1e-5, 1e-5, "rows of the slots kept")
    assert not torch.allclose(got[tok == 0], plain[tok == 0]), "slot 0's delta is missing"


def test_bad_inputs_name_the_problem():
    offsets, ranks, scalings, y, b, full, w, tri, ref = inputs("narrow_r16", "one_row_each", torch.float32, seed=1)
    n = offsets[1]
    with pytest.raises(ValueError, match="unknown gated activation"):
        run(tri, w, y, offsets, ranks, scalings, full, "relu", False)
    with pytest.raises(ValueError, match=r"offsets must be \(0, n, 2n\)"):
        run(tri, w, y, [0, n, 2 * n + 1], ranks, scalings, full, "silu", False)
    with pytest.raises(ValueError, match="must be \\(s, >= "):
        run(tri, w, y, offsets, ranks, scalings, full[:, :2 * n - 1], "silu", False)
    with pytest.raises(ValueError, match="out"):
        run(tri, w, y, offsets, ranks, scalings, full, "silu", False, out=torch.empty(full.shape[0], n + 1))
    with pytest.raises(ValueError, match="expected 2 x rank"):
        run(tri, w, y[:, 1:], offsets, ranks, scalings, full, "silu", False)
    with pytest.raises(ValueError, match="ranks must be"):
        run(tri, w, y, offsets, ranks[:, :1], scalings, full, "silu", False)


# ---- in a model: the gated MLP asks its LoRA gate/up site ----------------------------------------
def _decode_kwargs():
    return dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def _same_decode(got, want):
    """PEFT's tokens, and its logits to float32 rounding (a wrong MLP term moves a tiny random
    model's logits too little to change every argmax)."""
    assert torch.equal(got.sequences, want.sequences)
    a, b = torch.stack(got.logits).float(), torch.stack(want.logits).float()
    assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()


@pytest.mark.parametrize("on", [True, False])
def test_lora_gate_up_gives_the_activation_from_its_expand_with_peft_tokens(monkeypatch, on):
    """A folded LoRA gate/up under the one-kernel activation: decode steps take ``act(gate) * up``
    from the expand (no act-mul kernel, no separate expand for gate/up), rows of two adapters and
    none; PEFT's tokens and logits. Off (``GATED_EXPAND``): the MLP calls its members as before."""
    import peft_fastlora as fastlora
    import peft_fastlora.lora.sites as sites
    from _helpers import count_calls
    from _models import left_padded_batch, tiny_peft_llama

    glu_ops = importlib.import_module("peft_fastlora.ops")  # (the backend launches it through the package)
    silu_ops = importlib.import_module("peft_fastlora.ops.silu_mul")
    monkeypatch.setattr(sites, "GATED_EXPAND", on)
    model = tiny_peft_llama(third_adapter=True)
    batch, names = left_padded_batch([5, 9, 3, 4], seed=3), ["a", "__base__", "c", "a"]
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **_decode_kwargs())
    calls = count_calls(monkeypatch, glu_ops, ["lora_expand_glu"])
    acts = count_calls(monkeypatch, silu_ops, ["act_mul"])
    with fastlora.patched(model, backend="triton", fold_shrink=True, fuse_silu_mul=True,
                          cuda_graphs="emulate") as report:
        layers = model.config.num_hidden_layers
        assert f"act-mul x{layers} ({layers} in the LoRA gate/up expand)" in str(report), report
        with torch.no_grad():
            got = model.generate(**batch, adapter_names=names, **_decode_kwargs())
    _same_decode(got, want)
    steps = _decode_kwargs()["max_new_tokens"] - 1  # decode steps after the prefill (which keeps the shrink kernel)
    if on:
        assert calls["lora_expand_glu"] >= layers * steps, calls
    else:
        assert calls["lora_expand_glu"] == 0 and acts["act_mul"] >= layers * steps
    assert not any("_fastlora_lora_gated" in m.__dict__ for m in model.modules())


def test_members_called_where_the_site_cannot_give_it(monkeypatch):
    """A forward hook on gate_proj (the one-call path would skip it) and the torch backend (no
    launch): the MLP calls gate_proj and up_proj, and the hook sees every call."""
    import peft_fastlora as fastlora
    from _helpers import count_calls
    from _models import left_padded_batch, tiny_peft_llama

    glu_ops = importlib.import_module("peft_fastlora.ops")
    model = tiny_peft_llama()
    batch, names = left_padded_batch([4, 6], seed=1), ["a", "b"]
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **_decode_kwargs())
    calls = count_calls(monkeypatch, glu_ops, ["lora_expand_glu"])
    gate = model.base_model.model.model.layers[0].mlp.gate_proj
    for backend, hooked in (("triton", True), ("torch_native", False)):
        seen = []
        handle = gate.register_forward_hook(lambda m, i, o: seen.append(1)) if hooked else None
        try:
            with fastlora.patched(model, backend=backend, fold_shrink=True, fuse_silu_mul=True, cuda_graphs="emulate"):
                with torch.no_grad():
                    got = model.generate(**batch, adapter_names=names, **_decode_kwargs())
        finally:
            if handle is not None:
                handle.remove()
        _same_decode(got, want)
        if hooked:
            assert len(seen) >= _decode_kwargs()["max_new_tokens"]
    # the hooked layer's MLP kept its members; the others took the launch (triton), none with torch_native
    assert calls["lora_expand_glu"] > 0
