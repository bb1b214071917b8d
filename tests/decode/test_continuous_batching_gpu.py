"""Per-request adapters in transformers' continuous batching on the GPU (triton backend).

float32: every request's greedy tokens equal PEFT's ``generate`` for that prompt alone with that
adapter, with chunked prefills sharing forwards with decode tokens and requests arriving while
others decode; afterwards the decode-attention kernel is back and graphed ``generate`` still
matches PEFT. The same through the engine's own CUDA graphs (``use_cuda_graph=True``), with
adapters added and deleted while the engine serves (the graphs hold the stacks: they must be
recaptured). bfloat16: mixed runs, eager and graphed, complete without errors.
"""

import pytest
import torch
from peft import LoraConfig

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.base_ops.attention_registry import decode_attention_enabled

from _continuous import (assert_each_equals_peft, cb_config, collect, greedy_config, peft_alone, random_traffic,
                         serve as _serve)
from _graphs import TRAFFIC_NAMES as NAMES, traffic_inputs as _inputs, traffic_model as _model
from _graphs import traffic_prompts as _prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair():
    m, ref = _model(), _model()
    fastlora.patch(m)
    yield m, ref
    fastlora.unpatch(m)


def test_generate_batch_fp32_equals_peft_per_request(pair):
    m, ref = pair
    prompts, names = _prompts(12, seed=1)
    out = m.generate_batch(prompts, generation_config=greedy_config(16),
                           continuous_batching_config=cb_config(max_batch_tokens=64, num_blocks=128),
                           adapter_names=names)
    for i, (p, n) in enumerate(zip(prompts, names)):
        assert out[f"req_{i}"].error is None
        assert out[f"req_{i}"].generated_tokens == peft_alone(ref, p, n, 16), (i, n, len(p))
    inner = get_state(m).inner
    assert decode_attention_enabled(inner)  # switched back on when the manager stopped
    # graphed generate after a continuous-batching session still equals PEFT
    kw = dict(**_inputs(5, 20, 3), adapter_names=["a0", "a3", "__base__", "a5", "a1"], max_new_tokens=12,
              do_sample=False)
    with torch.no_grad():
        assert torch.equal(m.generate(**kw), ref.generate(**kw))
    assert get_state(m).graph_runner.stats["replays"] > 0


def test_manager_fp32_requests_arriving_mid_decode(pair):
    m, ref = pair
    prompts, names = _prompts(6, seed=2)
    manager = m.init_continuous_batching(generation_config=greedy_config(24),
                                         continuous_batching_config=cb_config(num_blocks=128))
    manager.start()
    try:
        first = manager.add_request(prompts[0], adapter_name=names[0], streaming=True)
        partial = manager.get_result(request_id=first, timeout=60)
        assert partial is not None and not partial.is_finished()
        ids = [first] + [manager.add_request(p, adapter_name=n) for p, n in zip(prompts[1:], names[1:])]
        finished = {}
        while len(finished) < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None, f"timed out; finished {sorted(finished)}"
            if r.is_finished():
                assert r.error is None, r.error
                finished[r.request_id] = r.generated_tokens
    finally:
        manager.stop(block=True)
    for rid, p, n in zip(ids, prompts, names):
        assert finished[rid] == peft_alone(ref, p, n, 24), (rid, n, len(p))


def test_generate_batch_bf16_runs():
    m = _model(seed=4).to(torch.bfloat16)
    fastlora.patch(m)
    try:
        prompts, names = _prompts(16, seed=5)
        out = m.generate_batch(prompts, generation_config=greedy_config(20),
                               continuous_batching_config=cb_config(max_batch_tokens=128, num_blocks=256),
                               adapter_names=names)
        assert len(out) == 16
        for r in out.values():
            assert r.error is None and len(r.generated_tokens) == 20
            assert all(0 <= t < 512 for t in r.generated_tokens)
    finally:
        fastlora.unpatch(m)


def _graph_manager(m, new, **overrides):
    """A started manager with the engine's graphs and, unless told otherwise, its async batching
    (both on the real streams: the host prepares a step while the GPU runs the one before)."""
    kw = dict(num_blocks=128, use_cuda_graph=True, use_async_batching=True)
    kw.update(overrides)
    manager = m.init_continuous_batching(generation_config=greedy_config(new),
                                         continuous_batching_config=cb_config(**kw))
    manager.warmup()
    manager.start()
    return manager


def _ran_async(manager) -> bool:
    return getattr(manager.batch_processor.inputs_and_outputs, "io_pairs", None) is not None


@pytest.mark.parametrize("async_batching", [True, False], ids=["async", "sync"])
def test_engine_graphs_fp32_equal_peft_per_request(pair, async_batching):
    m, ref = pair
    prompts, names = _prompts(16, seed=6)
    news = [int(k) for k in torch.randint(1, 24, (16,), generator=torch.Generator().manual_seed(6))]
    manager = _graph_manager(m, 24, use_async_batching=async_batching)
    try:
        first = _serve(manager, list(zip(prompts[:6], names[:6], news[:6])))
        assert _ran_async(manager) == async_batching
        rest = _serve(manager, list(zip(prompts[6:], names[6:], news[6:])))  # a second wave, graphs warm
    finally:
        manager.stop(block=True)
    stats = manager.fastlora_graphs.stats
    assert manager.fastlora_graphs.blocker is None
    assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
    assert stats["captures"] < stats["graphed_steps"], stats  # the second wave replays graphs
    served = zip(first + rest, prompts, names, news)
    wrong = [(i, n, len(p), k, tokens[:4]) for i, (tokens, p, n, k) in enumerate(served)
             if tokens != peft_alone(ref, p, n, k)]
    assert not wrong, f"requests unlike PEFT's (index, adapter, prompt length, new tokens, first tokens): {wrong}"


def test_async_engine_starting_while_the_current_stream_is_busy_equals_peft(pair):
    """The manager's start resets the batch processor its warm-up made; transformers 5.17 zeroes
    the IO tensors there on the current stream, and async batching copies the first step's inputs
    on a stream that does not wait for it. With the current stream kept busy through the start, the
    zeroing would land after those inputs (the first request then runs on zeros) unless fastlora
    waits for it: every request equals PEFT."""
    m, ref = pair
    prompts, names = _prompts(4, seed=12)
    manager = m.init_continuous_batching(generation_config=greedy_config(8), continuous_batching_config=cb_config(
        num_blocks=128, use_cuda_graph=True, use_async_batching=True))
    manager.warmup()
    torch.cuda._sleep(10 ** 9)  # about half a second of the GPU's clock on the current stream
    manager.start()
    try:
        got = _serve(manager, list(zip(prompts, names, [8] * 4)))
        ran_async = _ran_async(manager)  # (a stopped manager lets its processor go)
    finally:
        manager.stop(block=True)
    assert ran_async
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 8), (n, len(p))


def test_engine_graphs_follow_adapters_added_and_deleted_while_serving(pair):
    """The graphs read the stacks by address: an adapter added or deleted mid-run rebuilds them,
    and a replay of an old graph would read freed memory. The graphs are dropped and recaptured;
    every request equals PEFT."""
    m, ref = pair
    cfg = LoraConfig(r=12, lora_alpha=24, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
                     init_lora_weights=False)
    manager = _graph_manager(m, 10)
    try:
        reqs = list(zip(*_prompts(6, seed=7), [10] * 6))
        before = _serve(manager, reqs)
        dropped = manager.fastlora_graphs.stats["graphs_dropped"]
        torch.manual_seed(3)
        m.add_adapter("late", cfg)  # waits for the step in progress
        ref.add_adapter("late", cfg)
        with torch.no_grad():
            mine = dict(m.named_parameters())
            for n, p in ref.named_parameters():
                if ".late." in n:
                    p.copy_(mine[n])
        prompts, names = _prompts(6, seed=8)
        names = ["late" if i % 2 else n for i, n in enumerate(names)]
        added = list(zip(prompts, names, [10] * 6))
        after_add = _serve(manager, added)
        for model in (m, ref):
            model.delete_adapter("late")
        after_delete = _serve(manager, reqs)
    finally:
        manager.stop(block=True)
    stats = manager.fastlora_graphs.stats
    assert stats["graphs_dropped"] >= dropped + 2 and stats["eager_steps"] == 0, stats
    for tokens, (p, n, k) in zip(before, reqs):
        assert tokens == peft_alone(ref, p, n, k), (n, len(p))
    assert after_delete == before
    ref.add_adapter("late", cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if ".late." in n:
                p.copy_(mine[n])
    for tokens, (p, n, k) in zip(after_add, added):
        assert tokens == peft_alone(ref, p, n, k), (n, len(p))
    ref.delete_adapter("late")


def test_engine_graphs_bf16_runs():
    m = _model(seed=5).to(torch.bfloat16)
    fastlora.patch(m)
    try:
        prompts, names = _prompts(24, seed=9)
        manager = _graph_manager(m, 20, max_batch_tokens=128, num_blocks=256)
        try:
            out = _serve(manager, list(zip(prompts, names, [20] * 24)))
        finally:
            manager.stop(block=True)
        assert manager.fastlora_graphs.stats["graphed_steps"] > 0
        for tokens in out:
            assert len(tokens) == 20 and all(0 <= t < 512 for t in tokens)
    finally:
        fastlora.unpatch(m)


def test_engine_graphs_random_traffic_like_a_server(pair):
    """Random bursts of requests (random lengths, adapters, token budgets), some cancelled, some
    naming a bad adapter, through the engine's real graphs, in fp32: every finished request equals
    PEFT alone, no step falls back to eager."""
    import random

    m, ref = pair
    manager = _graph_manager(m, 16, max_batch_tokens=96)
    try:
        expected, finished = random_traffic(manager, random.Random(31), NAMES + ["__base__"],
                                            lambda seed: _prompts(1, seed=seed)[0][0])
    finally:
        manager.stop(block=True)
    stats = manager.fastlora_graphs.stats
    assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
    assert_each_equals_peft(ref, expected, finished)


def test_async_sampling_draws_as_sync(pair):
    """Seeded sampling with penalties: a request's draws depend on its position and earlier tokens,
    the latest of which is still on the GPU when async batching plans its next step. The same
    requests draw the same tokens with and without async batching."""
    from peft_fastlora.continuous.sampling import SamplingParams

    m, _ = pair
    prompts, names = _prompts(8, seed=12)
    params = [SamplingParams(temperature=0.8, seed=100 + i, frequency_penalty=1.2 if i % 2 else 0.0,
                             presence_penalty=0.0 if i % 2 else 1.5, top_p=0.9) for i in range(8)]
    out = {}
    for async_batching in (True, False):
        manager = _graph_manager(m, 16, use_async_batching=async_batching)
        try:
            ids = [manager.add_request(p, adapter_name=n, max_new_tokens=16, sampling=s)
                   for p, n, s in zip(prompts, names, params)]
            finished = collect(manager, ids, 120)
            assert _ran_async(manager) == async_batching
        finally:
            manager.stop(block=True)
        out[async_batching] = [finished[i] for i in ids]
    assert out[True] == out[False]

