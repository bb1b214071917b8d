"""Per-request adapters in transformers' continuous batching on the GPU (triton backend).

float32: every request's greedy tokens equal PEFT's ``generate`` for that prompt alone with that
adapter, with chunked prefills sharing forwards with decode tokens and requests arriving while
others decode; afterwards the decode-attention kernel is back and graphed ``generate`` still
matches PEFT. bfloat16: a mixed run completes without errors.
"""

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.base_ops.attention_registry import decode_attention_enabled

from _continuous import cb_config, greedy_config, peft_alone, random_prompts
from test_graph_traffic_gpu import NAMES, _inputs, _model

pytestmark = pytest.mark.gpu
POOL = NAMES + ["__base__"]


@pytest.fixture(scope="module")
def pair():
    m, ref = _model(), _model()
    fastlora.patch(m)
    yield m, ref
    fastlora.unpatch(m)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 120, (n,), generator=g)]
    names = [POOL[int(i)] for i in torch.randint(0, len(POOL), (n,), generator=g)]
    return random_prompts(lengths, seed), names


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
