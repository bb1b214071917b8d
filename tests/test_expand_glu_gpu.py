"""The gate/up expand with the gated activation (``ops.lora_expand_glu``) on the GPU: Llama-3-8B's
gate/up width with 8 adapters of rank 16 and with mixed ranks, at 1 / 32 / 128 rows (rows with no
adapter among them) in bf16 and fp16, against torch and against ``lora_expand`` then ``act_mul``;
in a graph replayed over new plans; and after a PDL GEMM that writes its input, equal to plain
launches. Run on the device machine:

    python -m pytest -m gpu tests/test_expand_glu_gpu.py
"""

import pytest
import torch

from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode
from peft_fastlora.ops import act_mul, lora_expand, pdl
from peft_fastlora.ops.lora_expand_glu import lora_expand_glu
from test_expand_glu import folded_y, make_inputs, reference
from test_stream_gemm_gpu import TOL, _captured

pytestmark = pytest.mark.gpu

N = 14336  # the 8B model's intermediate size
RANKS = {"r16": [[16, 16]] * 8, "mixed": [[8, 8], [16, 16], [32, 32], [64, 64], [16, 0], [8, 24], [40, 40], [16, 16]]}


def _rows(m, seed):
    """Each of ``m`` rows' slot: 8 adapters dealt round-robin, every fifth row with none."""
    return [NO_ADAPTER if i % 5 == 4 else (i * 3 + seed) % 8 for i in range(m)]


def _run(tri, w, y, offsets, ranks, scalings, full, act, out=None):
    bi = tri.batch_info
    return lora_expand_glu(y, w.b, offsets, ranks, scalings, full, bi.token_slot, bi.sorted_token_ids, bi.chunk_slot,
                           bi.chunk_start, bi.chunk_len, block_m=bi.block_m, act=act, b_offs=w.b_offs,
                           b_align=w.align, y_cols=w.a_rows, max_rank=w.max_rank, out=out)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 32, 128])
@pytest.mark.parametrize("ranks", list(RANKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_gate_up(dtype, ranks, m, act):
    offsets, rk, scalings, y, b, full, w, tri, ref = make_inputs(N, RANKS[ranks], _rows(m, m), dtype, seed=m,
                                                                   device=torch.device("cuda"), tail=8 * 32)
    yf = folded_y(y, w, rk)
    before = full.clone()
    out = torch.full((m, N), float("nan"), dtype=dtype, device="cuda")
    got = _run(tri, w, yf, offsets, rk, scalings, full, act, out=out)
    torch.cuda.synchronize()
    assert torch.equal(full, before)
    assert not got.isnan().any()
    atol, rtol = TOL[dtype]
    want = reference(ref, y.float(), b.float(), offsets, rk, scalings, full.float(), act)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    bi = tri.batch_info
    two = lora_expand(yf, w.b, offsets, rk, scalings, full[:, :2 * N].clone(), bi.sorted_token_ids, bi.chunk_slot,
                      bi.chunk_start, bi.chunk_len, block_m=bi.block_m, b_offs=w.b_offs, b_align=w.align,
                      y_cols=w.a_rows, max_rank=w.max_rank)
    torch.testing.assert_close(got, act_mul(two[:, :N], two[:, N:], act), atol=atol, rtol=rtol)


def test_graph_replays_new_plans():
    """Captured once at 128 rows, replayed with other adapters per row (the plan refilled in place)
    and new inputs: each replay equals an eager launch bit for bit."""
    dev = torch.device("cuda")
    offsets, rk, scalings, y, b, full, w, tri, ref = make_inputs(N, RANKS["mixed"], _rows(128, 0), torch.bfloat16,
                                                                   seed=0, device=dev, tail=8 * 64,
                                                                   graph_buffers=True)
    yf = folded_y(y, w, rk).contiguous()
    out = torch.empty(128, N, dtype=torch.bfloat16, device=dev)
    graph, _ = _captured(lambda: _run(tri, w, yf, offsets, rk, scalings, full, "silu", out=out))
    fb = ForwardBatch(128, [1] * 128, ForwardMode.DECODE, dev)
    for trial, wi in enumerate([_rows(128, 3), [NO_ADAPTER] * 128, [2] * 100 + [NO_ADAPTER] * 28]):
        tri.prepare_lora_batch(fb, wi, rk[:, 0].tolist(), [1.0] * 8, use_cuda_graph=True)
        full.copy_(torch.randn_like(full))
        yf.copy_(torch.randn_like(yf))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = _run(tri, w, yf, offsets, rk, scalings, full, "silu")
        assert torch.equal(out, expect), f"replay {trial}"


def test_pdl_after_the_gemm_that_writes_its_input(monkeypatch):
    """In one graph after a PDL GEMM (the streaming kernel) that writes ``full``: the same bits with
    PDL on and off (the launch waits before it reads the GEMM's output)."""
    from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm

    dev = torch.device("cuda")
    offsets, rk, scalings, y, b, full, w, tri, ref = make_inputs(N, RANKS["r16"], _rows(32, 1), torch.bfloat16,
                                                                   seed=1, device=dev, tail=0)
    x = torch.randn(32, 4096, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(2 * N + w.a.shape[0], 4096, device=dev, dtype=torch.bfloat16) / 64
    work = StreamWorkspace(dev, 2 * 32 * weight.shape[0], weight.shape[0] // 64 + 1)

    def chain():
        f = stream_gemm(x, weight, config=StreamConfig(64, 128, 1, 4, 4), workspace=work)
        return _run(tri, w, f[:, 2 * N:], offsets, rk, scalings, f, "silu")

    results = {}
    for setting in (pdl.OFF, pdl.FULL):
        monkeypatch.setattr(pdl, "SETTING", setting)
        graph, out = _captured(chain)
        graph.replay()
        torch.cuda.synchronize()
        results[setting] = out.clone()
    assert not results[pdl.OFF].isnan().any()
    assert torch.equal(results[pdl.OFF], results[pdl.FULL])
