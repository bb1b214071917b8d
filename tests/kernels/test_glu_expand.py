"""``ops.glu_expand``: a gate/up site's expand and the gated activation in one launch, against the
two steps it replaces (the torch backend's packed expand into the base output, then torch's
activation and product) and against its own torch reference. Under the Triton interpreter, as
test_triton_kernels: packed arenas NaN outside their blocks, mixed ranks and a module of rank 0,
rows with no adapter, row tiles that hold several adapters, widths that are no tile multiple."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.ops import glu_expand, glu_expand_reference, lora_shrink  # noqa: E402
from peft_fastlora.ops.silu_mul import act_mul_reference  # noqa: E402

from _helpers import pack  # noqa: E402
from test_triton_kernels import (  # noqa: E402
    COMPOSITIONS,
    DTYPE_IDS,
    K,
    TOLERANCES,
    assert_close,
    layer_tables,
    make_a,
    make_b,
    make_backends,
    token_slots,
)

N = 37  # gate's and up's width: no tile multiple
SEQ_LENS = [3, 17, 1, 9, 6, 30]  # tiles of 16 rows that start in one sequence and end in another


def _site(comp, dtype, seed=0):
    torch.manual_seed(seed)
    offsets = [0, N, 2 * N]
    wi = COMPOSITIONS[comp](len(SEQ_LENS))
    tri, ref = make_backends(wi, SEQ_LENS)
    tok = token_slots(wi, SEQ_LENS)
    ranks, scalings = layer_tables(2)
    a, b = make_a(2, K, ranks, dtype), make_b(offsets, ranks, dtype)
    w = pack(a, b, offsets, ranks, seed=seed + 1)
    x = torch.randn(len(tok), K, dtype=dtype)
    base = torch.randn(len(tok), 2 * N, dtype=dtype)
    return tri, ref, w, x, base, ranks, scalings


def _shrink(tri, w, x, ranks):
    bi = tri.batch_info
    return lora_shrink(x, w.a, w.stack_num, ranks, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start,
                       bi.chunk_len, block_m=bi.block_m, a_rows=w.a_rows, max_rank=w.max_rank)


@pytest.mark.parametrize("tiles", [(16, 16), (64, 64)], ids=["small_tiles", "default_tiles"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("comp", ["mixed", "skewed", "uniform", "all_base"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_equals_the_expand_then_the_activation(dtype, atol, rtol, comp, act, tiles):
    tri, ref, w, x, base, ranks, scalings = _site(comp, dtype)
    y = _shrink(tri, w, x, ranks)
    got = glu_expand(y, w.b, w.b_offs, ranks, scalings, tri.batch_info.token_slot, base, act,
                     max_rank=w.max_rank, b_align=w.align, block_m=tiles[0], block_n=tiles[1])
    assert got.shape == (x.shape[0], N) and got.dtype == dtype and got.is_contiguous()
    assert not got.isnan().any(), "read outside a block (another slot, past a rank, a gap) or an unread row"
    projected = ref.run_packed_lora(x, w, base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
    assert_close(got, act_mul_reference(projected[:, :N], projected[:, N:], act), atol, rtol,
                 f"glu_expand against the expand, then {act} ({comp})")
    want = glu_expand_reference(y, w.b, w.b_offs, ranks, scalings, tri.batch_info.token_slot, base, act,
                                max_rank=w.max_rank, b_align=w.align)
    assert_close(got, want, atol, rtol, f"glu_expand against its reference ({comp})")
    if comp == "all_base":  # no adapter: the activation of the base output alone
        assert_close(got, act_mul_reference(base[:, :N], base[:, N:], act), atol, rtol, "all base rows")


def test_a_rank_past_one_rank_block_and_a_strided_base():
    """Rank 64 in blocks of 16 (four rank steps), the base output a view with a wider row stride."""
    dtype, atol, rtol = TOLERANCES[0]
    tri, ref, w, x, base, ranks, scalings = _site("skewed", dtype, seed=3)
    wide = torch.randn(base.shape[0], 2 * N + 5, dtype=dtype)
    wide[:, : 2 * N] = base
    y = _shrink(tri, w, x, ranks)
    got = glu_expand(y, w.b, w.b_offs, ranks, scalings, tri.batch_info.token_slot, wide[:, : 2 * N],
                     max_rank=w.max_rank, b_align=w.align, block_m=16, block_n=32, block_r=16)
    projected = ref.run_packed_lora(x, w, base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
    assert_close(got, act_mul_reference(projected[:, :N], projected[:, N:]), atol, rtol, "rank blocks, strided base")


@pytest.mark.parametrize("change, pattern", [
    (dict(act="relu"), "unknown gated activation"),
    (dict(gate_up=lambda t: t[:, :-1]), r"gate_up must be \(s, 2n\)"),
    (dict(y=lambda t: t[:, :-1]), "y must be"),
    (dict(token_slot=lambda t: t.long()), "token_slot must be int32"),
    (dict(ranks=lambda t: t.long()), "ranks must be"),
    (dict(max_rank=0), "max_rank must be positive"),
    (dict(block_k=64), r"unknown launch fields \['block_k'\]"),
])
def test_bad_operands_raise_a_clear_error(change, pattern):
    tri, _, w, x, base, ranks, scalings = _site("mixed", torch.float32)
    args = dict(y=_shrink(tri, w, x, ranks), b=w.b, b_offs=w.b_offs, ranks=ranks, scalings=scalings,
                token_slot=tri.batch_info.token_slot, gate_up=base, act="silu", max_rank=w.max_rank)
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    with pytest.raises(ValueError, match=pattern):
        glu_expand(**args)


def test_the_backend_takes_only_a_gate_up_site():
    """``TritonLoRABackend.run_packed_glu``: a site of other than two modules of one width, or an
    input that is not (tokens, width), is refused with the reason."""
    from peft_fastlora.backend.packed import PackedWeights

    tri, _, w, x, base, ranks, scalings = _site("mixed", torch.float32)
    kw = dict(layer_ranks=ranks, layer_scalings=scalings)
    three = PackedWeights(w.a, w.b, w.a_rows, w.b_offs, w.max_rank, (0, N, 2 * N - 1), align=w.align)
    with pytest.raises(ValueError, match=r"a gate/up site of two modules of one width.*\(0, 37, 73\)"):
        tri.run_packed_glu(x, three, base[:, :-1], "silu", **kw)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        tri.run_packed_glu(x[None], w, base, "silu", **kw)
    with pytest.raises(ValueError, match=r"base_output must be \(66, 74\)"):
        tri.run_packed_glu(x, w, base[:, :-2], "silu", **kw)
    got = tri.run_packed_glu(x, w, base, "silu", **kw)  # the same call, well formed
    assert got.shape == (x.shape[0], N) and not got.isnan().any()
