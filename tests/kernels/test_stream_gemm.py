"""The weight-streaming decode GEMM (``ops.stream_gemm``) against a float32 reference: odd shapes,
split-K with its tickets, bias, strided outputs, repeated launches (Triton's interpreter on CPU;
``test_stream_gemm_gpu.py`` runs the same checks on the GPU)."""

import pytest
import torch

from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm, stream_gemm_reference

# (atol, rtol): float32 accumulation on both sides, one rounding to the dtype each
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
CONFIGS = [StreamConfig(16, 32, 1, 4, 2), StreamConfig(32, 64, 3, 4, 2), StreamConfig(16, 16, 2, 4, 2, preload=True),
           StreamConfig(16, 32, 1, 4, 2, preload=True)]


def _inputs(m, n, k, dtype, bias):
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}{'p' if c.preload else ''}")
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 33, 100), (17, 64, 128), (70, 20, 48), (130, 20, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(config, m, n, k, dtype):
    """Rows past one program's 128 (m=130), outputs not a whole tile (n=33, 20), K not a whole tile
    or range (100, 96 split 3 ways)."""
    x, w, b = _inputs(m, n, k, dtype, bias=n % 2 == 0)
    out = stream_gemm(x, w, b, config=config, workspace=StreamWorkspace("cpu", 4 * m * n, n))
    atol, rtol = TOL[dtype]
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, b).float(), atol=atol, rtol=rtol)


def test_split_k_tickets_reset_between_launches():
    """The last range of each block puts its ticket back: a second launch, and a launch of another
    shape on the same workspace, sum only their own partials."""
    tickets_case(stream_gemm, StreamConfig(16, 16, 4, 4, 2))


def tickets_case(gemm, cfg):
    """Split-K launches of ``gemm`` (``stream_gemm``'s arguments) with ``cfg`` of two shapes on one
    workspace: the same launch twice gives the same bits (the partials summed in range order), the
    other shape its own product, and the tickets end at zero."""
    ws = StreamWorkspace("cpu", 4 * 3 * 80, 8)
    x, w, _ = _inputs(3, 48, 64, torch.float32, False)
    first = gemm(x, w, config=cfg, workspace=ws)
    assert torch.equal(first, gemm(x, w, config=cfg, workspace=ws))
    assert not ws.tickets.any()
    x2, w2, _ = _inputs(2, 80, 64, torch.float32, False)
    torch.testing.assert_close(gemm(x2, w2, config=cfg, workspace=ws), stream_gemm_reference(x2, w2),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(gemm(x, w, config=cfg, workspace=ws), first)


def test_out_with_row_stride_and_rows_of_a_weight():
    """``out`` a slice of a wider buffer (unit stride on N), ``w`` rows of a bigger weight, ``x`` rows
    one stride apart: written in place, the rest of the buffer untouched."""
    row_stride_case(stream_gemm, CONFIGS[1])


def row_stride_case(gemm, cfg):
    """``gemm`` into a slice of a wider buffer, from rows of a bigger weight and strided rows of x
    (all 16-byte aligned, as a tensor descriptor needs): the slice is the product, the rest of the
    buffer untouched."""
    big_w = torch.randn(100, 64)
    w = big_w[8:56]
    x = torch.randn(4, 200)[:, :64]
    buf = torch.full((4, 90), 7.0)
    out = buf[:, 20:68]
    gemm(x, w, out=out, config=cfg, workspace=StreamWorkspace("cpu", 3 * 4 * 48, 3))
    torch.testing.assert_close(out, stream_gemm_reference(x, w), atol=1e-4, rtol=1e-4)
    assert torch.all(buf[:, :20] == 7) and torch.all(buf[:, 68:] == 7)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1]], ids=["split1", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_add", [40, 23])
def test_add_on_the_first_columns(config, dtype, n_add):
    """A residual added in the epilogue (split-K: by the last range) to the first ``n_add`` of 40
    columns, with a bias, from a row-strided tensor; the columns past it get none."""
    add_case(stream_gemm, config, dtype, n_add, rows=5)


def add_case(gemm, cfg, dtype, n_add, rows):
    """``gemm(add=)`` over ``rows`` rows of a 40-column product with a bias: the reference's sum on
    the first ``n_add`` columns, the plain product past them."""
    x, w, b = _inputs(rows, 40, 96, dtype, bias=True)
    add = torch.randn(rows, 64).to(dtype)[:, :n_add]
    out = gemm(x, w, b, config=cfg, workspace=StreamWorkspace("cpu", 3 * rows * 40, 3), add=add)
    atol, rtol = TOL[dtype]
    plain = stream_gemm_reference(x, w, b).float()
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, b, add=add).float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out[:, n_add:].float(), plain[:, n_add:], atol=atol, rtol=rtol)
    assert (out[:, :n_add].float() - plain[:, :n_add]).abs().max() > 0.5


def test_rows_with_zeros_and_empty_shapes():
    zeros_and_empty_case(stream_gemm, CONFIGS[0])


def zeros_and_empty_case(gemm, cfg):
    """A zero row gets the bias alone; no rows give an empty output; no reduction gives the bias."""
    x, w, b = _inputs(3, 24, 32, torch.float32, True)
    x[1] = 0
    out = gemm(x, w, b, config=cfg)
    torch.testing.assert_close(out[1], b, atol=1e-6, rtol=0)
    assert gemm(x[:0], w).shape == (0, 24)
    torch.testing.assert_close(gemm(torch.empty(3, 0), torch.empty(5, 0), torch.ones(5)), torch.ones(3, 5))


@pytest.mark.parametrize("bad,match", [
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 9)), "expected"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8).half()), "differ"),
    (lambda: stream_gemm(torch.randn(8, 2).T, torch.randn(4, 8)), "unit stride"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3)), "bias"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8), out=torch.empty(2, 5)), "out"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8), config=StreamConfig(8, 16)), "config"),
    (lambda: stream_gemm(torch.randn(2, 64), torch.randn(4, 64), config=StreamConfig(16, 16, 2)), "StreamWorkspace"),
    (lambda: stream_gemm(torch.randn(2, 64), torch.randn(40, 64), config=StreamConfig(16, 16, 2),
                         workspace=StreamWorkspace("cpu", 10, 1)), "StreamWorkspace"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8), add=torch.randn(2, 5)), "add"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8), add=torch.randn(3, 4)), "add"),
    (lambda: stream_gemm(torch.randn(2, 8), torch.randn(4, 8), add=torch.randn(2, 4).half()), "add"),
])
def test_bad_inputs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, False), (5, 33, 100, True), (70, 20, 48, False)])
def test_glu_equals_gemm_then_act_mul(act, m, n, k, bias):
    """``glu``: a [gate; up] weight of 2n rows gives ``act(gate) * up`` of width n (outputs not a
    whole tile, K not a whole tile), as the GEMM's output through ``ops.silu_mul.act_mul`` would."""
    x, w, b, out = glu_case(stream_gemm, StreamConfig(16, 32, 1, 4, 2), act, m, n, k, bias)
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, b, glu=act).float(), atol=2e-2, rtol=2e-2)


def glu_case(gemm, cfg, act, m, n, k, bias):
    """``gemm(glu=act)`` over a bf16 [gate; up] weight of 2n rows: the bits of its plain output
    through ``act_mul`` (whose own tests hold it to torch's), that output the reference's within a
    rounding. Returns x, w, the bias and the gated output."""
    from peft_fastlora.ops.silu_mul import act_mul

    x, w, b = _inputs(m, 2 * n, k, torch.bfloat16, bias)
    out = gemm(x, w, b, config=cfg, glu=act)
    both = gemm(x, w, b, config=cfg)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.float(), act_mul(both[:, :n], both[:, n:], act).float(), atol=0, rtol=0)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(both.float(), stream_gemm_reference(x, w, b).float(), atol=atol, rtol=rtol)
    return x, w, b, out


def test_glu_refuses_what_it_does_not_take():
    x, w = torch.randn(2, 64), torch.randn(40, 64)
    for kwargs in (dict(glu="relu"), dict(glu="silu", config=StreamConfig(16, 16, 2)),
                   dict(glu="silu", config=StreamConfig(16, 16, preload=True)), dict(glu="silu", add=torch.randn(2, 8))):
        with pytest.raises(ValueError, match="glu"):
            stream_gemm(x, w, workspace=StreamWorkspace("cpu", 1000, 10), **kwargs)
    with pytest.raises(ValueError, match="glu"):
        stream_gemm(x, torch.randn(41, 64), glu="silu")
