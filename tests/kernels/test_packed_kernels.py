"""Packed weights (each adapter at its own rank, only for the modules it targets): the Triton
kernels (fused decode launch, and shrink + expand) and the torch backend against the torch
backend on the same weights stored padded. Under the Triton interpreter, as test_triton_kernels.

The arenas are filled with NaN outside the placed blocks and the blocks placed in shuffled order
with gaps, so a read of another slot's block, past a rank or outside an extent shows as a NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.backend.packed import PackedWeights, block_align  # noqa: E402

from _helpers import pack  # noqa: E402
from test_triton_fused import FUSED_SITES, fused_calls, run_fused_site, site_inputs  # noqa: E402,F401
from test_triton_kernels import (  # noqa: E402
    COMPOSITIONS,
    DTYPE_IDS,
    K,
    TOLERANCES,
    assert_close,
    check_untouched,
    layer_tables,
    make_backends,
    poisoned_base,
    token_slots,
)


def run_packed(be, w, x, base, ranks, scalings):
    return be.run_packed_lora(x, w, base_output=base, layer_ranks=ranks, layer_scalings=scalings)


@pytest.mark.parametrize("path", ["fused", "two_kernels", "prefill"])
@pytest.mark.parametrize("comp", ["mixed", "skewed", "all_base"])
@pytest.mark.parametrize("site", list(FUSED_SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_packed_equals_padded(dtype, atol, rtol, site, comp, path, fused_calls):
    """Mixed ranks (1 to 64, one module of rank 0), rows with no adapter, NaN outside the blocks:
    the packed result equals the padded one, by the kernels and by the torch backend."""
    seq_lens = [3, 17, 1, 9, 6] if path == "prefill" else [1] * 20
    wi = COMPOSITIONS[comp](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    tri.fused_decode = path == "fused"
    tok = token_slots(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs(site, tok, dtype)
    w = pack(a, b, FUSED_SITES[site], ranks, seed=len(site))
    want = run_fused_site(ref, site, x, a, b, base.clone(), ranks, scalings)  # padded, torch
    got = run_packed(tri, w, x, base.clone(), ranks, scalings)
    assert fused_calls == ([16] if path == "fused" else [])
    assert not got.isnan().any(), "read outside a block (another slot, past a rank, a gap)"
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, f"triton packed {site} ({comp}, {path})")
    ref_packed = run_packed(ref, w, x, base.clone(), ranks, scalings)
    assert_close(ref_packed, want, atol, rtol, f"torch packed {site} ({comp})")


def test_packed_k_not_a_tile_multiple_and_wide_rank():
    """K of 300 (5 splits of 64 in the fused kernel, the last partial) and rank 64 blocks."""
    from peft_fastlora.ops import lora_fused

    dtype, atol, rtol = TOLERANCES[0]
    seq_lens = [1] * 12
    wi = COMPOSITIONS["skewed"](12)
    tri, ref = make_backends(wi, seq_lens)
    bi = tri.batch_info
    x, a, b, base, ranks, scalings = site_inputs("qkv", token_slots(wi, seq_lens), dtype, k=300)
    w = pack(a, b, FUSED_SITES["qkv"], ranks, seed=3)
    got = lora_fused(x, w.a, w.b, w.offsets, ranks, scalings, base.clone(),
                     bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                     tri._workspace(torch.device("cpu")), block_m=bi.block_m, block_k=64, block_n=16,
                     num_programs=4, a_rows=w.a_rows, b_offs=w.b_offs, max_rank=w.max_rank)
    want = ref.run_qkv_lora(x, a, b, output_offset=FUSED_SITES["qkv"], base_output=base.clone(),
                            layer_ranks=ranks, layer_scalings=scalings)
    assert_close(got, want, atol, rtol, "fused packed, small tiles")


def test_packed_views_and_alignment():
    """Blocks take exactly their rank; views read back what was written; 16-byte alignment only
    where every rank is a multiple of 8."""
    assert block_align([8, 16, 64]) == 8 and block_align([8, 12]) == 1 and block_align([1]) == 1
    a = torch.zeros(40, 5)
    b = torch.zeros(3 * 16 + 2 * 8)
    w = PackedWeights(a, b, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int64),
                      16, (0, 3, 5))
    w.b_view(8, 1, 5).copy_(torch.arange(10.0).view(2, 5))
    assert torch.equal(b[8:18], torch.arange(10.0)) and not b[:8].any() and not b[18:].any()
    assert w.a_view(3, 5).shape == (5, 5) and w.a_view(3, 5).data_ptr() == a[3].data_ptr()


@pytest.mark.parametrize("path", ["fused", "two_kernels"])
def test_packed_aligned_ranks(path, fused_calls):
    """Every rank a multiple of 8 (align 8: the kernels load B's rows 16 bytes at a time)."""
    dtype, atol, rtol = TOLERANCES[1]
    seq_lens = [1] * 20
    wi = COMPOSITIONS["mixed"](20)
    tri, ref = make_backends(wi, seq_lens)
    tri.fused_decode = path == "fused"
    tok = token_slots(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs("qkv", tok, dtype)
    ranks = torch.where(ranks > 0, (ranks + 7) // 8 * 8, ranks).int().contiguous()
    a, b = a.nan_to_num(), b.nan_to_num()  # the rows the rounding added are zeros, not NaN
    w = pack(a, b, FUSED_SITES["qkv"], ranks, seed=5)
    assert w.align == 8 and not (w.b_offs % 8).any()
    want = run_fused_site(ref, "qkv", x, a, b, base.clone(), ranks, scalings)
    got = run_packed(tri, w, x, base.clone(), ranks, scalings)
    assert fused_calls == ([16] if path == "fused" else [])
    assert_close(got, want, atol, rtol, f"packed aligned ({path})")


@pytest.mark.parametrize("case", ["dtype", "width", "table_dtype", "table_shape", "slots"])
def test_packed_bad_inputs(case):
    dtype = torch.float32
    seq_lens, wi = [1] * 4, [0, 1, -1, 3]
    tri, ref = make_backends(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs("qkv", token_slots(wi, seq_lens), dtype)
    w = pack(a, b, FUSED_SITES["qkv"], ranks)
    error = ValueError
    if case == "dtype":
        w.a, error = w.a.half(), TypeError
    elif case == "width":
        x = torch.randn(4, K + 1)
    elif case == "table_dtype":
        w.a_rows = w.a_rows.long()
    elif case == "table_shape":
        w.b_offs = w.b_offs[:, :2].contiguous()
    else:
        w.a_rows, w.b_offs = w.a_rows[:2].contiguous(), w.b_offs[:2].contiguous()  # batch uses slot 3
    for be in (tri, ref):
        with pytest.raises(error):
            run_packed(be, w, x, base.clone(), ranks, scalings)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_packed_embedding_equals_padded(dtype, atol, rtol, mode):
    """A LoRA embedding on packed weights (blocks of (rank, vocab) rows, shuffled, NaN around
    them; mixed ranks, a slot that does not target it): the lookup and the expand equal the
    contract's two calls on the same weights padded, ids past the vocabulary included."""
    seq_lens = [1] * 9 if mode == "decode" else [3, 17, 1, 9, 6]
    wi = COMPOSITIONS["mixed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    tok = token_slots(wi, seq_lens)
    vocab, width = 101, 45
    ranks, scalings = layer_tables(1)
    ranks[2, 0] = 0  # an adapter that does not target the embedding
    a = torch.randn(len(ranks), 64, vocab).to(dtype)  # padded (num_slots, R, vocab)
    b = torch.randn(len(ranks), width, 64).to(dtype) / 4
    for s in range(len(ranks)):
        a[s, int(ranks[s, 0]):] = float("nan")
        b[s, :, int(ranks[s, 0]):] = float("nan")
    # packed: A blocks (rank, vocab) as rows; reuse pack() with the lookup's A as the "A" of a
    # one-module site whose K is the vocabulary
    w = pack(a, b, [0, width], ranks, seed=9)
    ids = torch.randint(0, vocab, (len(tok),))
    ids[-1] = vocab + 3  # past the vocabulary: no delta (the padded kernel reads zeros)
    base = poisoned_base(tok, width, dtype)
    got = tri.run_packed_embedding_lora(ids, w, vocab, base_output=base.clone(), layer_ranks=ranks,
                                        layer_scalings=scalings)
    y = tri.run_lora_a_embedding(ids, a.nan_to_num(), vocab)  # padded lookup, then the padded expand
    want = ref.run_lora_b_sgemm(y, b, base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
    assert not got.isnan().any(), "read outside a block"
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, f"packed embedding ({mode})")
    ref_packed = ref.run_packed_embedding_lora(ids, w, vocab, base_output=base.clone(), layer_ranks=ranks,
                                               layer_scalings=scalings)
    assert_close(ref_packed, want, atol, rtol, f"torch packed embedding ({mode})")


@pytest.mark.parametrize("comp", ["mixed", "skewed", "all_base"])
@pytest.mark.parametrize("site", list(FUSED_SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_packed_expand_from_folded_gemm_columns(dtype, atol, rtol, site, comp):
    """The expand alone, reading each (slot, module)'s shrink from the columns of its A rows in a
    GEMM over [W; A] (a strided view, NaN in the columns of gaps and unused rows): equals the
    padded shrink + expand, by the kernel and by the torch backend."""
    seq_lens = [1] * 20
    wi = COMPOSITIONS[comp](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    tok = token_slots(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs(site, tok, dtype)
    w = pack(a, b, FUSED_SITES[site], ranks, seed=len(site) + 1)
    want = run_fused_site(ref, site, x, a, b, base.clone(), ranks, scalings)
    n = base.shape[1]
    w_base = torch.randn(n, x.shape[1], dtype=dtype)
    full = (x.float() @ torch.cat([w_base, w.a]).float().T).to(dtype)  # rounded, as the GEMM's output
    y = full[:, n:]
    assert y.isnan().any() and not y.is_contiguous()
    for be, who in ((tri, "triton"), (ref, "torch")):
        got = be.run_packed_expand(y, w, base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
        assert not got.isnan().any(), f"{who}: read a column outside the slot's A rows"
        check_untouched(got, base, tok)
        assert_close(got, want, atol, rtol, f"{who} folded expand {site} ({comp})")


def test_packed_expand_bad_inputs():
    seq_lens = [1] * 4
    wi = COMPOSITIONS["mixed"](4)
    tri, _ = make_backends(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs("qkv", token_slots(wi, seq_lens), TOLERANCES[0][0])
    w = pack(a, b, FUSED_SITES["qkv"], ranks)
    y = torch.zeros(x.shape[0], w.a.shape[0], dtype=x.dtype)
    kw = dict(base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
    with pytest.raises(ValueError, match="one .* column per row of the packed A arena"):
        tri.run_packed_expand(y[:, :-1], w, **kw)
    with pytest.raises(ValueError, match="input has 3 tokens"):
        tri.run_packed_expand(y[:3], w, **kw)
    column_major = y.t().contiguous().t()
    with pytest.raises(ValueError, match="unit column stride"):
        tri.run_packed_expand(column_major, w, **kw)
