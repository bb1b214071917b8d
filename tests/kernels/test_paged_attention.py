"""fastlora's varlen attention for the engine (``PAGED_NAME``): each request's queries over its own keys (CPU).

The per-request torch reference against a plain per-query softmax (grouped heads, queries shorter
than keys, windows, padded rows); the engine serving through it (``engine_attention="varlen"``,
the reference on CPU) gives PEFT's tokens per request; where this transformers' engine cannot
take it, "auto" keeps the engine's attention and "varlen" is refused with the reason.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.compat.engine import cb_async_blocker, cb_engine_attention_blocker
from peft_fastlora.compat.modules import attn_implementation
from peft_fastlora import get_state
from peft_fastlora.base_ops.paged_attention import IN_PLACE_NAME, PAGED_NAME, varlen_reference
from peft_fastlora.kernel_support import interpreting

from _continuous import cb_config, greedy_config, peft_alone, random_prompts, requires_cb, serve
from _models import build_peft_lm

cb = requires_cb
ENGINE_WHY = cb_engine_attention_blocker()
ENGINE_ASYNC_WHY = cb_async_blocker()


def _per_query(q, k, v, cu_q, cu_k, scale, window):
    """One query at a time: the keys it may see, a softmax, a weighted sum."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        for j in range(lq):
            pos = lk - lq + j
            lo = 0 if window < 0 else max(0, pos - window)
            for h in range(q.shape[1]):
                keys = k[cu_k[i] + lo:cu_k[i] + pos + 1, h // groups]
                vals = v[cu_k[i] + lo:cu_k[i] + pos + 1, h // groups]
                w = torch.softmax(keys @ q[cu_q[i] + j, h] * scale, dim=0)
                out[cu_q[i] + j, h] = w @ vals
    return out


@pytest.mark.parametrize("heads, kv_heads, window", [(4, 4, -1), (8, 2, -1), (6, 3, 3)])
def test_reference_matches_a_per_query_softmax(heads, kv_heads, window):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q_lens, k_lens = [1, 5, 3, 1, 7], [9, 5, 12, 1, 7]  # decode rows, prefills, chunks with history
    cu_q = [0] + list(torch.tensor(q_lens).cumsum(0).tolist())
    cu_k = [0] + list(torch.tensor(k_lens).cumsum(0).tolist())
    pad = 3  # padded query rows past the last request
    q = torch.randn(cu_q[-1] + pad, heads, 16, generator=g, dtype=torch.float64)
    k = torch.randn(cu_k[-1], kv_heads, 16, generator=g, dtype=torch.float64)
    v = torch.randn(cu_k[-1], kv_heads, 16, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(16)
    got = varlen_reference(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), scale, window)
    want = _per_query(q, k, v, cu_q, cu_k, scale, window)
    torch.testing.assert_close(got, want)
    assert torch.count_nonzero(got[cu_q[-1]:]) == 0


def test_a_model_split_over_devices_keeps_the_gathering_attention():
    """Each step's page table lives on one device: a model split over several (accelerate's
    ``device_map``, a parameter on another device here) is refused the in-place attention by name."""
    from peft_fastlora.base_ops.paged_attention import in_place_blocker

    m = build_peft_lm("llama")
    inner = m.get_base_model()
    assert in_place_blocker(inner, torch.float32, torch.device("cpu")) is None or not interpreting()
    head = inner.lm_head
    head.weight = torch.nn.Parameter(torch.empty(head.weight.shape, device="meta"), requires_grad=False)
    why = in_place_blocker(inner, torch.float32, torch.device("cpu"))
    assert why is not None and ("meta" in why or not interpreting()), why


@cb
def test_options_validate():
    with pytest.raises(ValueError, match="engine_attention"):
        fastlora.patch(build_peft_lm("llama"), engine_attention="flash")


def _serve_through(arch: str, choice: str):
    """A manager of ``arch`` patched with ``engine_attention=choice`` serving five requests (prompts
    longer than a step's 16 tokens come in chunks beside decode rows): the model's attention while
    it ran and after, and each request against PEFT's tokens for its prompt alone."""
    m = build_peft_lm(arch)
    ref = copy.deepcopy(m)
    fastlora.patch(m, engine_attention=choice)
    seen = []
    try:
        inner = get_state(m).inner
        manager = m.init_continuous_batching(generation_config=greedy_config(6),
                                             continuous_batching_config=cb_config(max_batch_tokens=16))
        seen.append(attn_implementation(inner))
        manager.start()
        prompts = random_prompts([3, 17, 9, 30, 1], seed=11)
        names = ["a0", "a1", "__base__", "a2", "a1"]
        ids = [manager.add_request(p, adapter_name=n) for p, n in zip(prompts, names)]
        done = {}
        while len(done) < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None
            if r.is_finished():
                assert r.error is None, r.error
                done[r.request_id] = list(r.generated_tokens)
        manager.stop(block=True)
        seen.append(attn_implementation(inner))
    finally:
        fastlora.unpatch(m)
    return seen, [(done[rid], peft_alone(ref, p, n, 6), (n, len(p))) for rid, p, n in zip(ids, prompts, names)]


@cb
@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_through_varlen_attention_equals_peft_per_request(arch):
    """Mistral hands its sliding window to the attention function (its attention module has no
    attribute for it): prompts longer than the window see only the window."""
    seen, results = _serve_through(arch, "varlen")
    assert seen == [PAGED_NAME, "eager"]  # on while the manager ran, the model's own after
    for got, want, what in results:
        assert got == want, what


@cb
@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.skipif(not interpreting(), reason="the kernel runs on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_reading_its_cache_in_place_equals_peft_per_request(arch, monkeypatch):
    """``engine_attention="paged"``: every step goes through the in-place kernel (decode rows and
    prefill chunks with history beside each other, the keys found through the step's pages), none
    through a gathered copy of the cache, and the engine builds no read index of every key a step
    reads; every request's tokens equal PEFT's for its prompt alone.
    Mistral's sliding-window layers, which the engine lays out as a ring, take the varlen path (a
    gathered copy) and still equal PEFT."""
    from peft_fastlora.base_ops import paged_attention

    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    kernel_steps, gathers, read_lists = [], [], []
    kernel, index_select = paged_attention.paged_kernel, torch.index_select
    monkeypatch.setattr(paged_attention, "paged_kernel",
                        lambda q, *a: (kernel_steps.append(q.shape[0]), kernel(q, *a))[1])
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: (gathers.append(1), index_select(*a, **k))[1])
    extend = PagedAttentionCache.extend_read_and_write_indices

    def extend_(self, request_id, past_length, query_length, read_index, write_index):
        read_lists.append(read_index is not None)  # the engine builds a slot index per key read
        return extend(self, request_id, past_length, query_length, read_index, write_index)

    monkeypatch.setattr(PagedAttentionCache, "extend_read_and_write_indices", extend_)
    seen, results = _serve_through(arch, "paged")
    assert seen == [IN_PLACE_NAME, "eager"]
    if arch == "mistral":  # every layer a sliding one: all through the varlen path
        assert gathers and not kernel_steps, (len(kernel_steps), len(gathers))
        assert any(read_lists)
    else:  # the kernel finds each request's keys through the step's pages: no read index is built
        assert kernel_steps and not gathers, (len(kernel_steps), len(gathers))
        assert read_lists and not any(read_lists)
    for got, want, what in results:
        assert got == want, what


@cb
@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
def test_the_engine_config_keeps_the_callers_graphs_padding_and_async_batching():
    """fastlora turns off what per-request adapters cannot take (prefix sharing, compilation) and
    leaves the engine's graphs, its key padding and async batching as the caller set them (the
    in-place attention makes the key padding moot: no read index is built)."""
    from peft_fastlora.compat.engine import cb_config_for_lora

    for graphs in (None, False, True):
        for padding in (0, 512):
            for asked in (None, False, True):
                own = cb_config(use_cuda_graph=graphs, kv_padding_interval_size=padding, use_async_batching=asked)
                config, _ = cb_config_for_lora(own, None)
                assert (config.use_cuda_graph, config.kv_padding_interval_size) == (graphs, padding)
                assert config.use_async_batching is asked or ENGINE_ASYNC_WHY is not None
                assert config.allow_block_sharing is False
    assert cb_config_for_lora(cb_config(use_cuda_graph=True), None, "graphs off")[0].use_cuda_graph is False


@cb
@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.skipif(not interpreting(), reason="the kernel runs on CPU under TRITON_INTERPRET=1")
def test_warmup_engine_captures_every_step_a_server_meets(monkeypatch):
    """With the in-place attention and graphs (emulated here), each step is keyed as if its longest
    request read the whole cache, so graphs are keyed by the query count alone:
    ``fastlora.warmup_engine`` runs one made-up step per padded query count, and every step of
    mixed prefill and decode traffic afterwards finds one of those keys. Tokens equal PEFT's."""
    from peft_fastlora.compat import engine as compat_engine
    from peft_fastlora.continuous import graphs as engine_graphs

    keys = []
    held = engine_graphs.cb_step_graph_held
    monkeypatch.setattr(engine_graphs, "cb_step_graph_held", lambda processor: (
        keys.append(compat_engine._step_graph_io(processor)._get_graph_key()), held(processor))[1])
    m = build_peft_lm("llama")
    ref = copy.deepcopy(m)
    fastlora.patch(m, engine_attention="paged", cuda_graphs="emulate")
    with pytest.raises(ValueError, match="warmup_engine takes a continuous-batching manager"):
        fastlora.warmup_engine(m)
    manager = m.init_continuous_batching(generation_config=greedy_config(6), continuous_batching_config=cb_config(
        max_batch_tokens=32, q_padding_interval_size=8, use_cuda_graph=True, num_blocks=256))
    warm = fastlora.warmup_engine(manager)
    assert warm.query_sizes == [32, 24, 16, 8] and warm.captures >= 4 and warm.seconds > 0, warm
    warmed, keys[:] = set(keys), []
    manager.start()
    try:
        with pytest.raises(RuntimeError, match="before manager.start"):
            fastlora.warmup_engine(manager)
        prompts = random_prompts([3, 17, 9, 40, 1, 25], seed=5)
        names = ["a0", "a1", "__base__", "a2", "a1", "a0"]
        out = serve(manager, list(zip(prompts, names, [6] * len(names))))
    finally:
        manager.stop(block=True)
        fastlora.unpatch(m)
    assert keys and set(keys) <= warmed, (sorted(set(keys) - warmed), sorted(warmed))
    assert len({k[0] for k in keys}) > 1  # steps of several sizes met
    for tokens, p, n in zip(out, prompts, names):
        assert tokens == peft_alone(ref, p, n, 6), (n, len(p))


def test_auto_reads_in_place_where_the_kernel_applies(monkeypatch):
    """``engine_attention="auto"``: where the flash varlen kernel applies (CUDA, fp16 / bf16; faked
    here), the engine reads its paged cache in place when the Triton kernel can too, else it gets
    the gathering varlen attention."""
    from peft_fastlora.continuous import engine

    m = build_peft_lm("llama")
    fastlora.patch(m)  # "auto"
    try:
        hook = get_state(m).continuous
        monkeypatch.setattr(engine, "varlen_blocker", lambda *a, **k: None)
        monkeypatch.setattr(engine, "in_place_blocker", lambda *a, **k: None)
        if ENGINE_WHY is None:
            assert hook.attention_name() == IN_PLACE_NAME
        monkeypatch.setattr(engine, "in_place_blocker", lambda *a, **k: "a GPU older than sm80")
        assert hook.attention_name() == PAGED_NAME
    finally:
        fastlora.unpatch(m)


@cb
@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
@pytest.mark.parametrize("choice", ["varlen", "paged"])
def test_a_model_the_attention_cannot_express_is_refused_when_forced(choice):
    """Gemma 2 soft-caps its attention logits, which neither of fastlora's attentions does: asked
    for by name, it is refused with the reason instead of serving other tokens."""
    m = build_peft_lm("gemma2")
    fastlora.patch(m, engine_attention=choice)
    try:
        with pytest.raises(ValueError, match=f"engine_attention='{choice}' cannot be served: logit soft-capping"):
            m.init_continuous_batching(generation_config=greedy_config(2), continuous_batching_config=cb_config())
    finally:
        fastlora.unpatch(m)


@cb
@pytest.mark.skipif(ENGINE_WHY is not None, reason=f"{ENGINE_WHY}")
def test_the_in_place_kernel_is_refused_on_a_cpu_without_the_interpreter(monkeypatch):
    """Off CUDA the in-place kernel runs only under Triton's interpreter: elsewhere a forced
    ``"paged"`` is refused when the manager is made (its steps would all fail), naming the device."""
    from peft_fastlora.base_ops import paged_attention

    monkeypatch.setattr(paged_attention, "interpreting", lambda: False)
    m = build_peft_lm("llama")
    fastlora.patch(m, engine_attention="paged")
    try:
        with pytest.raises(ValueError, match="engine_attention='paged' cannot be served: the model is on cpu"):
            m.init_continuous_batching(generation_config=greedy_config(2), continuous_batching_config=cb_config())
    finally:
        fastlora.unpatch(m)


@cb
@pytest.mark.skipif(ENGINE_WHY is None, reason="this transformers' engine takes the varlen attention")
def test_an_engine_that_cannot_take_it_keeps_its_attention():
    m = build_peft_lm("llama")
    fastlora.patch(m, engine_attention="varlen")
    try:
        with pytest.raises(ValueError, match="engine_attention='varlen' cannot be served"):
            m.init_continuous_batching(generation_config=greedy_config(2), continuous_batching_config=cb_config())
        assert attn_implementation(get_state(m).inner) == "eager"
    finally:
        fastlora.unpatch(m)
    m = build_peft_lm("llama")
    fastlora.patch(m)  # auto: the engine's own, no error
    try:
        out = m.generate_batch(random_prompts([4], seed=1), generation_config=greedy_config(2),
                               continuous_batching_config=cb_config(), adapter_names=["a0"])
        assert len(out) == 1
    finally:
        fastlora.unpatch(m)


def test_a_model_on_fastlora_decode_attention_counts_as_its_own(monkeypatch):
    """A patched CUDA model runs fastlora's decode attention; the engine's attention is decided
    on the model's own (the first 8B bench run turned the engine's graphs off over this)."""
    from peft_fastlora.base_ops import paged_attention
    from peft_fastlora.base_ops.attention_registry import ATTN_NAME, _PREV_ATTR

    inner = build_peft_lm("llama").base_model.model
    monkeypatch.setattr(paged_attention, "attn_implementation", lambda model: ATTN_NAME)
    monkeypatch.setattr(paged_attention, "has_flash_varlen", lambda: True)
    assert "fastlora_decode" in paged_attention._model_blocker(inner, False)
    inner.__dict__[_PREV_ATTR] = "sdpa"
    assert paged_attention._model_blocker(inner, False) is None


def test_graphs_are_judged_on_the_kernel_not_on_the_running_attention(monkeypatch):
    """While a manager runs, the model's attention is ``paged|fastlora_varlen`` itself: whether
    the engine's graphs can carry the LoRA batches depends on the kernel's dtype and device only
    (the 8B bench run judged it on the attention's name and served without fastlora's graphs)."""
    from peft_fastlora.continuous import engine

    m = build_peft_lm("llama")
    fastlora.patch(m, engine_attention="varlen")
    try:
        hook = get_state(m).continuous
        assert "reference" in hook.graphs_blocker()  # CPU fp32: the reference runs
        monkeypatch.setattr(engine, "kernel_blocker", lambda dtype, device: None)
        monkeypatch.setattr(engine, "attn_implementation", lambda model: PAGED_NAME)
        assert hook.graphs_blocker() is None
    finally:
        fastlora.unpatch(m)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_in_place_attention_keeps_the_graphs_where_no_layer_syncs(family):
    """``engine_attention="paged"`` off fp16 / bf16 CUDA: the in-place kernel is captured like any
    other, so only sliding-window layers (the varlen path's syncing reference) turn graphs off."""
    m = build_peft_lm(family)
    fastlora.patch(m, engine_attention="paged")
    try:
        why = get_state(m).continuous.graphs_blocker()
    finally:
        fastlora.unpatch(m)
    if family == "llama":
        assert why is None
    else:
        assert "sliding-window layers" in why


class _Runner:
    use_cuda_graph_varlen = use_cuda_graph_decode = True


class _Processor:
    model_runner = _Runner()


def test_engine_graphs_go_off_when_fastlora_cannot_follow_them(monkeypatch):
    """A graph replaying LoRA batches nobody refreshes would serve stale adapters: where
    fastlora's side of the graphs is refused, the engine's graphs are turned off too."""
    m = build_peft_lm("llama")
    fastlora.patch(m)
    try:
        hook = get_state(m).continuous
        monkeypatch.setattr(type(hook), "graphs_blocker", lambda self: "a reason")
        processor = _Processor()
        assert hook._engine_graphs(processor) is None
        assert not processor.model_runner.use_cuda_graph_varlen and not processor.model_runner.use_cuda_graph_decode
    finally:
        fastlora.unpatch(m)
