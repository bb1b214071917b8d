"""The one-launch expand and act-mul of a folded gate/up site (``ops.lora_expand_act``) on the GPU:
the 8B gate/up width (14,336) at 1 / 32 / 128 / 200 rows with 8 adapters of rank 16 and with mixed
ranks (a module left out), bf16 and fp16, against its torch reference and bit for bit against the
two launches it replaces; a graph captured once and replayed over refilled plans (fewer adapters,
none, every row an adapter); after a PDL GEMM that writes its input; and a tiny float32 Llama
through real decode graphs, random batch sizes, adapters added and deleted, sampling and greedy,
tokens equal to PEFT's. Run on the device machine:

    python -m pytest -m gpu tests/test_expand_act_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from peft_fastlora.backend.triton import TritonLoRABackend
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch
from peft_fastlora.ops import act_mul, lora_expand, lora_expand_act, lora_expand_act_reference

from _helpers import pack

pytestmark = pytest.mark.gpu

N = 14336  # Llama-3-8B's gate and up widths
RANKS = {"r16x8": [[16, 16]] * 8,
         "mixed": [[8, 8], [16, 0], [32, 32], [64, 64], [0, 16], [24, 24], [8, 40], [16, 16]]}
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _rows(m, n_slots, rng, base_share=0.25):
    return [NO_ADAPTER if rng.random() < base_share else rng.randrange(n_slots) for _ in range(m)]


def _site(table, dtype, seed, width=N):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.tensor(table, dtype=torch.int32)
    r_max = int(ranks.max())
    b = (torch.randn(len(table), 2 * width, r_max, generator=g) / 8).to(dtype).cuda()
    w = pack(torch.zeros(len(table), 2 * r_max, 8, dtype=dtype, device="cuda"), b, [0, width, 2 * width],
             ranks, seed=seed)
    scalings = (torch.rand(ranks.shape, generator=g) + 0.5).float().cuda().contiguous()
    return w, ranks.cuda().contiguous(), scalings


def _full(m, w, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 2 * w.offsets[1] + w.a.shape[0], generator=g).to(dtype).cuda()


def _launch(bi, w, ranks, scalings, full, act="silu"):
    width = w.offsets[1]
    return lora_expand_act(full[:, 2 * width:], w.b, w.b_offs, w.a_rows, ranks, scalings, full[:, :2 * width],
                           bi.token_slot, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                           act=act, block_m=bi.block_m, max_rank=w.max_rank, b_align=w.align)


def _two_launches(bi, w, ranks, scalings, full, act="silu"):
    width = w.offsets[1]
    out = full[:, :2 * width].clone()
    lora_expand(full[:, 2 * width:], w.b, list(w.offsets), ranks, scalings, out, bi.sorted_token_ids, bi.chunk_slot,
                bi.chunk_start, bi.chunk_len, block_m=bi.block_m, b_offs=w.b_offs, b_align=w.align, y_cols=w.a_rows,
                max_rank=w.max_rank)
    return act_mul(out[:, :width], out[:, width:], act)


def _backend(m, wi, table):
    tri = TritonLoRABackend(len(table), "cuda")
    tri.prepare_lora_batch(ForwardBatch.from_shape(m, 1, "cuda"), wi, [16] * len(table), [1.0] * len(table),
                           use_cuda_graph=False)
    return tri


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("ranks", list(RANKS))
@pytest.mark.parametrize("m", [1, 32, 128, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_8b_width_equals_the_two_launches_and_the_reference(dtype, m, ranks, act):
    rng = random.Random(m)
    table = RANKS[ranks]
    w, rk, sc = _site(table, dtype, seed=m)
    wi = _rows(m, len(table), rng)
    tri = _backend(m, wi, table)
    full = _full(m, w, dtype, seed=m + 1)
    got = _launch(tri.batch_info, w, rk, sc, full, act)
    torch.testing.assert_close(got, _two_launches(tri.batch_info, w, rk, sc, full, act), atol=0, rtol=0)
    tok = torch.tensor(wi, dtype=torch.int32)
    want = lora_expand_act_reference(full[:, 2 * N:].cpu(), w.b.cpu(), w.b_offs.cpu(), w.a_rows.cpu(), rk.cpu(),
                                     sc.cpu(), full[:, :2 * N].cpu(), tok, act=act)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


def test_graph_replays_follow_the_plan_refilled_in_place():
    """Captured once at 96 rows on graph buffers; the plan refilled for other mixes (none, every row
    one adapter, eight adapters, a quarter base) and the GEMM output refreshed: each replay equals
    an eager launch on the new contents, bit for bit."""
    m, dtype = 96, torch.bfloat16
    table = RANKS["mixed"]
    w, rk, sc = _site(table, dtype, seed=5)
    tri = TritonLoRABackend(len(table), "cuda")
    tri.init_cuda_graph_batch_info(m, 1)
    fb = ForwardBatch.from_shape(m, 1, "cuda")
    rng = random.Random(0)
    tri.prepare_lora_batch(fb, _rows(m, 8, rng), [16] * 8, [1.0] * 8, use_cuda_graph=True)
    full = _full(m, w, dtype, seed=6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _launch(tri.batch_info, w, rk, sc, full)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _launch(tri.batch_info, w, rk, sc, full)
    for seed, wi in enumerate([[NO_ADAPTER] * m, [3] * m, [i % 8 for i in range(m)], _rows(m, 8, rng)]):
        bi = tri.prepare_lora_batch(fb, wi, [16] * 8, [1.0] * 8, use_cuda_graph=True)
        full.copy_(_full(m, w, dtype, seed=10 + seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _launch(bi, w, rk, sc, full), atol=0, rtol=0)


def test_after_a_pdl_gemm_that_writes_its_input():
    """The streaming GEMM (a PDL kernel) writes the folded output the launch reads: 32 rounds in one
    stream, each equal to the two launches on the same output (a read before the wait would show)."""
    from peft_fastlora.ops.stream_gemm import stream_gemm

    m, dtype, k = 32, torch.bfloat16, 1024
    table = RANKS["r16x8"]
    w, rk, sc = _site(table, dtype, seed=7)
    rows = 2 * N + w.a.shape[0]
    g = torch.Generator().manual_seed(8)
    weight = (torch.randn(rows, k, generator=g) / k ** 0.5).to(dtype).cuda()
    tri = _backend(m, _rows(m, 8, random.Random(1)), table)
    outs, fulls = [], []
    for r in range(32):
        x = torch.randn(m, k, generator=g).to(dtype).cuda()
        full = stream_gemm(x, weight)
        outs.append(_launch(tri.batch_info, w, rk, sc, full))
        fulls.append(full)
    torch.cuda.synchronize()
    for out, full in zip(outs, fulls):
        torch.testing.assert_close(out, _two_launches(tri.batch_info, w, rk, sc, full), atol=0, rtol=0)


def test_tiny_llama_through_decode_graphs_matches_peft():
    """A float32 tiny Llama with adapters of mixed ranks on gate and up (one on gate only, one on up
    only): random batch sizes (buckets reused, larger ones after smaller), "__base__" rows, an
    adapter added and one deleted between calls, greedy (tokens equal PEFT's) and sampled calls
    between them; the launch was taken."""
    from peft import LoraConfig, get_peft_model

    import peft_fastlora as fastlora
    from peft_fastlora import ops
    from _models import tiny_llama

    def build():
        base = tiny_llama(0, vocab_size=512, hidden_size=128, intermediate_size=256).to("cuda").eval()
        base.generation_config.eos_token_id = None
        model = None
        for i, (r, targets) in enumerate([(8, ["gate_proj", "up_proj", "q_proj"]), (16, ["gate_proj"]),
                                          (32, ["up_proj", "down_proj", "v_proj"]), (4, ["gate_proj", "up_proj"])]):
            cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
            model = get_peft_model(base, cfg, adapter_name=f"a{i}") if model is None else model
            if i:
                model.add_adapter(f"a{i}", cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        return model.eval()

    m, ref = build(), build()
    calls = []
    original = ops.lora_expand_act
    ops.lora_expand_act = lambda *a, **k: calls.append(1) or original(*a, **k)
    report = fastlora.patch(m, fold_shrink=True)
    assert report.expand_act_mlps == m.config.num_hidden_layers, report
    rng = random.Random(0)
    names = ["a0", "a1", "a2", "a3", "__base__"]
    try:
        for call, rows in enumerate([3, 17, 70, 5, 128, 33, 96, 1, 100]):
            if call == 4:
                for model in (m, ref):  # the same random weights in both (the RNG's state differs)
                    torch.manual_seed(44)
                    model.add_adapter("a4", LoraConfig(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj"],
                                                       init_lora_weights=False))
                names.append("a4")
            if call == 6:
                for model in (m, ref):
                    model.delete_adapter("a1")
                names.remove("a1")
            g = torch.Generator().manual_seed(call)
            ids = torch.randint(1, 512, (rows, 10), generator=g).cuda()
            mask = torch.ones_like(ids)
            mask[1::3, :rng.randrange(1, 9)] = 0  # some left-padded rows
            row_names = [rng.choice(names) for _ in range(rows)]
            kw = dict(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=6)
            with torch.no_grad():
                got = m.generate(**kw, do_sample=False, adapter_names=row_names)
                want = ref.generate(**kw, do_sample=False, adapter_names=row_names)
                assert torch.equal(got, want), (call, rows)
                if call % 3 == 0:  # sampled: runs through the same graphs, tokens in the vocabulary
                    torch.manual_seed(call)
                    sampled = m.generate(**kw, do_sample=True, top_k=20, adapter_names=row_names)
                    assert sampled.shape == got.shape and int(sampled.min()) >= 0 and int(sampled.max()) < 512
    finally:
        ops.lora_expand_act = original
        fastlora.unpatch(m)
    assert calls
