"""Per-request adapters through the engine's async batching, its IO pairs emulated on CPU.

With ``use_async_batching`` the engine prepares step N+1 in one IO pair while step N runs from the
other, carries step N's tokens into step N+1's inputs on the device, and updates step N's requests
after launching step N+1. transformers runs it on CUDA only; here its streams are stand-ins that
do nothing (the CPU runs everything in order), so the host side runs as on the GPU: which pair a
step is read from, which tokens are still in flight when the next step is planned, the update of a
step after a later one failed. Every greedy request equals PEFT's ``generate`` alone; seeded
sampling with penalties draws the same tokens as without async batching. The GPU runs the real
streams in test_continuous_batching_gpu.
"""

from __future__ import annotations

import pytest
import torch

from peft_fastlora import get_state
from peft_fastlora.compat.engine import cb_async_blocker
from peft_fastlora.kernel_support import interpreting
from peft_fastlora.continuous.sampling import SamplingParams

from _continuous import cb_config, collect, greedy_config, peft_alone, random_prompts, requires_cb

pytestmark = [requires_cb, pytest.mark.skipif(cb_async_blocker() is not None, reason=str(cb_async_blocker()))]


class _Stream(torch.cpu.Stream):
    """A CPU stand-in for the engine's CUDA streams: the CPU runs each operation when issued."""

    def record_event(self, event=None):
        return event

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


@pytest.fixture
def async_on_cpu(monkeypatch):
    from transformers.generation.continuous_batching import input_outputs

    cls = input_outputs.ContinuousBatchingAsyncIOs
    if not hasattr(cls, "_supported_device_types") or not hasattr(input_outputs, "create_device_stream"):
        pytest.skip("this transformers' async batching makes CUDA streams itself: no stand-ins on the CPU")
    monkeypatch.setattr(cls, "_supported_device_types", (*cls._supported_device_types, "cpu"))
    monkeypatch.setattr(input_outputs, "create_device_stream", lambda device: _Stream())


def _manager(model, new_tokens, **config):
    manager = model.init_continuous_batching(
        generation_config=greedy_config(new_tokens),
        continuous_batching_config=cb_config(max_batch_tokens=32, use_async_batching=True, **config))
    manager.start()
    return manager


def _pairs_used(manager):
    ios = manager.batch_processor.inputs_and_outputs
    assert getattr(ios, "io_pairs", None) is not None, type(ios).__name__  # async batching ran
    return ios


@pytest.mark.parametrize("pair_options", [dict(cuda_graphs="emulate"), dict()], ids=["graphs", "eager"])
def test_async_steps_equal_peft_per_request(pair, async_on_cpu):
    m, ref = pair
    names = ["a0", "a1", "__base__", "a2", "a1", "a0", "a2"]
    prompts = random_prompts([3, 17, 9, 40, 1, 25, 6], seed=31)
    manager = _manager(m, 9)
    try:
        ids = [manager.add_request(p, adapter_name=n, max_new_tokens=9) for p, n in zip(prompts, names)]
        out = collect(manager, ids)
        _pairs_used(manager)
        late = manager.add_request(prompts[0], adapter_name="a2", max_new_tokens=5)  # after a pause
        out.update(collect(manager, [late]))
    finally:
        manager.stop(block=True)
    for rid, prompt, name in zip(ids, prompts, names):
        assert out[rid] == peft_alone(ref, prompt, name, 9), (name, len(prompt))
    assert out[late] == peft_alone(ref, prompts[0], "a2", 5)


@pytest.mark.parametrize("pair_options", [dict(cuda_graphs="emulate")])
def test_random_traffic_like_a_server(pair, async_on_cpu):
    """The eager tests' server-like traffic (bursts, streaming, cancellations, bad names) with
    async batching: every finished request equals PEFT alone."""
    from test_continuous_batching import random_traffic

    random_traffic(pair, use_async_batching=True)


@pytest.mark.skipif(not interpreting(), reason="the in-place kernel runs on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("pair_options", [dict(cuda_graphs="emulate", engine_attention="paged")])
def test_random_traffic_reading_the_cache_in_place(pair, async_on_cpu, monkeypatch):
    """The same traffic through the in-place paged attention (``engine_attention="paged"``): the
    cache written by the update or the attention, each request's keys found through the step's page
    table, whichever IO pair the step was prepared in; every finished request equals PEFT alone."""
    from peft_fastlora.base_ops import paged_attention
    from test_continuous_batching import random_traffic

    calls, kernel = [], paged_attention.paged_kernel
    monkeypatch.setattr(paged_attention, "paged_kernel", lambda *a: (calls.append(1), kernel(*a))[1])
    random_traffic(pair, use_async_batching=True)
    assert calls  # the steps read the cache in place


@pytest.mark.parametrize("pair_options", [dict(cuda_graphs="emulate")])
def test_adapter_deleted_between_steps_fails_only_its_requests(pair, async_on_cpu):
    """An adapter deleted while its request decodes (the step before still to be updated): that
    request fails naming it, the others finish equal to PEFT."""
    import time

    m, ref = pair
    doomed_prompt, *others = random_prompts([10, 6, 14], seed=34)
    manager = _manager(m, 300)
    try:
        doomed = manager.add_request(doomed_prompt, adapter_name="a2", streaming=True)
        partial = manager.get_result(request_id=doomed, timeout=30)
        assert partial is not None and not partial.is_finished()  # decoding now
        ids = [manager.add_request(p, adapter_name=n, max_new_tokens=12) for p, n in zip(others, ["a0", "a1"])]
        m.delete_adapter("a2")  # waits for the step in progress
        finished, deadline = {}, time.monotonic() + 60
        while len(finished) < 3:
            assert time.monotonic() < deadline, sorted(finished)
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                assert r.request_id not in finished, "a request finished twice"
                finished[r.request_id] = r
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    assert "'a2'" in (finished[doomed].error or "") and "deleted" in finished[doomed].error
    for rid, prompt, name in zip(ids, others, ["a0", "a1"]):
        assert finished[rid].error is None and list(finished[rid].generated_tokens) == \
            peft_alone(ref, prompt, name, 12), name


def _sampled(model, async_batching: bool):
    params = [SamplingParams(temperature=0.9, seed=7, frequency_penalty=1.5),
              SamplingParams(temperature=0.0, presence_penalty=2.0),
              SamplingParams(temperature=1.3, top_k=5, seed=11, presence_penalty=0.7),
              None]
    names = ["a0", "a1", "a2", "__base__"]
    prompts = random_prompts([5, 12, 8, 3], seed=32)
    manager = model.init_continuous_batching(
        generation_config=greedy_config(12),
        continuous_batching_config=cb_config(max_batch_tokens=32, use_async_batching=async_batching))
    manager.start()
    try:
        ids = [manager.add_request(p, adapter_name=n, max_new_tokens=12, sampling=s)
               for p, n, s in zip(prompts, names, params)]
        out = collect(manager, ids)
        assert (getattr(manager.batch_processor.inputs_and_outputs, "io_pairs", None) is not None) == async_batching
    finally:
        manager.stop(block=True)
    return [out[rid] for rid in ids]


@pytest.mark.parametrize("pair_options", [dict(cuda_graphs="emulate")])
def test_sampling_counts_the_token_still_in_flight(pair, async_on_cpu):
    """A request's draws and penalties depend on its position and earlier tokens; with async
    batching its latest token is still on the device when its next step is planned."""
    m, _ = pair
    assert _sampled(m, async_batching=True) == _sampled(m, async_batching=False)


class _FailOnce:
    """The first forward whose tokens hold ``token`` raises."""

    def __init__(self, model, token, monkeypatch):
        self.token, self.fired = token, False
        inner = get_state(model).inner
        original = inner.forward

        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids")
            if not self.fired and ids is not None and bool((ids == self.token).any()):
                self.fired = True
                raise RuntimeError("injected failure")
            return original(*args, **kwargs)

        monkeypatch.setattr(inner, "forward", forward)


@pytest.mark.parametrize("pair_options", [dict(cuda_graphs="emulate")])
def test_a_failing_step_fails_its_requests_once_and_the_engine_goes_on(pair, async_on_cpu, monkeypatch):
    """A step raises while the step before it is still to be updated: its requests fail, each
    delivered once with the error (the update of the step before skips them), and later requests
    are served as before."""
    import time

    m, ref = pair
    poison = 2  # a token no random prompt holds (they start at 3)
    long_prompt, *prompts = random_prompts([7, 11, 4], seed=33)
    manager = _manager(m, 40)
    injected = _FailOnce(m, poison, monkeypatch)
    seen = {}  # request id -> its outputs, in order
    try:
        streamed = manager.add_request(long_prompt, adapter_name="a0", max_new_tokens=40, streaming=True)
        first = manager.get_result(request_id=streamed, timeout=30)
        assert first is not None and not first.is_finished()  # decoding now
        doomed = manager.add_request([5, poison, 9], adapter_name="a1", max_new_tokens=6)
        ids = []
        deadline = time.monotonic() + 60
        while not ids or not all(any(r.is_finished() for r in seen.get(i, ())) for i in ids):
            assert time.monotonic() < deadline, {k: len(v) for k, v in seen.items()}
            if not ids and injected.fired and any(r.is_finished() for r in seen.get(doomed, ())):
                ids = [manager.add_request(p, adapter_name=n, max_new_tokens=8) for p, n in zip(prompts, ["a2", "a1"])]
            result = manager.get_result(timeout=0.5)
            if result is not None:
                seen.setdefault(result.request_id, []).append(result)
        time.sleep(0.2)
        while (result := manager.get_result(timeout=0.2)) is not None:
            seen.setdefault(result.request_id, []).append(result)
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    doomed_out = seen[doomed]
    assert len(doomed_out) == 1 and "injected failure" in (doomed_out[0].error or ""), doomed_out
    # the streamed request shared the failing step: its last output is the error, and nothing after
    ends = [k for k, r in enumerate(seen[streamed]) if r.is_finished()]
    assert ends == [len(seen[streamed]) - 1], [(r.error, len(r.generated_tokens)) for r in seen[streamed]]
    assert "injected failure" in (seen[streamed][-1].error or "")
    for rid, prompt, name in zip(ids, prompts, ["a2", "a1"]):
        (out,) = seen[rid]
        assert out.error is None and list(out.generated_tokens) == peft_alone(ref, prompt, name, 8), name


def test_async_batching_stays_the_engines_or_the_callers_choice():
    """fastlora leaves ``use_async_batching`` as the config has it: unset, the engine decides (on
    where its graphs run and it builds no attention mask); set, as set."""
    from peft_fastlora.compat.engine import cb_config_for_lora

    for asked in (None, True, False):
        config, changes = cb_config_for_lora(cb_config(use_async_batching=asked), None)
        assert config.use_async_batching is asked and not [c for c in changes if "async" in c]


def test_async_batching_asked_off_its_devices_is_refused_up_front(pair):
    """transformers' async batching runs on CUDA (or XPU) streams only: asked for on the CPU, the
    manager is refused with the reason instead of its thread dying at the first step."""
    m, _ = pair
    with pytest.raises(ValueError, match="use_async_batching=True cannot be served: .* on cpu"):
        m.init_continuous_batching(generation_config=greedy_config(3),
                                   continuous_batching_config=cb_config(use_async_batching=True))
    manager = m.init_continuous_batching(generation_config=greedy_config(3),  # unset: served without it
                                         continuous_batching_config=cb_config())
    manager.start()
    try:
        assert len(collect(manager, [manager.add_request([5, 6, 7], adapter_name="a0")])) == 1
    finally:
        manager.stop(block=True)
