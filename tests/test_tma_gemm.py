"""The TMA-fed decode GEMM (``ops.tma_gemm``) against a float32 reference: odd shapes, rows past one
block, split-K with its tickets, bias, the residual and GLU epilogues, strided outputs (Triton's
interpreter on CPU; ``test_tma_gemm_gpu.py`` runs the 8B shapes on the GPU)."""

import pytest
import torch

from peft_fastlora.ops.stream_gemm import StreamWorkspace, stream_gemm_reference
from peft_fastlora.ops.tma_gemm import TmaConfig, shared_bytes, tma_aligned, tma_gemm
from test_stream_gemm import TOL, _inputs, add_case, glu_case, row_stride_case, tickets_case, zeros_and_empty_case
CONFIGS = [TmaConfig(32, 32, 1, 4, 2), TmaConfig(16, 16, 3, 4, 2), TmaConfig(64, 32, 2, 4, 3)]


def _ws(m, n):
    return StreamWorkspace("cpu", 4 * m * n, n)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (70, 33, 104), (128, 64, 48), (130, 24, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(config, m, n, k, dtype):
    """Rows past one program's 128 (m=130: a second row block), outputs not a whole tile (33, 40 of
    32 or 64), K not a whole tile or range (104, 96 split 3 ways): the descriptors read zeros there."""
    x, w, b = _inputs(m, n, k, dtype, bias=n % 2 == 0)
    out = torch.full((m, n), float("nan")).to(dtype)  # every element must be written
    tma_gemm(x, w, b, out=out, config=config, workspace=_ws(m, n))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, b).float(), atol=atol, rtol=rtol)


def test_split_k_tickets_reset_between_launches():
    """The last range of each block puts its ticket back: a second launch, and a launch of another
    shape on the same workspace, sum only their own partials, in range order (the same bits)."""
    tickets_case(tma_gemm, TmaConfig(16, 16, 4, 4, 2))


def test_out_with_row_stride_and_rows_of_a_weight():
    """``out`` a slice of a wider buffer, ``w`` rows of a bigger weight, ``x`` rows one stride apart
    (16-byte aligned): written in place, the rest of the buffer untouched."""
    row_stride_case(tma_gemm, CONFIGS[1])


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["split1", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_add", [40, 23])
def test_add_on_the_first_columns(config, dtype, n_add):
    """A residual added in the epilogue (split-K: by the last range) to the first ``n_add`` of 40
    columns, with a bias, from a row-strided tensor, over 70 rows; the columns past it get none."""
    add_case(tma_gemm, config, dtype, n_add, rows=70)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, False), (70, 33, 104, True), (130, 16, 48, False)])
def test_glu_equals_gemm_then_act_mul(act, m, n, k, bias):
    """``glu``: a [gate; up] weight of 2n rows gives ``act(gate) * up`` of width n, the bits of the
    GEMM's output through ``ops.silu_mul.act_mul``, and that output the reference's within a rounding
    (the composite against torch would need a tolerance as wide as GELU's steep tail below -3 makes
    one ulp of gate: at these row counts such a gate turns up)."""
    glu_case(tma_gemm, TmaConfig(32, 32, 1, 4, 2), act, m, n, k, bias)


def test_rows_with_zeros_and_empty_shapes():
    zeros_and_empty_case(tma_gemm, CONFIGS[0])


def test_alignment_and_shared_memory_helpers():
    t = torch.randn(4, 64)
    assert tma_aligned(t) and tma_aligned(t[:, :8]) and tma_aligned(t[1:])
    assert not tma_aligned(t[:, 1:]) and not tma_aligned(t.T) and not tma_aligned(torch.randn(4, 6))
    assert shared_bytes(TmaConfig(128, 64, 1, 8, 4), 128, 2) == 4 * (128 + 128) * 64 * 2
    assert shared_bytes(TmaConfig(128, 64, 1, 8, 4), 128, 2, glu=True) == 4 * (128 + 256) * 64 * 2


@pytest.mark.parametrize("bad,match", [
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 9)), "expected"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8).half()), "differ"),
    (lambda: tma_gemm(torch.randn(8, 2).T, torch.randn(4, 8)), "16-byte"),
    (lambda: tma_gemm(torch.randn(2, 6), torch.randn(4, 6)), "16-byte"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3)), "bias"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8), out=torch.empty(2, 5)), "out"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8), config=TmaConfig(16, 8)), "config"),
    (lambda: tma_gemm(torch.randn(2, 64), torch.randn(4, 64), config=TmaConfig(16, 16, 2)), "StreamWorkspace"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8), add=torch.randn(2, 5)), "add"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8), add=torch.randn(3, 4)), "add"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(4, 8), glu="relu"), "glu"),
    (lambda: tma_gemm(torch.randn(2, 8), torch.randn(5, 8), glu="silu"), "glu"),
    (lambda: tma_gemm(torch.randn(2, 64), torch.randn(40, 64), glu="silu", config=TmaConfig(16, 16, 2)), "glu"),
])
def test_bad_inputs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def _tail_case(m, k, n, ranks, dtype, glu, seed=0):
    """Slots of ``ranks`` packed back to back (then padding to a multiple of 8 columns), each row of
    a random slot or none (-1); A (per slot, per gate/up with ``glu``) and B drawn alike. Returns x,
    w, the tail and the per-row oracle's deltas (float32, (m, w's rows)): row by row, its own slot's
    ``(x A.T * scale) B.T``, as PEFT's LoRA layer computes it."""
    from peft_fastlora.ops.tma_gemm import LoraTail

    g = torch.Generator().manual_seed(seed)
    parts = 2 if glu else 1
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(parts * n, k, generator=g) / k ** 0.5).to(dtype)
    t = -(-sum(ranks) // 8) * 8
    col_slot = torch.full((t,), -2, dtype=torch.int32)
    scale = torch.zeros(t)
    a = torch.zeros(parts, t, k, dtype=dtype)
    b = torch.zeros(parts * n, t, dtype=dtype)
    c = 0
    for slot, r in enumerate(ranks):
        col_slot[c:c + r], scale[c:c + r] = slot, 0.25 * (1 + slot)
        a[:, c:c + r] = (torch.randn(parts, r, k, generator=g) / k ** 0.5).to(dtype)
        b[:, c:c + r] = (torch.randn(parts * n, r, generator=g) * 0.5 / r ** 0.5).to(dtype)
        c += r
    row_slot = torch.randint(-1, len(ranks), (m,), generator=g, dtype=torch.int32)
    s = torch.cat([(x.float() @ a[p].float().T).to(dtype) for p in range(parts)], dim=1)
    tail = LoraTail(s, b, row_slot, col_slot, scale)
    want = torch.zeros(m, parts * n)
    for i, slot in enumerate(row_slot.tolist()):
        if slot >= 0:
            cols = col_slot == slot
            for p in range(parts):
                sp = s[i, p * t:(p + 1) * t][cols].float() * scale[cols]
                want[i, p * n:(p + 1) * n] = sp.to(dtype).float() @ b[p * n:(p + 1) * n][:, cols].float().T
    return x, w, tail, want


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("m,ranks", [(70, [16, 8, 24]), (5, [16]), (130, [4, 64, 1, 16])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_tail_adds_each_rows_own_slot(config, m, ranks, dtype):
    """``tail``: each row gets its own slot's delta and no other's (rows of no adapter none), mixed
    and odd ranks, padding columns, more tail columns than one block_k (ranks 4+64+1+16 = 85), a
    second row block (130), split-K (the first range adds it), with a bias: against the per-row
    oracle through the float32 reference, and the reference against the oracle."""
    from peft_fastlora.ops.tma_gemm import lora_tail_reference

    x, w, tail, want = _tail_case(m, 48, 40, ranks, dtype, glu=False)
    bias = torch.randn(40).to(dtype)
    out = tma_gemm(x, w, bias, config=config, workspace=_ws(m, 40), tail=tail)
    ref = lora_tail_reference(x, w, bias, tail)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ref.float(), (stream_gemm_reference(x, w, bias).float() + want).to(dtype).float(),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert (want[tail.row_slot < 0] == 0).all() and (want[tail.row_slot >= 0].abs().sum(1) > 0).all()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,ranks", [(70, [16, 8, 24]), (3, [32, 16])])
def test_lora_tail_before_the_gated_activation(act, m, ranks):
    """``glu`` with ``tail``: gate's delta from the first T shrink columns and gate's B rows, up's
    from the next T and up's rows, both before the activation. The gated output is the bits of the
    plain tailed GEMM's through ``act_mul`` (as ``glu_case``: the composite against torch would need
    a tolerance as wide as the activation's slope makes one ulp), and that GEMM the oracle's."""
    from peft_fastlora.ops.silu_mul import act_mul

    x, w, tail, want = _tail_case(m, 64, 24, ranks, torch.bfloat16, glu=True, seed=1)
    cfg = TmaConfig(16, 32, 1, 4, 2)
    out = tma_gemm(x, w, config=cfg, tail=tail, glu=act)
    t = tail.b.shape[1]
    gate = tma_gemm(x, w[:24], config=cfg, tail=tail._replace(s=tail.s[:, :t], b=tail.b[:24]))
    up = tma_gemm(x, w[24:], config=cfg, tail=tail._replace(s=tail.s[:, t:], b=tail.b[24:]))
    both = torch.cat([gate, up], dim=1)
    torch.testing.assert_close(out.float(), act_mul(both[:, :24], both[:, 24:], act).float(), atol=0, rtol=0)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(both.float(), (x.float() @ w.float().T + want).to(torch.bfloat16).float(),
                               atol=atol, rtol=rtol)


def test_lora_tail_bad_inputs_name_the_part():
    x, w, tail, _ = _tail_case(4, 32, 16, [8], torch.float32, glu=False)
    with pytest.raises(ValueError, match="tail.row_slot"):
        tma_gemm(x, w, tail=tail._replace(row_slot=tail.row_slot.long()))
    with pytest.raises(ValueError, match="tail.s"):  # glu wants gate's and up's shrink columns
        tma_gemm(x, torch.cat([w, w]), tail=tail._replace(b=torch.cat([tail.b, tail.b])), glu="silu")
    with pytest.raises(ValueError, match="tail.col_scale"):
        tma_gemm(x, w, tail=tail._replace(col_scale=tail.col_scale[:-1]))
