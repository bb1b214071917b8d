"""The TMA-fed decode GEMM (``ops.tma_gemm``) against a float32 reference: odd shapes, rows past one
block, split-K with its tickets, bias, the residual and GLU epilogues, strided outputs (Triton's
interpreter on CPU; ``test_tma_gemm_gpu.py`` runs the 8B shapes on the GPU)."""

import pytest
import torch

from peft_fastlora.ops.stream_gemm import StreamWorkspace, stream_gemm_reference
from peft_fastlora.ops.tma_gemm import TmaConfig, shared_bytes, tma_aligned, tma_gemm

# (atol, rtol): float32 accumulation on both sides, one rounding to the dtype each
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
CONFIGS = [TmaConfig(32, 32, 1, 4, 2), TmaConfig(16, 16, 3, 4, 2), TmaConfig(64, 32, 2, 4, 3)]


def _inputs(m, n, k, dtype, bias):
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    return x, w, b


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
    cfg = TmaConfig(16, 16, 4, 4, 2)
    ws = StreamWorkspace("cpu", 4 * 3 * 80, 8)
    x, w, _ = _inputs(3, 48, 64, torch.float32, False)
    first = tma_gemm(x, w, config=cfg, workspace=ws)
    assert torch.equal(first, tma_gemm(x, w, config=cfg, workspace=ws))
    assert not ws.tickets.any()
    x2, w2, _ = _inputs(2, 80, 64, torch.float32, False)
    torch.testing.assert_close(tma_gemm(x2, w2, config=cfg, workspace=ws), stream_gemm_reference(x2, w2),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(tma_gemm(x, w, config=cfg, workspace=ws), first)


def test_out_with_row_stride_and_rows_of_a_weight():
    """``out`` a slice of a wider buffer, ``w`` rows of a bigger weight, ``x`` rows one stride apart
    (16-byte aligned): written in place, the rest of the buffer untouched."""
    big_w = torch.randn(100, 64)
    w = big_w[8:56]
    x = torch.randn(4, 200)[:, :64]
    buf = torch.full((4, 90), 7.0)
    out = buf[:, 20:68]
    tma_gemm(x, w, out=out, config=CONFIGS[1], workspace=StreamWorkspace("cpu", 3 * 4 * 48, 3))
    torch.testing.assert_close(out, stream_gemm_reference(x, w), atol=1e-4, rtol=1e-4)
    assert torch.all(buf[:, :20] == 7) and torch.all(buf[:, 68:] == 7)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["split1", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_add", [40, 23])
def test_add_on_the_first_columns(config, dtype, n_add):
    """A residual added in the epilogue (split-K: by the last range) to the first ``n_add`` of 40
    columns, with a bias, from a row-strided tensor; the columns past it get none."""
    x, w, b = _inputs(70, 40, 96, dtype, bias=True)
    add = torch.randn(70, 64).to(dtype)[:, :n_add]
    out = tma_gemm(x, w, b, config=config, workspace=_ws(70, 40), add=add)
    atol, rtol = TOL[dtype]
    plain = stream_gemm_reference(x, w, b).float()
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, b, add=add).float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out[:, n_add:].float(), plain[:, n_add:], atol=atol, rtol=rtol)
    assert (out[:, :n_add].float() - plain[:, :n_add]).abs().max() > 0.5


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, False), (70, 33, 104, True), (130, 16, 48, False)])
def test_glu_equals_gemm_then_act_mul(act, m, n, k, bias):
    """``glu``: a [gate; up] weight of 2n rows gives ``act(gate) * up`` of width n, the bits of the
    GEMM's output through ``ops.silu_mul.act_mul``."""
    from peft_fastlora.ops.silu_mul import act_mul

    x, w, b = _inputs(m, 2 * n, k, torch.bfloat16, bias)
    cfg = TmaConfig(32, 32, 1, 4, 2)
    out = tma_gemm(x, w, b, config=cfg, glu=act)
    both = tma_gemm(x, w, b, config=cfg)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.float(), act_mul(both[:, :n], both[:, n:], act).float(), atol=0, rtol=0)
    # and gate and up are the reference's (within a rounding): the output is act_mul's of them (the
    # activation's own tests hold it to torch's); comparing the composite instead would need a
    # tolerance as wide as GELU's steep tail below -3 makes one ulp of gate
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(both.float(), stream_gemm_reference(x, w, b).float(), atol=atol, rtol=rtol)


def test_rows_with_zeros_and_empty_shapes():
    x, w, b = _inputs(3, 24, 32, torch.float32, True)
    x[1] = 0
    out = tma_gemm(x, w, b, config=CONFIGS[0])
    torch.testing.assert_close(out[1], b, atol=1e-6, rtol=0)  # a zero row gets the bias alone
    assert tma_gemm(x[:0], w).shape == (0, 24)
    torch.testing.assert_close(tma_gemm(torch.empty(3, 0), torch.empty(5, 0), torch.ones(5)), torch.ones(3, 5))


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
