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
