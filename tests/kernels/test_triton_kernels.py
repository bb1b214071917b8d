"""The Triton kernels (through ``TritonLoRABackend``) against the torch reference backend.

Runs on CPU under Triton's interpreter (conftest sets TRITON_INTERPRET=1 before any import of
triton). bf16 is not tested here: the interpreter stores it as raw uint16 (see DESIGN.md); the
GPU tier covers it. Shapes are small and odd on purpose; padded parts of every weight buffer and
the undefined part of every shrink output are NaN, so reading past an adapter's own rank, another
slot, or a row with no adapter shows up as a NaN in the result.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.backend.torch_native import TorchNativeLoRABackend  # noqa: E402
from peft_fastlora.backend.triton import TritonLoRABackend  # noqa: E402
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode  # noqa: E402

from _helpers import pack  # noqa: E402

# (dtype, atol, rtol): both sides accumulate in fp32 and round once, so fp32 differs only by
# summation order (observed < 1e-6) and fp16 by an ulp of a rounding that fell the other way
# (observed < 1e-3; 5e-3 is about 5 fp16 ulps)
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 5e-3, 5e-3),
]
DTYPE_IDS = ["fp32", "fp16"]

CPU = torch.device("cpu")
NUM_SLOTS = 5  # slot 4 is never used by a batch: its weights are all NaN
R = 64  # padded rank of the buffers
SLOT_RANKS = [1, 8, 16, 64, 16]
SLOT_SCALINGS = [0.5, 2.0, 1.0, 0.125, 3.0]
K = 53  # input dim: not a multiple of any block
MAX_LORAS = 4

COMPOSITIONS = {
    "uniform": lambda bs: [2] * bs,
    "mixed": lambda bs: [[0, NO_ADAPTER, 1, 2, 3][i % 5] for i in range(bs)],
    "skewed": lambda bs: [3] * (bs - 2) + [0, NO_ADAPTER],
    "all_base": lambda bs: [NO_ADAPTER] * bs,
}
MODES = {
    "decode": [1] * 7,
    "prefill": [3, 17, 1, 9, 6],  # 17 tokens of one row span two chunks of 16
}


# ---- helpers ---------------------------------------------------------------------------------
def assert_close(actual, expected, atol, rtol, name="", mask=None, show=8):
    """torch.allclose (a NaN anywhere is a mismatch), printing the first differing elements."""
    a, e = actual.detach().float(), expected.detach().float()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = ~((a - e).abs() <= atol + rtol * e.abs())
    if mask is not None:
        bad &= mask
    if bad.any():
        idx = bad.nonzero()
        lines = [f"{name}: {len(idx)} of {int(mask.sum()) if mask is not None else a.numel()} "
                 f"elements differ (atol={atol}, rtol={rtol}); first ones:"]
        for i in idx[:show].tolist():
            i = tuple(i)
            lines.append(f"  at {i}: got {a[i].item():.6g}, expected {e[i].item():.6g}, "
                         f"diff {abs(a[i].item() - e[i].item()):.3g}")
        raise AssertionError("\n".join(lines))


def make_backends(weight_indices, seq_lens, ranks=SLOT_RANKS, scalings=SLOT_SCALINGS):
    mode = ForwardMode.DECODE if all(n == 1 for n in seq_lens) else ForwardMode.EXTEND
    fb = ForwardBatch(len(seq_lens), list(seq_lens), mode, CPU)
    tri = TritonLoRABackend(MAX_LORAS, CPU)
    ref = TorchNativeLoRABackend(MAX_LORAS, CPU)
    for b in (tri, ref):
        b.prepare_lora_batch(fb, weight_indices, ranks, scalings, use_cuda_graph=False)
    return tri, ref


def layer_tables(c):
    """Per-(slot, module) ranks and scalings that differ from the slot defaults: slot 1 has no
    module 1 (an adapter without k; with one module, nothing at all), and with several modules
    slot 3 has a smaller rank on its last one."""
    ranks = torch.tensor(SLOT_RANKS, dtype=torch.int32)[:, None].repeat(1, c)
    ranks[1, min(1, c - 1)] = 0
    if c > 1:
        ranks[3, c - 1] = 8
    scalings = torch.tensor(SLOT_SCALINGS)[:, None] * (1.0 + 0.25 * torch.arange(c))[None, :]
    return ranks.contiguous(), scalings.float().contiguous()


def make_a(c, k, ranks, dtype):
    """(NUM_SLOTS, c*R, k): rows past each (slot, module) rank, and unused slot 4, are NaN."""
    a = torch.randn(NUM_SLOTS, c * R, k) / k ** 0.5
    for s in range(NUM_SLOTS):
        for j in range(c):
            a[s, j * R + int(ranks[s, j]) : (j + 1) * R] = float("nan")
    a[NUM_SLOTS - 1] = float("nan")
    return a.to(dtype)


def make_b(offsets, ranks, dtype):
    """(NUM_SLOTS, N, R): columns past each (slot, module) rank, and unused slot 4, are NaN."""
    b = torch.randn(NUM_SLOTS, offsets[-1], R) / 4
    for s in range(NUM_SLOTS):
        for j in range(len(offsets) - 1):
            b[s, offsets[j] : offsets[j + 1], int(ranks[s, j]) :] = float("nan")
    b[NUM_SLOTS - 1] = float("nan")
    return b.to(dtype)


def token_slots(weight_indices, seq_lens):
    return torch.tensor([w for w, n in zip(weight_indices, seq_lens) for _ in range(n)])


def defined_mask(tok_slot, ranks, c):
    """Where a shrink output is defined: rows with an adapter, the first rank columns of each module."""
    mask = torch.zeros(len(tok_slot), c * R, dtype=torch.bool)
    for t, s in enumerate(tok_slot.tolist()):
        if s >= 0:
            for j in range(c):
                mask[t, j * R : j * R + int(ranks[s, j])] = True
    return mask


def shrink_output_with_garbage(tok_slot, ranks, c, dtype):
    """A shrink output whose undefined region (see ``defined_mask``) is NaN."""
    y = torch.randn(len(tok_slot), c * R)
    y[~defined_mask(tok_slot, ranks, c)] = float("nan")
    return y.to(dtype)


def poisoned_base(tok_slot, n, dtype):
    """A base output whose rows with no adapter hold a value no delta could produce."""
    base = torch.randn(len(tok_slot), n)
    base[tok_slot < 0] = 1234.5
    return base.to(dtype)


def check_untouched(out, before, tok_slot):
    rows = tok_slot < 0
    assert torch.equal(out[rows], before[rows]), "rows with no adapter were modified"


# ---- shrink ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("comp", list(COMPOSITIONS))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_shrink(dtype, atol, rtol, comp, mode):
    seq_lens = MODES[mode]
    wi = COMPOSITIONS[comp](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    c = 3
    ranks, _ = layer_tables(c)
    tok = token_slots(wi, seq_lens)
    x = torch.randn(len(tok), K, dtype=dtype)
    a = make_a(c, K, ranks, dtype)
    got = tri.run_lora_a_sgemm(x, a, stack_num=c, layer_ranks=ranks)
    want = ref.run_lora_a_sgemm(x, a, stack_num=c, layer_ranks=ranks)
    mask = defined_mask(tok, ranks, c)
    assert not got[mask].isnan().any(), "the shrink read padding or another slot"
    assert_close(got, want, atol, rtol, "shrink", mask=mask)


@pytest.mark.parametrize("k", [64, 300], ids=["k_even", "k_two_tiles"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_shrink_default_ranks_and_k_tiles(dtype, atol, rtol, k):
    """No layer table (the batch's slot ranks apply); K a multiple of the K tile (the unmasked
    path), or longer than the decode K tile (256) with a partial last tile."""
    seq_lens, wi = [2, 1, 4, 1], [3, 0, 1, 2]
    tri, ref = make_backends(wi, seq_lens)
    ranks = torch.tensor(SLOT_RANKS, dtype=torch.int32)[:, None]
    tok = token_slots(wi, seq_lens)
    x = torch.randn(len(tok), k, dtype=dtype)
    a = make_a(1, k, ranks, dtype)
    got, want = tri.run_lora_a_sgemm(x, a), ref.run_lora_a_sgemm(x, a)
    assert_close(got, want, atol, rtol, "shrink", mask=defined_mask(tok, ranks, 1))


# ---- expand (lora B) ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("comp", list(COMPOSITIONS))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_lora_b_in_place(dtype, atol, rtol, comp, mode):
    seq_lens = MODES[mode]
    wi = COMPOSITIONS[comp](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    n = 77
    ranks, scalings = layer_tables(1)
    tok = token_slots(wi, seq_lens)
    y = shrink_output_with_garbage(tok, ranks, 1, dtype)
    b = make_b([0, n], ranks, dtype)
    base = poisoned_base(tok, n, dtype)
    out = base.clone()
    got = tri.run_lora_b_sgemm(y, b, base_output=out, layer_ranks=ranks, layer_scalings=scalings)
    want = ref.run_lora_b_sgemm(y, b, base_output=base.clone(), layer_ranks=ranks,
                                layer_scalings=scalings)
    assert got is out, "lora B must add into base_output in place and return it"
    assert not got.isnan().any(), "the expand read padding, an undefined shrink column or another slot"
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, "lora_b")


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_lora_b_without_base_output_and_strided_out(dtype, atol, rtol):
    seq_lens, wi = [1, 1, 1, 1, 1], [0, 3, NO_ADAPTER, 3, 1]
    tri, ref = make_backends(wi, seq_lens)
    ranks, scalings = layer_tables(1)
    tok = token_slots(wi, seq_lens)
    n = 45
    y = shrink_output_with_garbage(tok, ranks, 1, dtype)
    b = make_b([0, n], ranks, dtype)
    kw = dict(layer_ranks=ranks, layer_scalings=scalings)
    want = ref.run_lora_b_sgemm(y, b, **kw)
    assert_close(tri.run_lora_b_sgemm(y, b, **kw), want, atol, rtol, "lora_b (zero base)")
    # a base output that is a column slice of a wider tensor: row stride != N
    wide = torch.randn(len(tok), n + 10, dtype=dtype)
    before = wide.clone()
    view = wide[:, 3 : 3 + n]
    tri.run_lora_b_sgemm(y, b, base_output=view, **kw)
    expected = ref.run_lora_b_sgemm(y, b, base_output=before[:, 3 : 3 + n].clone(), **kw)
    assert_close(wide[:, 3 : 3 + n], expected, atol, rtol, "lora_b (strided)")
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + n :], before[:, 3 + n :])


# ---- fused sites -------------------------------------------------------------------------------
@pytest.mark.parametrize("b_form", ["tensor", "tuple"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_qkv(dtype, atol, rtol, mode, b_form):
    seq_lens = MODES[mode]
    wi = COMPOSITIONS["mixed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    q, kv = 40, 19
    offsets = [0, q, q + kv, q + 2 * kv]
    ranks, scalings = layer_tables(3)
    tok = token_slots(wi, seq_lens)
    x = torch.randn(len(tok), K, dtype=dtype)
    a = make_a(3, K, ranks, dtype)
    b = make_b(offsets, ranks, dtype)
    if b_form == "tuple":
        b = (b[None, :, :q].clone(), torch.stack([b[:, q : q + kv], b[:, q + kv :]]))
    base = poisoned_base(tok, offsets[-1], dtype)
    kw = dict(output_offset=offsets, layer_ranks=ranks, layer_scalings=scalings)
    got = tri.run_qkv_lora(x, a, b, base_output=base.clone(), **kw)
    want = ref.run_qkv_lora(x, a, b, base_output=base.clone(), **kw)
    assert not got.isnan().any()
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, f"qkv ({b_form} B)")


@pytest.mark.parametrize("b_form", ["tensor", "tuple"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_gate_up(dtype, atol, rtol, b_form):
    seq_lens = MODES["prefill"]
    wi = COMPOSITIONS["skewed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    n = 33
    ranks, scalings = layer_tables(2)
    tok = token_slots(wi, seq_lens)
    x = torch.randn(len(tok), K, dtype=dtype)
    a = make_a(2, K, ranks, dtype)
    b = make_b([0, n, 2 * n], ranks, dtype)
    if b_form == "tuple":
        b = (b[:, :n].clone(), b[:, n:].clone())
    base = poisoned_base(tok, 2 * n, dtype)
    kw = dict(layer_ranks=ranks, layer_scalings=scalings)
    got = tri.run_gate_up_lora(x, a, b, base_output=base.clone(), **kw)
    want = ref.run_gate_up_lora(x, a, b, base_output=base.clone(), **kw)
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, f"gate_up ({b_form} B)")


def test_five_stacked_modules():
    """More modules than one expand launch covers (4): the launcher splits them."""
    dtype, atol, rtol = TOLERANCES[0]
    seq_lens = MODES["decode"]
    wi = COMPOSITIONS["mixed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    offsets = [0, 16, 21, 50, 51, 70]
    ranks, scalings = layer_tables(5)
    tok = token_slots(wi, seq_lens)
    x = torch.randn(len(tok), K, dtype=dtype)
    a, b = make_a(5, K, ranks, dtype), make_b(offsets, ranks, dtype)
    kw = dict(output_offset=offsets, layer_ranks=ranks, layer_scalings=scalings)
    assert_close(tri.run_stacked_lora(x, a, b, **kw), ref.run_stacked_lora(x, a, b, **kw),
                 atol, rtol, "5 stacked modules")


@pytest.mark.parametrize("seq_lens,block_m", [([130, 150], 32), ([1100, 1000], 64)],
                         ids=["block_m32", "block_m64"])
def test_long_prefill_tiles(seq_lens, block_m):
    """Prefill sizes that select the larger row tiles (and their launch parameters)."""
    dtype, atol, rtol = TOLERANCES[1]
    wi = [3, 0]
    tri, ref = make_backends(wi, seq_lens)
    assert tri.batch_info.block_m == block_m
    offsets = [0, 24, 31, 38]
    ranks, scalings = layer_tables(3)
    tok = token_slots(wi, seq_lens)
    x = torch.randn(len(tok), K, dtype=dtype)
    a, b = make_a(3, K, ranks, dtype), make_b(offsets, ranks, dtype)
    base = torch.randn(len(tok), offsets[-1], dtype=dtype)
    kw = dict(output_offset=offsets, layer_ranks=ranks, layer_scalings=scalings)
    got = tri.run_qkv_lora(x, a, b, base_output=base.clone(), **kw)
    want = ref.run_qkv_lora(x, a, b, base_output=base.clone(), **kw)
    assert_close(got, want, atol, rtol, f"qkv prefill block_m={block_m}")


# ---- the launchers directly: tile loops, and what is written -----------------------------------
def launcher_case(comp, dtype, c=3, k=70):
    """A prefill batch of composition ``comp`` for the launchers: (the Triton backend's batch
    info, the torch backend, layer ranks, token slots, x, padded A)."""
    seq_lens = MODES["prefill"]
    wi = COMPOSITIONS[comp](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    ranks, _ = layer_tables(c)
    tok = token_slots(wi, seq_lens)
    return tri.batch_info, ref, ranks, tok, torch.randn(len(tok), k, dtype=dtype), make_a(c, k, ranks, dtype)


def test_shrink_launcher_small_tiles_writes_only_own_rank():
    """Small tile overrides force several K tiles (the last partial) and several rank blocks;
    outside its defined region the output buffer must keep what it held."""
    from peft_fastlora.ops import lora_shrink

    dtype, atol, rtol = TOLERANCES[0]
    c, sentinel = 3, 777.0
    bi, ref, ranks, tok, x, a = launcher_case("mixed", dtype, c)
    out = torch.full((len(tok), c * R), sentinel, dtype=dtype)
    lora_shrink(x, a, c, ranks, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                block_m=bi.block_m, out=out, block_k=16, block_r=16)
    want = ref.run_lora_a_sgemm(x, a, stack_num=c, layer_ranks=ranks)
    mask = defined_mask(tok, ranks, c)
    assert_close(out, want, atol, rtol, "shrink (small tiles)", mask=mask)
    assert (out[~mask] == sentinel).all(), "the shrink wrote past an adapter's rank or row"


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize("comp", ["mixed", "skewed", "all_base"])
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_shrink_split_k(dtype, atol, rtol, comp, split_k, layout):
    """K split over 2, 3 or 8 programs per tile (K of 70 in tiles of 16: five tiles, the last
    partial; with 8 splits three ranges are empty): mixed ranks and a module of rank 0, rows with
    no adapter, NaN past every rank and in the unused slot, both layouts of A. Equal to the torch
    reference, written only where defined, and the same as one split up to float32 rounding."""
    from peft_fastlora.ops import lora_shrink

    c, sentinel = 3, 777.0
    bi, ref, ranks, tok, x, a = launcher_case(comp, dtype, c)
    kw = dict(block_m=bi.block_m, block_k=16, block_r=16)
    weights = a
    if layout == "packed":
        w = pack(a, torch.zeros(NUM_SLOTS, 3 * 8, R, dtype=dtype), [0, 8, 16, 24], ranks, seed=split_k)
        weights, kw = w.a, dict(kw, a_rows=w.a_rows, max_rank=w.max_rank)
    plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
    one = lora_shrink(x, weights, c, ranks, *plan, out=torch.full((len(tok), c * R), sentinel, dtype=dtype), **kw)
    out = torch.full((len(tok), c * R), sentinel, dtype=dtype)
    lora_shrink(x, weights, c, ranks, *plan, out=out, split_k=split_k, **kw)
    want = ref.run_lora_a_sgemm(x, a, stack_num=c, layer_ranks=ranks)
    mask = defined_mask(tok, ranks, c)
    assert not out[mask].isnan().any(), "the shrink read padding or another slot"
    assert_close(out, want, atol, rtol, f"shrink split_k={split_k}", mask=mask)
    assert_close(out, one, atol, rtol, f"shrink split_k={split_k} against one split", mask=mask)
    assert (out[~mask] == sentinel).all(), "the shrink wrote past an adapter's rank or row"


@pytest.mark.parametrize("split_k", [0, -1, 2.5, True])
def test_shrink_split_k_not_a_positive_integer_is_refused(split_k):
    from peft_fastlora.ops import lora_shrink

    seq_lens, wi = [2, 3], [0, 1]
    tri, _ = make_backends(wi, seq_lens)
    bi = tri.batch_info
    ranks = torch.tensor(SLOT_RANKS, dtype=torch.int32)[:, None]
    with pytest.raises(ValueError, match="split_k must be an integer of at least 1"):
        lora_shrink(torch.randn(5, K), make_a(1, K, ranks, torch.float32), 1, ranks, bi.sorted_token_ids,
                    bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=bi.block_m, split_k=split_k)


@pytest.mark.parametrize("block_m,k,block_k", [(32, 4096, 256), (32, 14336, 256), (32, 100, 128), (16, 14336, 256),
                                               (64, 14336, 64)])
def test_shrink_config_by_tile(block_m, k, block_k):
    """Every tile streams K in one range (split K is a launch option the sweep times, not a
    default); 32-row tiles (a continuous-batching step's chunks) in K tiles of 256, no wider than K."""
    from peft_fastlora.ops import shrink_config

    cfg = shrink_config(block_m, 16, k)
    assert (cfg["split_k"], cfg["block_k"]) == (1, block_k)


def test_shrink_default_launch_at_32_row_tiles():
    """The library's own choice for 32-row tiles at the 8B's hidden size (K 4,096), no override:
    equal to the torch reference where defined, nothing written elsewhere."""
    from peft_fastlora.ops import lora_shrink

    dtype, atol, rtol = TOLERANCES[0]
    c, k, sentinel = 3, 4096, 777.0
    bi, ref, ranks, tok, x, a = launcher_case("mixed", dtype, c, k=k)
    assert int(bi.chunk_len.max()) <= 32  # the plan's chunks fit 32-row tiles
    out = torch.full((len(tok), c * R), sentinel, dtype=dtype)
    lora_shrink(x, a, c, ranks, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=32, out=out)
    want = ref.run_lora_a_sgemm(x, a, stack_num=c, layer_ranks=ranks)
    mask = defined_mask(tok, ranks, c)
    assert_close(out, want, atol, rtol, "shrink, the default launch at 32-row tiles", mask=mask)
    assert (out[~mask] == sentinel).all(), "the shrink wrote past an adapter's rank or row"


def test_expand_launcher_small_tiles():
    """Several column blocks and several rank steps per program (rank 64 in steps of 16)."""
    from peft_fastlora.ops import lora_expand

    dtype, atol, rtol = TOLERANCES[0]
    seq_lens = MODES["prefill"]
    wi = COMPOSITIONS["mixed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    bi = tri.batch_info
    offsets = [0, 40, 59, 77]
    ranks, scalings = layer_tables(3)
    tok = token_slots(wi, seq_lens)
    y = shrink_output_with_garbage(tok, ranks, 3, dtype)
    b = make_b(offsets, ranks, dtype)
    base = poisoned_base(tok, offsets[-1], dtype)
    got = lora_expand(y, b, offsets, ranks, scalings, base.clone(), bi.sorted_token_ids,
                      bi.chunk_slot, bi.chunk_start, bi.chunk_len, block_m=bi.block_m,
                      block_n=16, block_r=16)
    # the reference's expand alone, with offsets (the contract has no public expand-only call)
    want = ref._expand_checked(y, b, offsets, base.clone(), ranks, scalings, ref.batch_info)
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, "expand (small tiles)")


# ---- static (CUDA-graph style) batch info ------------------------------------------------------
@pytest.mark.parametrize("refill_rows", [8, 5], ids=["same_rows", "fewer_rows"])
def test_static_buffers_more_adapters_than_at_capture(refill_rows):
    """A launch recorded with the batch info of a 1-adapter batch must serve a later 4-adapter
    batch refreshed into the same buffers: the grid comes from max_chunks (the token count's
    bound), not from the data. A refill of fewer rows (the rest no adapter) fits that grid too."""
    dtype, atol, rtol = TOLERANCES[0]
    bs = 8
    tri = TritonLoRABackend(MAX_LORAS, CPU)
    tri.init_cuda_graph_batch_info(bs, 1)
    fb = ForwardBatch.from_shape(bs, 1, CPU)
    captured = tri.prepare_lora_batch(fb, [0] * bs, SLOT_RANKS, SLOT_SCALINGS, use_cuda_graph=True)
    offsets = [0, 24, 31, 38]
    ranks, scalings = layer_tables(3)
    x = torch.randn(bs, K, dtype=dtype)
    a, b = make_a(3, K, ranks, dtype), make_b(offsets, ranks, dtype)
    kw = dict(output_offset=offsets, layer_ranks=ranks, layer_scalings=scalings)
    tri.run_qkv_lora(x, a, b, batch_info=captured, **kw)  # the "capture"

    wi = [0, 1, 2, 3, NO_ADAPTER, 3, 2, 1][:refill_rows]
    tri.prepare_lora_batch(ForwardBatch.from_shape(refill_rows, 1, CPU), wi, SLOT_RANKS, SLOT_SCALINGS,
                           use_cuda_graph=True)
    wi = wi + [NO_ADAPTER] * (bs - refill_rows)
    _, ref = make_backends(wi, [1] * bs)
    base = poisoned_base(token_slots(wi, [1] * bs), offsets[-1], dtype)
    got = tri.run_qkv_lora(x, a, b, base_output=base.clone(), batch_info=captured, **kw)
    want = ref.run_qkv_lora(x, a, b, base_output=base.clone(), **kw)
    assert_close(got, want, atol, rtol, "qkv replayed on refreshed static batch info")


# ---- embedding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("with_extra", [False, True], ids=["vocab_only", "extra_tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS)
def test_embedding_a(dtype, with_extra, ids_dtype):
    seq_lens = MODES["prefill"]
    wi = COMPOSITIONS["mixed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    vocab, rank, n_extra = 101, 24, 7
    tok = token_slots(wi, seq_lens)
    ids = torch.randint(0, vocab + (n_extra if with_extra else 0), (len(tok),), dtype=ids_dtype)
    if with_extra:
        first = int((tok >= 0).nonzero()[0])
        ids[first] = vocab + n_extra - 1  # at least one added token, the last one
    w = torch.randn(NUM_SLOTS, rank, vocab).to(dtype)
    w[NUM_SLOTS - 1] = float("nan")
    extra = torch.randn(NUM_SLOTS, n_extra, rank).to(dtype) if with_extra else None
    got = tri.run_lora_a_embedding(ids, w, vocab, extra)
    want = ref.run_lora_a_embedding(ids, w, vocab, extra)
    assert torch.equal(got, want), "a lookup must be exact"  # no arithmetic involved
    assert torch.equal(got[tok < 0], torch.zeros_like(got[tok < 0]))


def test_embedding_a_out_of_vocab_without_extra_is_zero():
    """The kernel cannot raise on an id past the vocabulary (that needs a host sync): it reads
    nothing and writes zeros; the torch backend raises."""
    wi, seq_lens = [0, 1], [1, 1]
    tri, _ = make_backends(wi, seq_lens)
    w = torch.randn(NUM_SLOTS, 16, 50)
    got = tri.run_lora_a_embedding(torch.tensor([3, 50]), w, 50)
    assert torch.equal(got[0], w[0, :, 3]) and torch.equal(got[1], torch.zeros(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS)
def test_extra_token_embedding(dtype):
    seq_lens = MODES["prefill"]
    wi = COMPOSITIONS["mixed"](len(seq_lens))
    tri, ref = make_backends(wi, seq_lens)
    vocab, d, n_extra = 90, 37, 6
    tok = token_slots(wi, seq_lens)
    ids = torch.randint(0, vocab + n_extra, (len(tok),))
    ids[::3] = vocab + torch.arange(len(ids[::3])) % n_extra  # plenty of added tokens
    ids[1::3][:3] = torch.tensor([vocab - 1, 0, vocab - 2])  # the edges of the base vocabulary
    extra = torch.randn(NUM_SLOTS, n_extra, d).to(dtype)
    extra[NUM_SLOTS - 1] = float("nan")
    base = torch.randn(len(tok), d).to(dtype)
    out = base.clone()
    got = tri.run_extra_token_embedding(ids, out, extra, vocab)
    want = ref.run_extra_token_embedding(ids, base.clone(), extra, vocab)
    assert got is out
    assert torch.equal(got, want)
    untouched = (tok < 0) | (ids < vocab)
    assert untouched.any() and (~untouched).any()
    assert torch.equal(got[untouched], base[untouched])


# ---- bad inputs --------------------------------------------------------------------------------
def _setup_bad():
    wi, seq_lens = [0, 1, NO_ADAPTER], [1, 1, 1]
    tri, _ = make_backends(wi, seq_lens)
    ranks, scalings = layer_tables(1)
    x = torch.randn(3, K)
    a = make_a(1, K, ranks, torch.float32)
    b = make_b([0, 20], ranks, torch.float32)
    return tri, x, a, b


@pytest.mark.parametrize("case", [
    "weights_dtype", "int_x", "non_contiguous_x", "k_mismatch", "token_count", "base_shape",
    "ranks_dtype", "ranks_shape", "too_few_slots", "mixed_devices",
    "fused_b_dtype", "fused_a_rows", "fused_tuple_b", "fused_too_few_slots", "fused_base_shape",
])
def test_bad_inputs_raise(case):
    tri, x, a, b = _setup_bad()
    err = {"weights_dtype": TypeError, "int_x": TypeError, "fused_b_dtype": TypeError}.get(case, ValueError)
    with pytest.raises(err):
        if case == "fused_b_dtype":
            tri.run_lora(x, a, b.half())
        elif case == "fused_a_rows":  # two modules' rows of A for one module of B
            tri.run_lora(x, torch.cat([a, a], 1), b)
        elif case == "fused_tuple_b":  # the tuple form needs the offsets
            tri.run_lora(x, a, (b, b))
        elif case == "fused_too_few_slots":
            tri.run_lora(x, a[:1].contiguous(), b[:1].contiguous(),
                         layer_ranks=torch.ones(1, 1, dtype=torch.int32),
                         layer_scalings=torch.ones(1, 1))
        elif case == "fused_base_shape":
            tri.run_lora(x, a, b, base_output=torch.zeros(3, 21))
        elif case == "weights_dtype":
            tri.run_lora_a_sgemm(x, a.half())
        elif case == "int_x":
            tri.run_lora_a_sgemm(x.to(torch.int32), a.to(torch.int32))
        elif case == "non_contiguous_x":
            tri.run_lora_a_sgemm(torch.randn(K, 3).T, a)
        elif case == "k_mismatch":
            tri.run_lora_a_sgemm(torch.randn(3, K + 1), a)
        elif case == "token_count":
            tri.run_lora_a_sgemm(torch.randn(4, K), a)
        elif case == "base_shape":
            tri.run_lora_b_sgemm(torch.randn(3, R), b, base_output=torch.zeros(3, 21))
        elif case == "ranks_dtype":
            tri.run_lora_a_sgemm(x, a, layer_ranks=torch.ones(NUM_SLOTS, 1, dtype=torch.int64))
        elif case == "ranks_shape":
            tri.run_lora_a_sgemm(x, a, stack_num=1, layer_ranks=torch.ones(NUM_SLOTS, 2, dtype=torch.int32))
        elif case == "too_few_slots":  # the batch uses slot 1, the buffer holds one slot
            tri.run_lora_a_sgemm(x, a[:1].contiguous(), layer_ranks=torch.ones(1, 1, dtype=torch.int32))
        elif case == "mixed_devices":
            tri.run_lora_a_sgemm(x, a.to("meta"))


def test_cpu_tensors_rejected_when_not_interpreting(monkeypatch):
    import peft_fastlora.backend.triton as tb

    tri, x, a, _ = _setup_bad()
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        tri.run_lora_a_sgemm(x, a)


def test_registry_finds_the_backend():
    from peft_fastlora.backend import get_backend

    assert get_backend("triton") is TritonLoRABackend
    assert TritonLoRABackend.name == "triton"
