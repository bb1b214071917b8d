"""fastlora's attentions for the engine on the GPU: PyTorch's flash varlen kernel and the in-place
paged kernel (``ops.paged_varlen``) against the per-request reference (fp16 / bf16, grouped heads,
queries shorter than keys, decode rows, windows, long contexts split over the keys), the engine
through the reference path and through the in-place kernel in fp32 giving PEFT's tokens per
request, and a bf16 engine through each attention and the engine's graphs."""

import gc
import math

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.compat.attention import flash_varlen, flash_varlen_has_window
from peft_fastlora.compat.engine import cb_engine_attention_blocker
from peft_fastlora.compat.modules import attn_implementation
from peft_fastlora import get_state
from peft_fastlora.base_ops.paged_attention import IN_PLACE_NAME, PAGED_NAME, varlen_reference
from peft_fastlora.ops.paged_varlen import Pages, paged_varlen_attention

from _continuous import cb_config, greedy_config, peft_alone, serve as _serve
from _graphs import traffic_model as _model, traffic_prompts as _prompts

pytestmark = pytest.mark.gpu
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
ENGINE_WHY = cb_engine_attention_blocker()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(32, 8, 128, -1), (4, 4, 64, -1), (8, 2, 64, 5)])
def test_flash_varlen_matches_the_reference(dtype, heads, kv_heads, dim, window):
    if window >= 0 and not flash_varlen_has_window():
        pytest.skip("this torch's flash varlen kernel takes no window")
    g = torch.Generator().manual_seed(heads + dim)
    q_lens = [1, 1, 37, 5, 1, 130, 2]
    k_lens = [1, 300, 37, 90, 17, 200, 2]
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=g).to("cuda", dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=g).to("cuda", dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=g).to("cuda", dtype)
    scale = 1 / math.sqrt(dim)
    got = flash_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, window)
    want = varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, scale, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, window, page", [(32, 8, 128, -1, 256), (28, 4, 128, -1, 32),
                                                                 (8, 2, 64, 5, 16)])
def test_paged_kernel_matches_the_reference(dtype, heads, kv_heads, dim, window, page):
    """Keys read through a page table from a larger cache, its pages in a random order; decode rows
    with short and long contexts (split over the keys) beside prefill chunks; 8B's heads, a group
    of 7; pages as large as the engine's and smaller than a key tile."""
    g = torch.Generator().manual_seed(heads + dim)
    q_lens = [1, 1, 37, 5, 1, 130, 2, 1]
    k_lens = [1, 3000, 37, 90, 17, 200, 2, 1200]
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    counts = [-(-k // page) for k in k_lens]
    order = torch.randperm(2 * sum(counts), generator=g)[:sum(counts)]
    pages = Pages((order * page).to("cuda", torch.int32),
                  torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda"), page)
    slots = 2 * sum(counts) * page
    q = torch.randn(int(cu_q[-1]) + 4, heads, dim, generator=g).to("cuda", dtype)
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to("cuda", dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to("cuda", dtype)
    keys = torch.cat([pages.slots(i, k) for i, k in enumerate(k_lens)])
    scale = 1 / math.sqrt(dim)
    got = paged_varlen_attention(q, k_cache, v_cache, pages, cu_q, cu_k, max(q_lens), max(k_lens), scale, window)
    want = varlen_reference(q.float(), k_cache[keys].float(), v_cache[keys].float(), cu_q, cu_k, scale, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.parametrize("choice", ["varlen", "paged"])
def test_engine_in_fp32_equals_peft(choice):
    """fp32, the engine's graphs asked for: "varlen" runs its per-request reference, which syncs,
    so the graphs go off; "paged" reads the cache in place through the kernel, inside the graphs."""
    m, ref = _model(), _model()
    fastlora.patch(m, engine_attention=choice)
    try:
        prompts, names = _prompts(8, seed=21)
        manager = m.init_continuous_batching(generation_config=greedy_config(12),
                                             continuous_batching_config=cb_config(num_blocks=128,
                                                                                  use_cuda_graph=True))
        assert attn_implementation(get_state(m).inner) == (IN_PLACE_NAME if choice == "paged" else PAGED_NAME)
        manager.start()
        try:
            out = _serve(manager, list(zip(prompts, names, [12] * 8)))
        finally:
            manager.stop(block=True)
        if choice == "paged":
            stats = manager.fastlora_graphs.stats
            assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
        else:
            assert manager.fastlora_graphs is None
    finally:
        fastlora.unpatch(m)
    for tokens, p, n in zip(out, prompts, names):
        assert tokens == peft_alone(ref, p, n, 12), (n, len(p))


@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
def test_in_place_engine_graphs_under_random_traffic_equal_peft():
    """fp32, the in-place attention inside the engine's graphs with async batching and a cache of
    few pages: random bursts of requests (lengths, adapters, budgets, the base model), some
    cancelled, some naming a bad adapter. Every finished request equals PEFT alone, and no step
    falls back to eager."""
    import random

    from _continuous import assert_each_equals_peft, random_traffic
    from _graphs import TRAFFIC_NAMES

    m, ref = _model(), _model()
    fastlora.patch(m, engine_attention="paged")
    try:
        manager = m.init_continuous_batching(
            generation_config=greedy_config(16),
            continuous_batching_config=cb_config(max_batch_tokens=96, num_blocks=48, use_cuda_graph=True,
                                                 use_async_batching=True))
        assert attn_implementation(get_state(m).inner) == IN_PLACE_NAME
        manager.warmup()
        manager.start()
        try:
            expected, finished = random_traffic(manager, random.Random(41), TRAFFIC_NAMES + ["__base__"],
                                                lambda seed: _prompts(1, seed=seed)[0][0])
        finally:
            manager.stop(block=True)
        stats = manager.fastlora_graphs.stats
        assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
    finally:
        fastlora.unpatch(m)
    assert_each_equals_peft(ref, expected, finished)


@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.parametrize("choice", ["auto", "varlen", "paged"])
def test_engine_bf16_through_the_kernel_and_graphs(choice):
    m = _model(seed=6).to(torch.bfloat16)
    fastlora.patch(m, engine_attention=choice)
    try:
        inner = get_state(m).inner
        prompts, names = _prompts(24, seed=22)
        manager = m.init_continuous_batching(generation_config=greedy_config(16),
                                             continuous_batching_config=cb_config(max_batch_tokens=128, num_blocks=256,
                                                                                  use_cuda_graph=True))
        name = PAGED_NAME if choice == "varlen" else IN_PLACE_NAME  # "auto": in place on the GPU
        assert attn_implementation(inner) == name
        manager.warmup()
        manager.start()
        try:
            out = _serve(manager, list(zip(prompts, names, [16] * 24)))
        finally:
            manager.stop(block=True)
        assert attn_implementation(inner) != name  # the model's own again
        stats = manager.fastlora_graphs.stats
        assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
        for tokens in out:
            assert len(tokens) == 16 and all(0 <= t < 512 for t in tokens)
    finally:
        fastlora.unpatch(m)


@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
def test_warmup_engine_leaves_no_capture_to_the_requests():
    """``fastlora.warmup_engine`` (in-place attention, async batching, bf16): mixed prefill and
    decode traffic afterwards captures no graph, and every request's tokens equal those of a
    manager that captured its graphs as the steps came."""
    m = _model(seed=8).to(torch.bfloat16)
    fastlora.patch(m, engine_attention="paged")
    config = cb_config(max_batch_tokens=128, num_blocks=1024, use_cuda_graph=True, use_async_batching=True)
    prompts, names = _prompts(24, seed=24)
    out = {}
    try:
        for warm in (True, False):
            manager = m.init_continuous_batching(generation_config=greedy_config(12), continuous_batching_config=config)
            report = fastlora.warmup_engine(manager) if warm else None
            warmed = manager.fastlora_graphs.stats["captures"] if warm else None
            manager.start()
            try:
                out[warm] = _serve(manager, list(zip(prompts, names, [12] * 24)))
            finally:
                manager.stop(block=True)
            stats = manager.fastlora_graphs.stats
            assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
            if warm:
                assert report.query_sizes and report.captures >= 2 * len(report.query_sizes), report
                assert stats["captures"] == warmed, (stats, report)
    finally:
        fastlora.unpatch(m)
    assert out[True] == out[False]


@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.parametrize("choice", ["varlen", "paged"])
def test_a_stopped_engine_lets_its_cache_go(choice):
    """A manager's batch processor and KV cache are freed when it stops (async batching, graphs,
    bf16), by reference counting alone, so a restarted engine sizes its cache as the first did; the
    memory allocated after a second manager is within a small constant of the first's, far below
    its cache. (Each manager's new CUDA streams keep a cuBLAS workspace: that constant.)"""
    import weakref

    m = _model(seed=7).to(torch.bfloat16)
    fastlora.patch(m, engine_attention=choice)
    config = cb_config(max_batch_tokens=128, num_blocks=16384, use_cuda_graph=True, use_async_batching=True)
    prompts, names = _prompts(12, seed=23)
    allocated, cache_bytes = [], []
    gc.disable()
    try:
        for _ in range(2):
            start = torch.cuda.memory_allocated()
            manager = m.init_continuous_batching(generation_config=greedy_config(8), continuous_batching_config=config)
            manager.warmup()
            manager.start()
            try:
                _serve(manager, list(zip(prompts, names, [8] * 12)))
                processor = weakref.ref(manager.batch_processor)
                cache = weakref.ref(manager.batch_processor.cache)
                cache_bytes.append(torch.cuda.memory_allocated() - start)
            finally:
                manager.stop(block=True)
            assert processor() is None and cache() is None
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
    finally:
        gc.enable()
        fastlora.unpatch(m)
    assert min(cache_bytes) > 128 * 2**20, cache_bytes
    assert allocated[1] - allocated[0] < min(cache_bytes) // 2, (allocated, cache_bytes)
