"""Greedy steps whose next inputs the GPU writes (``decode/step_advance.py``) under real CUDA
graphs: server-like random traffic (``_graphs.random_calls``: batch sizes, left
padding, adapters, EOS lists, pad ids, minimum lengths) token-equal with the host-built inputs
(``defer_stop_check=False``: transformers' loop builds them) and with PEFT; memory flat over repeated traffic; a step-advance
capture that fails runs its ops eagerly and stays equal. float32 models: tokens compare exactly."""

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.decode import step_advance

from _graphs import generate_model, random_calls

pytestmark = pytest.mark.gpu


def _run(model, calls, **options):
    fastlora.patch(model, **options)
    try:
        outs = [model.generate(**kw, adapter_names=names) for names, kw in calls]
        return outs, dict(fastlora.get_state(model).graph_runner.stats)
    finally:
        fastlora.unpatch(model)


def test_random_traffic_equals_host_built_inputs_and_peft(monkeypatch):
    model = generate_model(n_adapters=8)
    calls = random_calls(model, seed=33, n=20)
    on, stats_on = _run(model, calls)
    off, stats_off = _run(model, calls, defer_stop_check=False)  # inputs built on the host
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), (i, calls[i][1])
    for i in range(0, len(calls), 4):  # PEFT itself on a sample (its mixed path is slow)
        names, kw = calls[i]
        assert torch.equal(on[i], model.generate(**kw, adapter_names=names)), i
    # every call with a decode step advances from it on
    decoding = sum(kw["max_new_tokens"] > 1 for _, kw in calls)
    assert not stats_on["advance_reasons"] and stats_on["advanced_calls"] >= decoding, stats_on
    assert stats_on["advanced_steps"] > 10 * len(calls) // 2 and stats_on["eager_steps"] == 0, stats_on
    # off: inputs built on the host and the stop flag read every step (nothing run past the end)
    assert stats_off["advanced_steps"] == 0 and stats_off["steps_undone"] == 0, stats_off


def test_repeated_traffic_keeps_memory_flat():
    """The same traffic four times: the later passes equal the first, and the memory held after
    each pass (graphs, their step-advance graphs, caches) does not grow."""
    model = generate_model(n_adapters=8)
    calls = random_calls(model, seed=5, n=12)
    fastlora.patch(model)
    try:
        first = [model.generate(**kw, adapter_names=names) for names, kw in calls]
        torch.cuda.synchronize()
        held = [torch.cuda.memory_allocated()]
        for _ in range(3):
            again = [model.generate(**kw, adapter_names=names) for names, kw in calls]
            for a, b in zip(first, again):
                assert torch.equal(a, b)
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())
        stats = fastlora.get_state(model).graph_runner.stats
    finally:
        fastlora.unpatch(model)
    assert stats["advanced_calls"] > 0, stats
    assert max(held[1:]) <= held[0] + (4 << 20), held


def test_a_failed_capture_runs_the_ops_eagerly(monkeypatch):
    model = generate_model(n_adapters=8)
    calls = random_calls(model, seed=8, n=6)
    want, _ = _run(model, calls)

    def refuse(self, pool, capture_fn):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(step_advance.StepAdvance, "capture", refuse)
    got, stats = _run(model, calls)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    assert stats["advanced_steps"] > 0 and any("injected capture failure" in k for k in stats["advance_reasons"]), stats
