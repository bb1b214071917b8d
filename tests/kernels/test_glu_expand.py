"""``ops.glu_expand``: a gate/up site's expand and the gated activation in one launch, against its
torch reference and, in float32 and float16, against the two launches it replaces (``lora_expand``
into the base output, then ``act_mul``). Under Triton's interpreter: tiles of one adapter (the
straight path) and tiles across sequences (the loop over slots), mixed ranks, a rank past one rank
block, an adapter on one module only, rows with no adapter, tiles and widths that are no tile
multiple; the packed B arena NaN outside its blocks and the shrink's output NaN past each rank and
in rows of no adapter, so that any read of them shows. ``test_glu_expand_gpu.py`` runs the 8B
shapes on the GPU."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.backend.packed import PackedWeights  # noqa: E402
from peft_fastlora.backend.torch_native import TorchNativeLoRABackend  # noqa: E402
from peft_fastlora.backend.triton import TritonLoRABackend  # noqa: E402
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode, plan_chunks  # noqa: E402
from peft_fastlora.kernel_support import interpreting  # noqa: E402
from peft_fastlora.ops import act_mul, act_mul_reference, lora_expand  # noqa: E402
from peft_fastlora.ops.glu_expand import glu_expand, glu_expand_reference, rank_block  # noqa: E402

from _helpers import pack  # noqa: E402
from test_triton_kernels import assert_close  # noqa: E402

# (dtype, atol, rtol): both sides sum in float32 and round at the same places, so float32 differs by
# summation order and the 16-bit dtypes by a unit of a rounding that fell the other way (float16's
# unit is 2^-10 of a value, bfloat16's 2^-7)
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 5e-3, 5e-3),
    (torch.bfloat16, 1e-2, 1.6e-2),
]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# (gate rank, up rank) per slot; the last slot never appears in a batch (its blocks stay unread)
RANKS = {
    "aligned": [(8, 8), (16, 0), (24, 16), (64, 64), (0, 8), (16, 16)],  # 16-byte B loads
    "odd": [(5, 5), (12, 0), (3, 7), (0, 9), (8, 8)],  # blocks at any element
}
# (sequence lengths, slot of each sequence): with 16-row tiles, the long sequences fill whole tiles
# (the straight path) and the short ones share tiles (the loop), with rows of no adapter
LAYOUTS = {
    "prefill": ([40, 3, 21, 1, 9], [0, 1, NO_ADAPTER, 3, 2]),
    "decode": ([1] * 19, [0, 1, NO_ADAPTER, 2, 3, 4, 0, 0, 2, NO_ADAPTER, 1, 3, 3, 4, 2, 0, 1, NO_ADAPTER, 4]),
}
N = 40  # gate's and up's width: no multiple of the small tiles' 32 columns


def truncated(t):
    """float32 to bfloat16's values as Triton's interpreter casts: the low 16 bits dropped."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def glu_case(ranks, layout, dtype, n=N, seed=0):
    """The launcher's operands for a site of ``ranks`` (``RANKS``) and a batch laid out as
    ``LAYOUTS[layout]`` (or a (lengths, slots) pair), as ``lora.pool`` and the shrink leave them."""
    g = torch.Generator().manual_seed(seed)
    lens, seq_slots = LAYOUTS[layout] if isinstance(layout, str) else layout
    num_slots = len(ranks)
    r = max(max(p) for p in ranks)
    table = torch.tensor(ranks, dtype=torch.int32)
    b = (torch.randn(num_slots, 2 * n, r, generator=g) / 4).to(dtype)
    w = pack(torch.zeros(num_slots, 2 * r, 1, dtype=dtype), b, [0, n, 2 * n], table, seed=seed)
    tok = torch.tensor([sl for sl, k in zip(seq_slots, lens) for _ in range(k)], dtype=torch.int32)
    s = tok.shape[0]
    y = torch.randn(s, 2 * r, generator=g)
    for t, sl in enumerate(tok.tolist()):  # the shrink writes only a slot's own rank columns
        if sl < 0:
            y[t] = float("nan")
        else:
            y[t, int(table[sl, 0]): r] = float("nan")
            y[t, r + int(table[sl, 1]):] = float("nan")
    scalings = (torch.rand(num_slots, 2, generator=g) + 0.5).float()
    scalings[table == 0] = float("nan")  # a module of rank 0: its scaling is never applied
    return dict(y=y.to(dtype), b=w.b, b_offs=w.b_offs, ranks=table, scalings=scalings,
                token_slot=torch.cat([tok, torch.zeros(3, dtype=torch.int32)]),  # entries past s: unread
                gate_up=torch.randn(s, 2 * n, generator=g).to(dtype), max_rank=r, b_align=w.align), (lens, seq_slots)


def reference(case, act="silu"):
    bf16_here = interpreting() and case["gate_up"].dtype == torch.bfloat16
    return glu_expand_reference(**case, act=act, rounding=truncated if bf16_here else None)


def two_launches(case, lens, seq_slots, act="silu", block_m=16):
    """What the site ran before: the expand into the base output, then the activation."""
    n = case["gate_up"].shape[1] // 2
    plan = [torch.as_tensor(a, dtype=torch.int32) for a in plan_chunks(seq_slots, lens, block_m)[1:5]]
    out = case["gate_up"].clone()
    lora_expand(case["y"], case["b"], [0, n, 2 * n], case["ranks"], case["scalings"], out, *plan, block_m=block_m,
                b_offs=case["b_offs"], b_align=case["b_align"], max_rank=case["max_rank"], wide=False)
    return act_mul(out[:, :n], out[:, n:], act)


@pytest.mark.parametrize("tiles", [(16, 32), (64, 128)], ids=["small_tiles", "default_tiles"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_matches_reference(dtype, atol, rtol, ranks, layout, tiles):
    case, (lens, seq_slots) = glu_case(RANKS[ranks], layout, dtype)
    got = glu_expand(**case, block_m=tiles[0], block_n=tiles[1])
    assert got.shape == (case["gate_up"].shape[0], N) and got.dtype == dtype and got.is_contiguous()
    assert not got.isnan().any(), "read past a rank, outside a block, or a row of no adapter's y"
    assert_close(got, reference(case), atol, rtol, f"glu_expand against its reference ({ranks}, {layout})")
    if dtype != torch.bfloat16:  # (the interpreter's bfloat16 expand is not upcast: the GPU tier checks it)
        assert_close(got, two_launches(case, lens, seq_slots), atol, rtol, "against the expand, then act_mul")
    # the deltas are there: without them the result is the base output's activation
    plain = act_mul(case["gate_up"][:, :N], case["gate_up"][:, N:])
    assert (got.float() - plain.float()).abs().max() > 0.05


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_gelu_tanh(dtype, atol, rtol):
    case, (lens, seq_slots) = glu_case(RANKS["aligned"], "prefill", dtype, seed=1)
    got = glu_expand(**case, act="gelu_tanh", block_m=16, block_n=32)
    assert_close(got, reference(case, "gelu_tanh"), atol, rtol, "gelu_tanh")


@pytest.mark.parametrize("block_r", [16, None], ids=["blocks_of_16", "blocks_of_64"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[:2], ids=DTYPE_IDS[:2])
def test_ranks_past_one_rank_block(dtype, atol, rtol, block_r):
    """Ranks 24 and 64 in blocks of 16 (2 and 4 rank steps); ranks 80 and 72 in blocks of 64
    (``rank_block``'s largest); one tile of one adapter, one of several."""
    ranks = [(24, 64), (80, 72), (16, 8)] if block_r is None else [(24, 64), (64, 24), (16, 8)]
    case, (lens, seq_slots) = glu_case(ranks, ([20, 5, 7], [0, 1, 2]), dtype, seed=2)
    assert (block_r or rank_block(case["max_rank"])) < case["max_rank"]
    got = glu_expand(**case, block_m=16, block_n=32, block_r=block_r)
    assert_close(got, reference(case), atol, rtol, "rank blocks")
    assert_close(got, two_launches(case, lens, seq_slots), atol, rtol, "rank blocks, against the two launches")


def test_strided_base_rows_of_no_adapter_and_stale_slots():
    """The base output a view with a wider row stride; tiles of no adapter at all (the activation
    alone); a slot at or past the tables' end reads nothing (as the expand, a stale plan's)."""
    case, _ = glu_case(RANKS["odd"], ([16, 16, 9], [NO_ADAPTER, 0, 1]), torch.float32, seed=3)
    s = case["gate_up"].shape[0]
    wide = torch.randn(s, 2 * N + 5)
    wide[:, : 2 * N] = case["gate_up"]
    case["gate_up"] = wide[:, : 2 * N]
    case["token_slot"][16:20] = case["b_offs"].shape[0]  # past the tables
    got = glu_expand(**case, block_m=16, block_n=32)
    assert_close(got, reference(case), 1e-5, 1e-5, "strided base")
    plain = act_mul(case["gate_up"][:, :N], case["gate_up"][:, N:])
    assert torch.equal(got[:20], plain[:20]), "rows of no adapter (or a stale slot) are the activation alone"


def test_no_tokens():
    case, _ = glu_case(RANKS["odd"], "decode", torch.float32)
    for key in ("y", "gate_up"):
        case[key] = case[key][:0]
    assert glu_expand(**case).shape == (0, N)


def _bad(change):
    case, _ = glu_case(RANKS["odd"], "decode", torch.float32)
    for key, value in change.items():
        case[key] = value(case[key]) if callable(value) else value
    return case


@pytest.mark.parametrize("change, pattern", [
    (dict(act="relu"), "unknown gated activation 'relu'"),
    (dict(gate_up=lambda t: t[:, :-1]), r"gate_up must be a float \(s, 2n\)"),
    (dict(gate_up=lambda t: t.long()), r"gate_up must be a float \(s, 2n\)"),
    (dict(y=lambda t: t[:, :-1]), r"y must be \(19, 24\)"),
    (dict(y=lambda t: t.half()), r"y must be \(19, 24\) torch.float32"),
    (dict(max_rank=0), "max_rank must be a positive int, got 0"),
    (dict(max_rank=9.0), "max_rank must be a positive int, got 9.0"),
    (dict(b_offs=lambda t: t[:, :1]), r"b_offs must be \(num_slots, 2\)"),
    (dict(ranks=lambda t: t.long()), "ranks must be torch.int32"),
    (dict(ranks=lambda t: t[:2]), r"ranks must be torch.int32 \(>= 5, 2\)"),
    (dict(scalings=lambda t: t.double()), "scalings must be torch.float32"),
    (dict(token_slot=lambda t: t.long()), "token_slot must be int32"),
    (dict(token_slot=lambda t: t[:5]), "token_slot must be int32 with at least 19 entries"),
    (dict(b=lambda t: t.view(1, -1)), "b must be a flat contiguous"),
    (dict(b_align=4), "b_align must be 1 or 8, got 4"),
    (dict(block_m=48), "block_m must be a power of 2 of at least 16, got 48"),
    (dict(block_n=8), "block_n must be a power of 2 of at least 16, got 8"),
    (dict(block_r=32.0), "block_r must be a power of 2"),
    (dict(num_warps=3), "num_warps must be a power of 2"),
    (dict(num_stages=0), "num_stages must be a positive int"),
])
def test_bad_operands_raise_a_clear_error(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        glu_expand(**_bad(change))


def test_more_row_tiles_than_a_grid_takes(monkeypatch):
    """(The grid's bound lowered: a forward of millions of tokens is no CPU test.)"""
    case, _ = glu_case(RANKS["odd"], "decode", torch.float32)
    monkeypatch.setattr(importlib.import_module("peft_fastlora.ops.glu_expand"), "MAX_ROW_TILES", 1)
    with pytest.raises(ValueError, match="19 tokens make 2 row tiles of 16; a launch takes at most 1 "):
        glu_expand(**case, block_m=16)


def test_rank_block():
    assert [rank_block(r) for r in (1, 16, 17, 24, 64, 65, 256)] == [16, 16, 32, 32, 64, 64, 64]


def _backend_site(dtype=torch.float32, k=24, seed=4):
    """A packed gate/up site (``RANKS["aligned"]``, A too) and both backends prepared for the
    prefill layout: the shrink runs through the backend."""
    g = torch.Generator().manual_seed(seed)
    ranks = RANKS["aligned"]
    lens, seq_slots = LAYOUTS["prefill"]
    r = max(max(p) for p in ranks)
    table = torch.tensor(ranks, dtype=torch.int32)
    a = (torch.randn(len(ranks), 2 * r, k, generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(len(ranks), 2 * N, r, generator=g) / 4).to(dtype)
    w = pack(a, b, [0, N, 2 * N], table, seed=seed)
    scalings = (torch.rand(len(ranks), 2, generator=g) + 0.5).float()
    fb = ForwardBatch(len(lens), lens, ForwardMode.EXTEND, torch.device("cpu"))
    backends = []
    for cls in (TritonLoRABackend, TorchNativeLoRABackend):
        be = cls(len(ranks), torch.device("cpu"))
        be.prepare_lora_batch(fb, seq_slots, [max(p) for p in ranks], [1.0] * len(ranks), use_cuda_graph=False)
        backends.append(be)
    x = torch.randn(sum(lens), k, generator=g).to(dtype)
    base = torch.randn(sum(lens), 2 * N, generator=g).to(dtype)
    return backends, w, x, base, dict(layer_ranks=table, layer_scalings=scalings)


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES[:2], ids=DTYPE_IDS[:2])
def test_backend_method_equals_the_packed_lora_then_the_activation(dtype, atol, rtol):
    """``TritonLoRABackend.run_packed_glu``: the shrink, then the kernel; the torch backend's
    ``run_packed_lora`` into the base output, then torch's activation, gives the same."""
    (tri, ref), w, x, base, tables = _backend_site(dtype)
    got = tri.run_packed_glu(x, w, base, "silu", **tables)
    projected = ref.run_packed_lora(x, w, base_output=base.clone(), **tables)
    assert_close(got, act_mul_reference(projected[:, :N], projected[:, N:]), atol, rtol, "run_packed_glu")


def test_backend_method_takes_only_a_gate_up_site():
    """A site of other than two modules of one width, one with a LoRA bias, an input that is not
    (tokens, width) or a base output of another shape: refused with the reason."""
    (tri, _), w, x, base, tables = _backend_site()
    three = PackedWeights(w.a, w.b, w.a_rows, w.b_offs, w.max_rank, (0, N, 2 * N - 1), align=w.align)
    with pytest.raises(ValueError, match=r"a gate/up site of two modules of one width.*\(0, 40, 79\)"):
        tri.run_packed_glu(x, three, base[:, :-1], "silu", **tables)
    biased = PackedWeights(w.a, w.b, w.a_rows, w.b_offs, w.max_rank, w.offsets, align=w.align,
                           bias=torch.zeros(w.num_slots, 2 * N))
    with pytest.raises(ValueError, match="without LoRA bias or DoRA, got offsets \\(0, 40, 80\\) and a LoRA bias"):
        tri.run_packed_glu(x, biased, base, "silu", **tables)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        tri.run_packed_glu(x[None], w, base, "silu", **tables)
    with pytest.raises(ValueError, match=r"base_output must be \(74, 80\)"):
        tri.run_packed_glu(x, w, base[:, :-2], "silu", **tables)
    with pytest.raises(TypeError, match="the base output is torch.float16, the input torch.float32"):
        tri.run_packed_glu(x, w, base.half(), "silu", **tables)
    with pytest.raises(ValueError, match="unknown gated activation 'gelu'"):
        tri.run_packed_glu(x, w, base, "gelu", **tables)
