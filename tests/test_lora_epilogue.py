"""The LoRA expand in the TMA GEMM's epilogue (``ops.lora_epilogue`` through ``ops.tma_gemm``), against
a float32 torch reference from the same packed tables: mixed ranks, a module a slot does not target,
rows with no adapter, odd widths, split-K, several row blocks, the bias / residual / GLU epilogues,
stale plans, bad inputs (Triton's interpreter on CPU; ``test_lora_epilogue_gpu.py`` on the GPU)."""

import pytest
import torch

from _lora_epilogue_cases import make_lora
from peft_fastlora.ops.lora_epilogue import lora_delta_reference
from peft_fastlora.ops.silu_mul import act_mul
from peft_fastlora.ops.stream_gemm import StreamWorkspace
from peft_fastlora.ops.tma_gemm import TmaConfig, tma_gemm, tma_gemm_reference
from test_stream_gemm import TOL, _inputs

# three modules (q/k/v-like, one narrower than a tile), three slots: mixed ranks, slot 1 not on module 2
WIDTHS = [40, 24, 24]
RANKS = [[8, 8, 16], [16, 24, 0], [8, 16, 8]]
CONFIGS = [TmaConfig(32, 32, 1, 4, 2), TmaConfig(16, 16, 3, 4, 2)]


def _ws(m, n):
    return StreamWorkspace("cpu", 4 * m * n, n)


def _check(out, x, w, b, lora, dtype, add=None, glu=None):
    atol, rtol = TOL[dtype]
    ref = tma_gemm_reference(x, w, b, add=add, glu=glu, lora=lora)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("config", CONFIGS, ids=["split1", "split3"])
@pytest.mark.parametrize("m", [1, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deltas_over_modules_match_reference(config, m, dtype):
    """Tiles that straddle module edges (40 | 24 | 24 in tiles of 16 or 32), split-K (the delta added
    by one range only), a second row block (130 rows); every output element written (NaN before)."""
    k = 104
    x, w, b = _inputs(m, sum(WIDTHS), k, dtype, bias=True)
    lora = make_lora(m, WIDTHS, RANKS, dtype, seed=m)
    out = torch.full((m, sum(WIDTHS)), float("nan")).to(dtype)
    tma_gemm(x, w, b, out=out, config=config, workspace=_ws(m, sum(WIDTHS)), lora=lora)
    _check(out, x, w, b, lora, dtype)
    assert lora_delta_reference(lora, m).abs().sum() > 0  # the case has deltas to add


def test_rows_without_adapter_are_the_plain_gemm():
    """Rows of slot -1 get exactly the GEMM without LoRA (the same bits); rows with one differ."""
    m, k = 40, 64
    slots = [-1, 0, 2, -1, 1] * 8
    x, w, _ = _inputs(m, sum(WIDTHS), k, torch.bfloat16, bias=False)
    lora = make_lora(m, WIDTHS, RANKS, torch.bfloat16, token_slots=slots)
    plain = tma_gemm(x, w, config=CONFIGS[0])
    out = tma_gemm(x, w, config=CONFIGS[0], lora=lora)
    none = torch.tensor([s == -1 for s in slots])
    assert torch.equal(out[none], plain[none])
    assert not torch.equal(out[~none], plain[~none])
    _check(out, x, w, None, lora, torch.bfloat16)


def test_all_rows_without_adapter_and_stale_slots():
    """No row with an adapter: the plain GEMM's bits. A plan naming slots past the tables (a stale
    plan) adds nothing for them; ranks past ``max_rank`` are cut to it (the reference does the same)."""
    m, k = 20, 48
    x, w, _ = _inputs(m, sum(WIDTHS), k, torch.float32, bias=False)
    lora = make_lora(m, WIDTHS, RANKS, torch.float32, token_slots=[-1] * m)
    assert torch.equal(tma_gemm(x, w, config=CONFIGS[0], lora=lora), tma_gemm(x, w, config=CONFIGS[0]))
    lora = make_lora(m, WIDTHS, RANKS, torch.float32, token_slots=[0, 1, 2, 5] * 5, max_rank=16)
    lora = lora._replace(chunk_slot=torch.tensor([0, 1, 2, 5, 7, -1], dtype=torch.int32),
                         token_slot=torch.tensor([0, 1, 2, 5] * 5, dtype=torch.int32))
    out = tma_gemm(x, w, config=CONFIGS[0], lora=lora)
    _check(out, x, w, None, lora, torch.float32)
    assert torch.equal(out[3::4], tma_gemm(x, w, config=CONFIGS[0])[3::4])


@pytest.mark.parametrize("config", CONFIGS, ids=["split1", "split3"])
def test_with_bias_and_residual(config):
    """The delta, the bias and a residual on the first 50 columns, one rounding."""
    m, k = 70, 96
    x, w, b = _inputs(m, sum(WIDTHS), k, torch.bfloat16, bias=True)
    add = torch.randn(m, 64).to(torch.bfloat16)[:, :50]
    lora = make_lora(m, WIDTHS, RANKS, torch.bfloat16, seed=3)
    out = tma_gemm(x, w, b, config=config, workspace=_ws(m, sum(WIDTHS)), add=add, lora=lora)
    _check(out, x, w, b, lora, torch.bfloat16, add=add)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,n,bias", [(1, 40, False), (70, 33, True), (130, 16, False)])
def test_glu_with_gate_and_up_deltas(act, m, n, bias):
    """``glu`` with LoRA on gate and up (one slot on gate only): the bits of the plain launch's output
    (deltas included) through ``act_mul``, and that output the reference's."""
    k = 64
    x, w, b = _inputs(m, 2 * n, k, torch.bfloat16, bias)
    lora = make_lora(m, [n, n], [[16, 16], [8, 0], [16, 8]], torch.bfloat16, seed=n)
    cfg = TmaConfig(32, 32, 1, 4, 2)
    out = tma_gemm(x, w, b, config=cfg, glu=act, lora=lora)
    both = tma_gemm(x, w, b, config=cfg, lora=lora)
    torch.testing.assert_close(out.float(), act_mul(both[:, :n], both[:, n:], act).float(), atol=0, rtol=0)
    _check(both, x, w, b, lora, torch.bfloat16)


def test_odd_ranks_unaligned_blocks():
    """Ranks that are not multiples of 8 (align 1: B's rows at odd element offsets)."""
    m, k = 33, 48
    x, w, _ = _inputs(m, sum(WIDTHS), k, torch.float32, bias=False)
    lora = make_lora(m, WIDTHS, [[5, 3, 7], [1, 0, 12]], torch.float32, seed=9)
    assert lora.align == 1
    out = tma_gemm(x, w, config=CONFIGS[0], lora=lora)
    _check(out, x, w, None, lora, torch.float32)


@pytest.mark.parametrize("change,match", [
    (dict(offsets=(0, 40, 64)), "cover"),
    (dict(offsets=(0, 40, 30, 88)), "modules"),
    (dict(y=torch.zeros(3, 80)), "lora y"),
    (dict(ranks=torch.zeros(3, 2, dtype=torch.int32)), "ranks"),
    (dict(scalings=torch.zeros(3, 3, dtype=torch.float64)), "scalings"),
    (dict(b_offs=torch.zeros(3, 3, dtype=torch.int32)), "b_offs"),
    (dict(token_slot=torch.zeros(2, dtype=torch.int32)), "token_slot"),
    (dict(chunk_slot=torch.zeros(2, dtype=torch.int64)), "chunk_slot"),
    (dict(align=4), "align"),
])
def test_bad_operands_are_refused(change, match):
    m = 4
    x, w, _ = _inputs(m, sum(WIDTHS), 32, torch.float32, bias=False)
    lora = make_lora(m, WIDTHS, RANKS, torch.float32)
    with pytest.raises(ValueError, match=match):
        tma_gemm(x, w, config=CONFIGS[0], lora=lora._replace(**change))
    with pytest.raises(ValueError, match="glu needs two modules"):
        tma_gemm(x, torch.randn(2 * 88, 32), config=CONFIGS[0], glu="silu", lora=lora)
    with pytest.raises(ValueError, match="b is"):
        tma_gemm(x, w, config=CONFIGS[0], lora=lora._replace(b=lora.b.half()))


def test_glu_at_the_library_tile():
    """The gate/up tile the library launches on the H200 (``base_ops/tma_tiles_h200.json``: 128 columns
    of gate and of up, 64-deep K steps, 8 warps), 96 rows of 8 slots of rank 16 and rows without."""
    from peft_fastlora.base_ops.stream_linears import tma_tiles

    cfg = tma_tiles()["glu"].config
    m, n, k = 96, 136, 128
    x, w, _ = _inputs(m, 2 * n, k, torch.bfloat16, False)
    lora = make_lora(m, [n, n], [[16, 16]] * 8, torch.bfloat16, seed=11)
    out = tma_gemm(x, w, config=cfg, glu="silu", lora=lora)
    both = tma_gemm(x, w, config=cfg, lora=lora)
    torch.testing.assert_close(out.float(), act_mul(both[:, :n], both[:, n:], "silu").float(), atol=0, rtol=0)
    _check(both, x, w, None, lora, torch.bfloat16)
