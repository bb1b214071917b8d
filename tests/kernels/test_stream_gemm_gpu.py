"""The weight-streaming decode GEMM on the GPU: Llama-3-8B shapes in bf16/fp16 against a float32
reference, split-K's tickets across launches and graph replays, and the PDL chain (a norm writing
the GEMM's input just before it) equal to plain launches. Run on a GPU machine:

    python -m pytest -m gpu tests/test_stream_gemm_gpu.py
"""

import pytest
import torch

from peft_fastlora.ops import pdl
from peft_fastlora.ops.rms_norm import rms_norm
from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm, stream_gemm_reference

from _graphs import captured

pytestmark = pytest.mark.gpu

# (atol, rtol): float32 accumulation on both sides, one rounding each; about 2-4 ulps of margin
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONFIGS = [StreamConfig(16, 512, 1, 4, 4), StreamConfig(32, 256, 1, 4, 4, 4096), StreamConfig(64, 256, 4, 4, 4),
           StreamConfig(64, 128, 1, 4, 6, preload=True), StreamConfig(128, 128, 2, 8, 4, 2048, True)]


def _ids(c):
    return f"n{c.block_n}k{c.block_k}s{c.split_k}pf{c.prefetch}{'p' if c.preload else ''}"


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("m", [1, 7, 64, 100])
@pytest.mark.parametrize("site", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_shapes(dtype, site, m, config):
    shape_case(stream_gemm, config, dtype, m, *SHAPES[site], bias=site == "qkv")


def shape_case(gemm, config, dtype, m, k, n, bias):
    """``gemm`` (``stream_gemm``'s arguments) of ``m`` random rows by an (n, k) weight, with a bias
    (Qwen2's q/k/v have one) where asked, into a NaN-filled output: the float32 reference's product."""
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # every element must be written
    gemm(x, w, b, out=out, config=config, workspace=StreamWorkspace("cuda", 4 * m * n, n))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, b).float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("m,n,k", [(3, 1000, 520), (33, 77, 4104), (5, 4096, 100)])
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_odd_shapes_and_float32(m, n, k, config):
    """Outputs not a whole tile, K not a whole tile or range; float32 with no TF32 rounding."""
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    atol, rtol = TOL[torch.float32]
    out = stream_gemm(x, w, config=config, workspace=StreamWorkspace("cuda", 4 * m * n, n))
    torch.testing.assert_close(out, stream_gemm_reference(x, w), atol=atol, rtol=rtol)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("n_add", [4096, 4000])
def test_residual_added_in_the_epilogue(config, m, n_add):
    """down's shape (a folded down has its arena's columns past the residual's: n_add < N), bf16,
    the residual a row-strided view, split-K too; inside a graph, replayed twice."""
    k, n = 14336, 4096
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    add = torch.randn(m, n + 64, device="cuda").bfloat16()[:, :n_add]
    ws = StreamWorkspace("cuda", 4 * m * n, n)
    graph, out = captured(lambda: stream_gemm(x, w, config=config, workspace=ws, add=add))
    atol, rtol = TOL[torch.bfloat16]
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, add=add).float(), atol=atol, rtol=rtol)
    assert int(ws.tickets.abs().sum()) == 0


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 16, 33, 64])
@pytest.mark.parametrize("config", [StreamConfig(64, 128, 1, 4, 4), StreamConfig(64, 128, 1, 8, 4),
                                    StreamConfig(32, 256, 1, 4, 3)], ids=_ids)
def test_glu_at_the_gate_up_shape(act, m, config):
    """``glu``: 8B's fused gate/up (2 x 14,336 rows), bf16, against the float32 GEMM through torch's
    activation, and against the library's GEMM then ``act_mul`` (the path it replaces)."""
    from peft_fastlora.ops.silu_mul import act_mul

    k, n2 = SHAPES["gate_up"]
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(n2, k, device="cuda") / k ** 0.5).bfloat16()
    out = stream_gemm(x, w, config=config, glu=act)
    atol, rtol = TOL[torch.bfloat16]
    assert out.shape == (m, n2 // 2)
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, glu=act).float(), atol=atol, rtol=rtol)
    both = stream_gemm(x, w, config=StreamConfig(128, 128, 1, 8, 4))
    torch.testing.assert_close(out.float(), act_mul(both[:, :n2 // 2], both[:, n2 // 2:], act).float(),
                               atol=atol, rtol=rtol)


def test_split_k_across_launches_and_graph_replays():
    """Split-K launches of two shapes share a workspace: each launch, eager or replayed, gives the same
    bits as the first eager one (the partials are summed in range order, the tickets reset)."""
    split_k_replays_equal_eager(stream_gemm, StreamConfig(64, 256, 4, 4, 4), rows=8)


def split_k_replays_equal_eager(gemm, cfg, rows):
    """``gemm`` (a launcher of ``stream_gemm``'s arguments) with split-K ``cfg`` at ``rows`` rows over
    4,096 x 4,096 and 6,144 x 4,096 weights sharing one workspace, in a graph replayed three times
    on new inputs: each replay's outputs equal eager launches' bits, and the tickets end at zero."""
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64,
          torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) / 64]
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(rows, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    work = StreamWorkspace("cuda", cfg.split_k * rows * 6144, 96)

    def step():
        for w, o in zip(ws, outs):
            gemm(x, w, out=o, config=cfg, workspace=work)

    graph, _ = captured(step)
    for trial in range(3):
        x.copy_(torch.randn_like(x))
        expect = [gemm(x, w, config=cfg, workspace=work) for w in ws]
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, expect):
            assert torch.equal(o, e), f"replay {trial} differs from the eager launch"
    assert not work.tickets.any()


def test_pdl_chain_in_a_graph_equals_plain_launches():
    """A norm writes each GEMM's input just before it, in one graph: with PDL (the GEMM's preamble,
    prefetch included, overlapping the norm) the outputs equal launches with PDL off."""
    cfgs = [StreamConfig(16, 512, 1, 4, 4, 4096, True), StreamConfig(64, 256, 4, 4, 4, 2048, True)]
    pdl_chain_equals_plain(stream_gemm, cfgs, rows=16)


def pdl_chain_equals_plain(gemm, cfgs, rows):
    """Four 4,096 x 4,096 GEMMs through ``gemm`` (``stream_gemm``'s arguments; configs in turn), each
    after an RMSNorm that writes its input, in one graph: the same bits with PDL on and off."""
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(4)]
    nw = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    work = StreamWorkspace("cuda", max(c.split_k for c in cfgs) * rows * 4096, 64)

    def chain():
        h = x
        for i, w in enumerate(ws):
            h = gemm(rms_norm(h, nw, 1e-5), w, config=cfgs[i % len(cfgs)], workspace=work)
        return h

    results = {}
    for setting in (pdl.OFF, pdl.FULL):
        with pdl.launches(setting):
            graph, out = captured(chain)
        graph.replay()
        torch.cuda.synchronize()
        results[setting] = out.clone()
    assert torch.equal(results[pdl.OFF], results[pdl.FULL])
