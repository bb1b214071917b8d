"""The expand's epilogues: the LoRA B bias (PEFT's ``lora_bias``, added before the scaling) and
DoRA's column scale and shift (``(base + delta) * scale + shift``), in every launch that adds a
delta (the fused decode kernel, the wide and the column-block expand, the folded site's expand from
the base GEMM's columns) and in the torch backend, against the delta without them plus the
epilogue applied by hand for the rows whose slot targets the module. Under the Triton
interpreter, as test_packed_kernels (NaN outside the packed blocks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.ops import lora_expand  # noqa: E402

from _helpers import pack  # noqa: E402
from test_triton_fused import FUSED_SITES, fused_calls, run_fused_site, site_inputs  # noqa: E402,F401
from test_triton_kernels import (  # noqa: E402
    COMPOSITIONS,
    DTYPE_IDS,
    TOLERANCES,
    assert_close,
    check_untouched,
    make_backends,
    token_slots,
)


def bias_table(offsets, num_slots, dtype, seed):
    """(num_slots, N): random biases, except slot 2's (zeros: an adapter trained without one)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(num_slots, offsets[-1], generator=g).to(dtype)
    bias[2] = 0
    return bias


def dora_tables(offsets, num_slots, seed):
    """(scale, shift) float32: random for every slot but slot 2's (ones and zeros: a plain adapter)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(num_slots, offsets[-1], generator=g) + 0.5
    shift = torch.randn(num_slots, offsets[-1], generator=g)
    scale[2], shift[2] = 1.0, 0.0
    return scale, shift


def expected(delta_out, tok, ranks, scalings, offsets, bias=None, dora=None):
    """``delta_out`` (base plus the scaled delta) with, where the token's slot targets the module
    (rank > 0), ``scaling * bias`` added and then DoRA's ``* scale + shift``: slot 1 has no module
    1, so its (nonzero) entries there must not act."""
    out = delta_out.float().clone()
    for t, s in enumerate(tok.tolist()):
        for j in range(len(offsets) - 1):
            if s >= 0 and int(ranks[s, j]) > 0:
                lo, hi = offsets[j], offsets[j + 1]
                if bias is not None:
                    out[t, lo:hi] += float(scalings[s, j]) * bias[s, lo:hi].float()
                if dora is not None:
                    out[t, lo:hi] = out[t, lo:hi] * dora[0][s, lo:hi] + dora[1][s, lo:hi]
    return out.to(delta_out.dtype)


# both compositions have rows of no adapter (left untouched); the skewed one with both tables only
# (a layer serving a DoRA adapter beside a bias one)
@pytest.mark.parametrize("comp,epilogue", [("mixed", "bias"), ("mixed", "dora"), ("mixed", "bias_and_dora"),
                                           ("skewed", "bias_and_dora")])
@pytest.mark.parametrize("path", ["fused", "wide", "prefill", "folded", "column_blocks"])
@pytest.mark.parametrize("site", list(FUSED_SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_epilogue_in_every_expand(dtype, atol, rtol, site, comp, path, epilogue, fused_calls):
    seq_lens = [3, 17, 1, 9, 6] if path == "prefill" else [1] * 20
    wi = COMPOSITIONS[comp](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    tri.fused_decode = path == "fused"
    tok = token_slots(wi, seq_lens)
    offsets = FUSED_SITES[site]
    x, a, b, base, ranks, scalings = site_inputs(site, tok, dtype)
    bias = bias_table(offsets, a.shape[0], dtype, seed=len(site) + len(comp)) if "bias" in epilogue else None
    dora = dora_tables(offsets, a.shape[0], seed=len(comp)) if "dora" in epilogue else None
    w = dataclasses.replace(pack(a, b, offsets, ranks, seed=len(site)), bias=bias, dora=dora)
    want = expected(run_fused_site(ref, site, x, a, b, base.clone(), ranks, scalings), tok, ranks, scalings,
                    offsets, bias, dora)
    for be, name in ((tri, "triton"), (ref, "torch")):
        kw = dict(base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
        if path == "column_blocks" and be is tri:  # the expand's other launch (prefill-sized row tiles)
            bi = tri.batch_info
            got = lora_expand(x @ w.a.T, w.b, w.offsets, ranks, scalings, kw["base_output"], bi.sorted_token_ids,
                              bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=bi.block_m, b_offs=w.b_offs,
                              b_align=w.align, y_cols=w.a_rows, max_rank=w.max_rank, wide=False, bias=bias,
                              dora=dora)
        elif path in ("folded", "column_blocks"):  # the shrink from the base GEMM: x @ [W; A].T's columns
            got = be.run_packed_expand(x @ w.a.T, w, **kw)
        else:
            got = be.run_packed_lora(x, w, **kw)
        assert not got.isnan().any(), f"{name}: read outside a block or past a table's row"
        check_untouched(got, base, tok)
        assert_close(got, want, atol, rtol, f"{name} {site} with {epilogue} ({comp}, {path})")
    assert fused_calls == ([16] if path == "fused" else [])


def _bad_tables(num_slots, n):
    """(field, value, what the error names): tables of the wrong width, dtype or layout."""
    return [("bias", torch.zeros(num_slots, 5), "bias"),
            ("bias", torch.zeros(num_slots, n, dtype=torch.float16), "bias"),
            ("bias", torch.zeros(n, num_slots).T, "bias"),
            ("dora", (torch.ones(num_slots, n), torch.zeros(num_slots, 5)), "dora"),
            ("dora", (torch.ones(num_slots, n, dtype=torch.float16), torch.zeros(num_slots, n)), "dora")]


@pytest.mark.parametrize("case", range(5))
def test_tables_of_the_wrong_shape_are_refused(case):
    seq_lens, wi = [1] * 4, [0, 1, -1, 3]
    tri, ref = make_backends(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs("qkv", token_slots(wi, seq_lens), torch.float32)
    w = pack(a, b, FUSED_SITES["qkv"], ranks)
    field, value, named = _bad_tables(a.shape[0], FUSED_SITES["qkv"][-1])[case]
    for be in (tri, ref):
        with pytest.raises(ValueError, match=named):
            be.run_packed_lora(x, dataclasses.replace(w, **{field: value}), base_output=base.clone(),
                               layer_ranks=ranks, layer_scalings=scalings)


@pytest.mark.parametrize("table,match", [
    (dict(bias=torch.zeros(3, 9)), "bias must be"),
    (dict(dora=(torch.ones(3, 10), torch.zeros(3, 9))), "dora shift must be"),
    (dict(dora=(torch.ones(3, 10), torch.zeros(6, 10)[::2])), "share a row stride"),
])
def test_launchers_check_the_epilogue_tables(table, match):
    y, bt = torch.zeros(2, 8), torch.zeros(3, 10, 8)
    plan = [torch.zeros(2, dtype=torch.int32)] * 4
    with pytest.raises(ValueError, match=match):
        lora_expand(y, bt, [0, 10], torch.ones(3, 1, dtype=torch.int32), torch.ones(3, 1), torch.zeros(2, 10),
                    *plan, block_m=16, **table)
