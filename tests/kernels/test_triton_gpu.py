"""The Triton kernels on the GPU: bf16/fp16 at Llama-3-8B projection shapes, and CUDA-graph replay
of a batch with more distinct adapters than the one captured. Run on a GPU machine:

    python -m pytest -m gpu tests/test_triton_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from _graphs import captured
from peft_fastlora.backend.torch_native import TorchNativeLoRABackend
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode

pytestmark = pytest.mark.gpu

# (dtype, atol, rtol): both sides accumulate in fp32 and round once; a rounding that falls the
# other way costs one ulp (bf16: 2^-8 relative, fp16: 2^-11), here about 2-4 ulps of margin
TOLERANCES = {
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}

HIDDEN, Q, KV, INTER = 4096, 4096, 1024, 14336
SITES = {  # name: (input dim, output offsets)
    "qkv": (HIDDEN, [0, Q, Q + KV, Q + 2 * KV]),
    "o": (HIDDEN, [0, HIDDEN]),
    "gate_up": (HIDDEN, [0, INTER, 2 * INTER]),
    "down": (INTER, [0, HIDDEN]),
}
NUM_ADAPTERS = 8
MODES = {
    "decode_bs32": [1] * 32,
    "prefill": [700, 300, 1024, 57, 1, 6],  # 2088 tokens: the largest row tile
}


def assert_close(actual, expected, atol, rtol, name, show=8):
    a, e = actual.float(), expected.float()
    bad = ~((a - e).abs() <= atol + rtol * e.abs())
    if bad.any():
        idx = bad.nonzero()[:show].tolist()
        lines = [f"{name}: {int(bad.sum())} of {a.numel()} elements differ (atol={atol}, rtol={rtol})"]
        lines += [f"  at {tuple(i)}: got {a[tuple(i)].item():.6g}, expected {e[tuple(i)].item():.6g}"
                  for i in idx]
        raise AssertionError("\n".join(lines))


def slot_tables(rank, c, skip_a_module=True):
    """Mixed ranks within the padded ``rank``; optionally one adapter without its second module."""
    per_slot = [rank, max(1, rank // 2), rank, 8, rank, 1, rank, 16][:NUM_ADAPTERS]
    ranks = torch.tensor([min(r, rank) for r in per_slot], dtype=torch.int32)[:, None].repeat(1, c)
    if c > 1 and skip_a_module:
        ranks[3, 1] = 0
    scalings = torch.tensor([2.0, 0.5, 1.0, 0.25, 1.5, 4.0, 1.0, 0.125])[:, None].repeat(1, c)
    return ranks.contiguous().cuda(), scalings.float().contiguous().cuda()


def make_weights(k, offsets, rank, ranks, dtype):
    """A (L, c*rank, k) and B (L, N, rank), NaN past each (slot, module) rank."""
    c = len(offsets) - 1
    a = torch.randn(NUM_ADAPTERS, c * rank, k, device="cuda") / k ** 0.5
    b = torch.randn(NUM_ADAPTERS, offsets[-1], rank, device="cuda") / rank ** 0.5
    rk = ranks.tolist()
    for s in range(NUM_ADAPTERS):
        for j in range(c):
            a[s, j * rank + rk[s][j] : (j + 1) * rank] = float("nan")
            b[s, offsets[j] : offsets[j + 1], rk[s][j] :] = float("nan")
    return a.to(dtype), b.to(dtype)


def mixed_indices(bs, n_distinct):
    """Round-robin over ``n_distinct`` adapters, every fifth row with none."""
    return [NO_ADAPTER if i % 5 == 4 else i % n_distinct for i in range(bs)]


def backends(seq_lens, wi, ranks, scalings):
    from peft_fastlora.backend.triton import TritonLoRABackend

    mode = ForwardMode.DECODE if all(n == 1 for n in seq_lens) else ForwardMode.EXTEND
    fb = ForwardBatch(len(seq_lens), seq_lens, mode, torch.device("cuda"))
    tri, ref = TritonLoRABackend(NUM_ADAPTERS, "cuda"), TorchNativeLoRABackend(NUM_ADAPTERS, "cuda")
    for be in (tri, ref):
        be.prepare_lora_batch(fb, wi, ranks[:, 0].tolist(), scalings[:, 0].tolist(), False)
    return tri, ref


def run_site(be, site, x, a, b, offsets, base, ranks, scalings):
    kw = dict(base_output=base, layer_ranks=ranks, layer_scalings=scalings)
    if site == "qkv":
        return be.run_qkv_lora(x, a, b, output_offset=offsets, **kw)
    if site == "gate_up":
        return be.run_gate_up_lora(x, a, b, **kw)
    y = be.run_lora_a_sgemm(x, a, stack_num=1, layer_ranks=ranks)
    return be.run_lora_b_sgemm(y, b, **kw)


CASES = [(torch.bfloat16, site, rank, mode) for site in SITES for rank in (16, 64) for mode in MODES]
CASES += [(torch.float16, site, rank, "decode_bs32") for site in ("qkv", "gate_up") for rank in (16, 64)]


@pytest.mark.parametrize("dtype,site,rank,mode", CASES,
                         ids=[f"{str(d)[6:]}-{s}-r{r}-{m}" for d, s, r, m in CASES])
def test_llama_shapes(dtype, site, rank, mode):
    torch.manual_seed(0)
    k, offsets = SITES[site]
    c = len(offsets) - 1
    seq_lens = MODES[mode]
    wi = mixed_indices(len(seq_lens), NUM_ADAPTERS)
    ranks, scalings = slot_tables(rank, c)
    tri, ref = backends(seq_lens, wi, ranks, scalings)
    s = sum(seq_lens)
    x = torch.randn(s, k, device="cuda", dtype=dtype)
    a, b = make_weights(k, offsets, rank, ranks, dtype)
    base = torch.randn(s, offsets[-1], device="cuda", dtype=dtype)
    no_adapter = torch.tensor([w < 0 for w, n in zip(wi, seq_lens) for _ in range(n)], device="cuda")
    base[no_adapter] = 1234.5
    got = run_site(tri, site, x, a, b, offsets, base.clone(), ranks, scalings)
    want = run_site(ref, site, x, a, b, offsets, base.clone(), ranks, scalings)
    assert not got.isnan().any(), "read past an adapter's rank"
    assert torch.equal(got[no_adapter], base[no_adapter]), "rows with no adapter were modified"
    atol, rtol = TOLERANCES[dtype]
    assert_close(got, want, atol, rtol, f"{site} {dtype} rank {rank} {mode}")


def test_cuda_graph_replay_with_more_adapters_than_captured():
    """Capture run_qkv_lora on the static batch info of a 1-adapter batch, refresh the info with
    an 8-adapter mix, replay: every row must get its own adapter's delta."""
    from peft_fastlora.backend.triton import TritonLoRABackend

    torch.manual_seed(0)
    dtype, bs, rank = torch.bfloat16, 32, 16
    k, offsets = SITES["qkv"]
    ranks, scalings = slot_tables(rank, 3, skip_a_module=False)  # the batch's ranks apply
    slot_ranks, slot_scalings = ranks[:, 0].tolist(), scalings[:, 0].tolist()
    a, b = make_weights(k, offsets, rank, ranks, dtype)
    tri = TritonLoRABackend(NUM_ADAPTERS, "cuda")
    tri.init_cuda_graph_batch_info(bs, 1)
    fb = ForwardBatch.from_shape(bs, 1, "cuda")
    tri.prepare_lora_batch(fb, [0] * (bs // 2) + [NO_ADAPTER] * (bs // 2), slot_ranks, slot_scalings,
                           use_cuda_graph=True)
    static_x = torch.randn(bs, k, device="cuda", dtype=dtype)
    static_base = torch.randn(bs, offsets[-1], device="cuda", dtype=dtype)
    static_out = torch.empty_like(static_base)

    def step():
        static_out.copy_(static_base)
        # no layer tables: the ranks and scalings come from the static batch info too
        tri.run_qkv_lora(static_x, a, b, output_offset=offsets, base_output=static_out)

    graph, _ = captured(step, warmups=2)

    wi = mixed_indices(bs, NUM_ADAPTERS)
    assert len({w for w in wi if w >= 0}) == NUM_ADAPTERS
    tri.prepare_lora_batch(fb, wi, slot_ranks, slot_scalings, use_cuda_graph=True)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.cuda.synchronize()

    ref = TorchNativeLoRABackend(NUM_ADAPTERS, "cuda")
    ref.prepare_lora_batch(fb, wi, slot_ranks, slot_scalings, use_cuda_graph=False)
    want = ref.run_qkv_lora(static_x, a, b, output_offset=offsets, base_output=static_base.clone())
    atol, rtol = TOLERANCES[dtype]
    assert_close(static_out, want, atol, rtol, "qkv graph replay")


# ---- the fused decode kernel (one launch per site) --------------------------------------------
FUSED_CASES = [(torch.bfloat16, site, rank) for site in ("o", "down") for rank in (16, 64)]


@pytest.mark.parametrize("dtype,site,rank", FUSED_CASES,
                         ids=[f"{str(d)[6:]}-{s}-r{r}" for d, s, r in FUSED_CASES])
def test_fused_run_lora_decode(dtype, site, rank):
    """The single-module call of the layers (``run_lora``), fused for decode; down has K=14336
    (28-56 K splits)."""
    torch.manual_seed(0)
    k, offsets = SITES[site]
    seq_lens = MODES["decode_bs32"]
    wi = mixed_indices(len(seq_lens), NUM_ADAPTERS)
    ranks, scalings = slot_tables(rank, 1)
    tri, ref = backends(seq_lens, wi, ranks, scalings)
    x = torch.randn(len(seq_lens), k, device="cuda", dtype=dtype)
    a, b = make_weights(k, offsets, rank, ranks, dtype)
    base = torch.randn(len(seq_lens), offsets[-1], device="cuda", dtype=dtype)
    kw = dict(layer_ranks=ranks, layer_scalings=scalings)
    got = tri.run_lora(x, a, b, base_output=base.clone(), **kw)
    want = ref.run_lora(x, a, b, base_output=base.clone(), **kw)
    assert not got.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    assert_close(got, want, atol, rtol, f"fused {site} rank {rank}")
    assert tri.fused_timeouts() == 0


def test_fused_graph_replays_share_a_clean_workspace():
    """All four Llama sites captured in one graph share one workspace; replayed with a new mix of
    adapters each time, every call must find it clean (counters, accumulator, ticket) and leave
    it so: a counter left set would let a later reader use partial sums."""
    from peft_fastlora.backend.triton import TritonLoRABackend

    torch.manual_seed(0)
    dtype, bs, rank = torch.bfloat16, 32, 16
    tri = TritonLoRABackend(NUM_ADAPTERS, "cuda")
    tri.init_cuda_graph_batch_info(bs, 1)
    fb = ForwardBatch.from_shape(bs, 1, "cuda")
    ranks, scalings = slot_tables(rank, 1, skip_a_module=False)
    slot_ranks, slot_scalings = ranks[:, 0].tolist(), scalings[:, 0].tolist()
    tri.prepare_lora_batch(fb, [0] * bs, slot_ranks, slot_scalings, use_cuda_graph=True)
    ws = tri._workspace(torch.device("cuda"))
    addresses = (ws.acc.data_ptr(), ws.sync.data_ptr())  # reserved for the graph already
    static = {}
    for site, (k, offsets) in SITES.items():
        c = len(offsets) - 1
        site_ranks, site_scalings = slot_tables(rank, c)
        a, b = make_weights(k, offsets, rank, site_ranks, dtype)
        static[site] = dict(x=torch.randn(bs, k, device="cuda", dtype=dtype),
                            base=torch.randn(bs, offsets[-1], device="cuda", dtype=dtype),
                            out=torch.empty(bs, offsets[-1], device="cuda", dtype=dtype),
                            a=a, b=b, ranks=site_ranks, scalings=site_scalings, offsets=offsets)

    def step():
        for site, t in static.items():
            t["out"].copy_(t["base"])
            kw = dict(base_output=t["out"], layer_ranks=t["ranks"], layer_scalings=t["scalings"])
            if len(t["offsets"]) == 2:
                tri.run_lora(t["x"], t["a"], t["b"], **kw)
            else:
                tri.run_stacked_lora(t["x"], t["a"], t["b"], output_offset=t["offsets"], **kw)

    graph, _ = captured(step, warmups=2)

    ref = TorchNativeLoRABackend(NUM_ADAPTERS, "cuda")
    gen = torch.Generator().manual_seed(1)
    atol, rtol = TOLERANCES[dtype]
    for it in range(12):
        n_distinct = [1, 3, 8][it % 3]
        wi = torch.randint(-1, n_distinct, (bs,), generator=gen).tolist()
        tri.prepare_lora_batch(fb, wi, slot_ranks, slot_scalings, use_cuda_graph=True)
        ref.prepare_lora_batch(fb, wi, slot_ranks, slot_scalings, use_cuda_graph=False)
        for t in static.values():
            t["x"].copy_(torch.randn_like(t["x"]))
        graph.replay()
        for site, t in static.items():
            want = ref.run_stacked_lora(t["x"], t["a"], t["b"], output_offset=t["offsets"],
                                        base_output=t["base"].clone(), layer_ranks=t["ranks"],
                                        layer_scalings=t["scalings"])
            assert_close(t["out"], want, atol, rtol, f"{site} replay {it}")
    torch.cuda.synchronize()
    assert (ws.acc.data_ptr(), ws.sync.data_ptr()) == addresses, "a capture allocated a workspace"
    assert int(ws.sync[0]) == 0 and not ws.sync[2:].any() and not ws.acc.any()
    assert tri.fused_timeouts() == 0


# ---- packed weights (each adapter at its own rank, only its modules) ----------------------------
def check_packed_site(tri, ref, site, x, w, padded, ranks, scalings, no_adapter, what):
    """One call on packed weights ``w`` against the torch backend on the same weights ``padded``
    (A, B), from a fresh base output whose rows with no adapter hold a marker value: no NaN (no
    read outside a block or past a rank), those rows untouched, the rest close."""
    offsets = list(w.offsets)
    base = torch.randn(x.shape[0], offsets[-1], device=x.device, dtype=x.dtype)
    base[no_adapter] = 1234.5
    got = tri.run_packed_lora(x, w, base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
    want = run_site(ref, site, x, *padded, offsets, base.clone(), ranks, scalings)
    assert not got.isnan().any(), f"{what}: read outside a packed block or past a rank"
    assert torch.equal(got[no_adapter], base[no_adapter]), f"{what}: rows with no adapter were modified"
    atol, rtol = TOLERANCES[x.dtype]
    assert_close(got, want, atol, rtol, what)


PACKED_CASES = [(site, rank, mode) for site in SITES for rank in (16, 64) for mode in MODES]


@pytest.mark.parametrize("site,rank,mode", PACKED_CASES, ids=[f"{s}-r{r}-{m}" for s, r, m in PACKED_CASES])
def test_packed_llama_shapes(site, rank, mode):
    """bf16 packed weights (shuffled blocks, NaN around them) through the fused decode launch or
    the shrink and expand kernels, against the torch backend on the same weights padded."""
    from _helpers import pack

    torch.manual_seed(0)
    dtype = torch.bfloat16
    k, offsets = SITES[site]
    seq_lens = MODES[mode]
    wi = mixed_indices(len(seq_lens), NUM_ADAPTERS)
    ranks, scalings = slot_tables(rank, len(offsets) - 1)
    tri, ref = backends(seq_lens, wi, ranks, scalings)
    s = sum(seq_lens)
    x = torch.randn(s, k, device="cuda", dtype=dtype)
    a, b = make_weights(k, offsets, rank, ranks, dtype)
    w = pack(a, b, offsets, ranks.cpu(), seed=rank)
    no_adapter = torch.tensor([w_ < 0 for w_, n in zip(wi, seq_lens) for _ in range(n)], device="cuda")
    check_packed_site(tri, ref, site, x, w, (a, b), ranks, scalings, no_adapter, f"packed {site} rank {rank} {mode}")
    assert tri.fused_timeouts() == 0


@pytest.mark.parametrize("rank_block", [0, 16, 32, 64], ids=lambda r: f"rank_block{r}" if r else "library")
@pytest.mark.parametrize("site", ["qkv", "o", "down"])
def test_fused_many_adapters_mixed_ranks(site, rank_block):
    """The registry's hard case: 64 distinct adapters of ranks 8-64 in a 72-row decode batch (one
    chunk each, 8 rows with no adapter), packed with NaN around every block, through the fused
    launch stepping through ranks in blocks of 16, 32 rows or one tile, or the library's launch
    for mixed ranks (blocks of 16, one tile live, a register cap); fresh inputs each call."""
    from _helpers import pack
    from peft_fastlora.backend.triton import TritonLoRABackend

    torch.manual_seed(rank_block)
    n, dtype = 64, torch.bfloat16
    k, offsets = SITES[site]
    c = len(offsets) - 1
    per_slot = [(8, 16, 32, 64, 24, 40)[i % 6] for i in range(n)]
    ranks = torch.tensor(per_slot, dtype=torch.int32)[:, None].repeat(1, c).contiguous()
    if c > 1:
        ranks[5, 1] = 0  # an adapter without one of the modules
    scalings = (torch.rand(n, c) + 0.25).contiguous()
    a = torch.randn(n, c * 64, k, device="cuda") / k ** 0.5
    b = torch.randn(n, offsets[-1], 64, device="cuda") / 8
    for s_ in range(n):
        for j in range(c):
            r = int(ranks[s_, j])
            a[s_, j * 64 + r: (j + 1) * 64] = float("nan")
            b[s_, offsets[j]: offsets[j + 1], r:] = float("nan")
    a, b = a.to(dtype), b.to(dtype)
    w = pack(a, b, offsets, ranks, seed=rank_block)
    w.mixed_ranks = not rank_block  # the pool sets it where its adapters' ranks differ
    ranks, scalings = ranks.cuda(), scalings.cuda()
    wi = [i % n if i % 9 != 8 else NO_ADAPTER for i in range(n + 8)]
    seq_lens = [1] * len(wi)
    fb = ForwardBatch(len(wi), seq_lens, ForwardMode.DECODE, torch.device("cuda"))
    tri, ref = TritonLoRABackend(n, "cuda", rank_block=rank_block or None), TorchNativeLoRABackend(n, "cuda")
    for be in (tri, ref):
        be.prepare_lora_batch(fb, wi, ranks[:, 0].tolist(), scalings[:, 0].tolist(), False)
    no_adapter = torch.tensor([w_ < 0 for w_ in wi], device="cuda")
    for _ in range(2):
        x = torch.randn(len(wi), k, device="cuda", dtype=dtype)
        check_packed_site(tri, ref, site, x, w, (a, b), ranks, scalings, no_adapter,
                          f"{site}, 64 adapters, rank block {rank_block}")
    assert tri.fused_timeouts() == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_packed_embedding_llama_vocab(mode):
    """A LoRA embedding on packed weights at Llama 3's vocabulary and width, bf16: the lookup and
    expand kernels against the torch backend on the same weights padded."""
    from _helpers import pack

    torch.manual_seed(0)
    dtype, vocab, rank = torch.bfloat16, 128256, 64
    seq_lens = MODES[mode]
    wi = mixed_indices(len(seq_lens), NUM_ADAPTERS)
    ranks, scalings = slot_tables(rank, 1)
    tri, ref = backends(seq_lens, wi, ranks, scalings)
    a = torch.randn(NUM_ADAPTERS, rank, vocab, device="cuda").to(dtype)
    b = (torch.randn(NUM_ADAPTERS, HIDDEN, rank, device="cuda") / rank ** 0.5).to(dtype)
    for s_, r in enumerate(ranks[:, 0].tolist()):
        a[s_, r:] = 0
        b[s_, :, r:] = float("nan")
    w = pack(a, b, [0, HIDDEN], ranks.cpu(), seed=1)
    s = sum(seq_lens)
    ids = torch.randint(0, vocab, (s,), device="cuda")
    base = torch.randn(s, HIDDEN, device="cuda", dtype=dtype)
    got = tri.run_packed_embedding_lora(ids, w, vocab, base_output=base.clone(), layer_ranks=ranks,
                                        layer_scalings=scalings)
    y = ref.run_lora_a_embedding(ids, a, vocab)
    want = ref.run_lora_b_sgemm(y, b, base_output=base.clone(), layer_ranks=ranks, layer_scalings=scalings)
    assert not got.isnan().any(), "read outside a packed block"
    atol, rtol = TOLERANCES[dtype]
    assert_close(got, want, atol, rtol, f"packed embedding {mode}")


def _pdl_chain(x, res, w, q, k, cos, sin, kc, vc, length, y, b_arena, b_offs, ranks, scal, plan):
    """Dependent decode-path kernels, each reading what the one before wrote: norm, expand into
    the norm's output, add+norm, SiLU-mul, rotary, KV write, decode attention."""
    from peft_fastlora.ops import add_rms_norm, apply_rotary, decode_attention, kv_cache_write, lora_expand
    from peft_fastlora.ops import rms_norm, silu_mul

    h = rms_norm(x, w, 1e-5)
    lora_expand(y, b_arena, [0, h.shape[1]], ranks, scal, h, *plan, block_m=16, b_offs=b_offs, b_align=8)
    h, s = add_rms_norm(h, res, w, 1e-5)
    g = silu_mul(h, s)
    qr, kr = apply_rotary(q + g[:, None, None, :q.shape[-1]], k, cos, sin)
    kv_cache_write(kr, kr, kc, vc, length)
    mask = torch.ones(x.shape[0], 1, 1, kc.shape[2], dtype=torch.bool, device=x.device)
    return g, decode_attention(qr, kc, vc, mask)


def test_pdl_chain_in_a_graph_equals_serial_launches():
    """The kernels launched with programmatic dependent launch (ops/pdl.py) give bit-for-bit what
    they give launched one after another, captured in one CUDA graph and replayed many times
    with new inputs each time (a wait placed too late would read a stale input)."""
    from peft_fastlora.ops import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    torch.manual_seed(0)
    dev, dt, n, rows, heads, dim, r = "cuda", torch.bfloat16, 1024, 32, 8, 128, 16
    w = torch.randn(n, device=dev, dtype=dt)
    b_arena = (torch.randn(4 * n * r, device=dev, dtype=dt) * 0.1)
    b_offs = torch.tensor([[i * n * r] for i in range(4)], device=dev, dtype=torch.int64)
    ranks = torch.full((4, 1), r, device=dev, dtype=torch.int32)
    scal = torch.full((4, 1), 0.5, device=dev, dtype=torch.float32)
    slots = [i % 4 if i % 5 else NO_ADAPTER for i in range(rows)]
    ids = sorted((t for t in range(rows) if slots[t] >= 0), key=lambda t: slots[t])
    chunks = [(s, [t for t in ids if slots[t] == s]) for s in range(4)]
    plan = (torch.tensor(ids + [0] * (rows - len(ids)), device=dev, dtype=torch.int32),
            torch.tensor([s for s, _ in chunks] + [NO_ADAPTER] * 4, device=dev, dtype=torch.int32),
            torch.tensor([ids.index(c[0]) for _, c in chunks] + [0] * 4, device=dev, dtype=torch.int32),
            torch.tensor([len(c) for _, c in chunks] + [0] * 4, device=dev, dtype=torch.int32))
    inputs = dict(x=torch.empty(rows, n, device=dev, dtype=dt), res=torch.empty(rows, n, device=dev, dtype=dt),
                  q=torch.empty(rows, heads, 1, dim, device=dev, dtype=dt),
                  k=torch.empty(rows, 2, 1, dim, device=dev, dtype=dt),
                  cos=torch.empty(rows, 1, dim, device=dev, dtype=dt), sin=torch.empty(rows, 1, dim, device=dev, dtype=dt),
                  y=torch.empty(rows, r, device=dev, dtype=dt))

    def refill(step):
        g = torch.Generator(device=dev).manual_seed(step)
        for t in inputs.values():
            t.copy_(torch.randn(t.shape, device=dev, dtype=torch.float32, generator=g))

    results = {}
    modes = {"serial": pdl.OFF, "wait_only": pdl.WAIT_ONLY, "pdl": pdl.FULL}
    for mode, setting in modes.items():
        kc = torch.zeros(rows, 2, 64, dim, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        length = torch.zeros(1, device=dev, dtype=torch.int64)
        refill(0)
        static = dict(inputs, w=w, kc=kc, vc=vc, length=length, b_arena=b_arena, b_offs=b_offs, ranks=ranks,
                      scal=scal, plan=plan)
        with pdl.launches(setting):
            _pdl_chain(**static)  # compile outside the capture
            length.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = _pdl_chain(**static)
                length.add_(1)
        got = []
        for step in range(40):
            refill(step)
            graph.replay()
            got.append(tuple(o.clone() for o in outs))
        torch.cuda.synchronize()
        results[mode] = (got, kc.clone())
    for mode in ("wait_only", "pdl"):
        for step, (a, b) in enumerate(zip(results["serial"][0], results[mode][0])):
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), (mode, step, i)
        assert torch.equal(results["serial"][1], results[mode][1]), mode


@pytest.mark.parametrize("split_k", [2, 4, 7])
@pytest.mark.parametrize("site", ["qkv", "down"])
def test_shrink_split_k_at_engine_step_sizes(site, split_k):
    """The shrink with K split over programs (a launch option ``sweep_expand.py`` times), bf16 at the 8B widths, the 32-row tiles of an engine step (segments of 1 to 70 tokens,
    mixed ranks, rows with no adapter): within bf16 of the torch reference and of one split; the
    same bits run after run (the partials are summed in split order, whichever program arrives
    last); and captured in a CUDA graph, whose replays zero the tile counters again, with the
    inputs changed between replays."""
    from peft_fastlora.batch import plan_chunks
    from peft_fastlora.ops import lora_shrink

    k, offsets = SITES[site]
    c, rank, dtype = len(offsets) - 1, 16, torch.bfloat16
    atol, rtol = TOLERANCES[dtype]
    ranks, _ = slot_tables(rank, c)
    a, _ = make_weights(k, offsets, rank, ranks, dtype)
    g = torch.Generator().manual_seed(split_k)
    lens = torch.randint(1, 71, (24,), generator=g).tolist()
    slots = [NO_ADAPTER if i % 7 == 3 else i % NUM_ADAPTERS for i in range(len(lens))]
    plan = [torch.as_tensor(p, dtype=torch.int32, device="cuda") for p in plan_chunks(slots, lens, 32)[1:5]]
    token_slot = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)], device="cuda")
    x = torch.randn(len(token_slot), k, device="cuda", dtype=dtype)

    def want():
        y = torch.zeros(len(token_slot), c * rank, device="cuda")
        for s in token_slot.unique().tolist():
            if s >= 0:
                rows = (token_slot == s).nonzero().squeeze(1)
                y[rows] = x[rows].float() @ torch.nan_to_num(a[s].float()).T
        return y

    mask = torch.zeros(len(token_slot), c * rank, dtype=torch.bool, device="cuda")
    for t, s in enumerate(token_slot.tolist()):
        for j in range(c):
            if s >= 0:
                mask[t, j * rank: j * rank + int(ranks[s, j])] = True
    run = lambda sk: lora_shrink(x, a, c, ranks, *plan, block_m=32, split_k=sk)  # noqa: E731
    one, got, again = run(1), run(split_k), run(split_k)
    assert torch.equal(got[mask], again[mask]), "the split sum changed between runs"
    assert_close(got[mask], want()[mask], atol, rtol, f"split_k={split_k} against torch")
    assert_close(got[mask], one[mask], atol, rtol, f"split_k={split_k} against one split")
    out = torch.zeros(len(token_slot), c * rank, device="cuda", dtype=dtype)
    graph, _ = captured(lambda: lora_shrink(x, a, c, ranks, *plan, block_m=32, split_k=split_k, out=out),
                        warmups=2)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + seed)).to("cuda", dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out[mask], want()[mask], atol, rtol, f"split_k={split_k}, replay {seed}")
