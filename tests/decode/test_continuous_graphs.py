"""Per-request adapters through the continuous-batching engine's CUDA graphs, emulated on CPU.

With ``cuda_graphs="emulate"`` the engine pads every step as it does for graphs and each step
runs with the LoRA layers reading the static batch-info buffers, filled in place before the step
(what a replay reads). Every request's greedy tokens equal PEFT's ``generate`` alone (float32);
an adapter added mid-run drops the engine's graphs; a layer that cannot be captured turns the
engine's graphs off for good and the step runs eagerly. Real graphs: test_continuous_batching_gpu.
"""

from __future__ import annotations

import pytest

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.batch import NO_ADAPTER
from peft_fastlora.lora.sites import Site

from _continuous import cb_config, greedy_config, peft_alone, random_prompts, requires_cb, serve as _run
from _models import build_peft_lm, lora_configs, ARCHS

pytestmark = requires_cb


@pytest.fixture
def pair_options():
    return dict(cuda_graphs="emulate")  # the ``pair`` fixture (conftest) patched with emulated graphs


class GraphFills:
    """Records the static fills (segments and slots) the backend is asked for."""

    def __init__(self, model, monkeypatch):
        self.fills, self.eager = [], 0
        backend = get_state(model).backend
        prepare = backend.prepare_lora_batch

        def spy(fb, slots, *args, use_cuda_graph, **kwargs):
            if use_cuda_graph:
                self.fills.append((list(fb.seq_lens), list(slots)))
            else:
                self.eager += 1
            return prepare(fb, slots, *args, use_cuda_graph=use_cuda_graph, **kwargs)

        monkeypatch.setattr(backend, "prepare_lora_batch", spy)


def _requests(lengths, names, new, seed):
    return list(zip(random_prompts(lengths, seed), names, [new] * len(names)))


def test_graphed_steps_equal_peft_per_request(pair, monkeypatch):
    m, ref = pair
    fills = GraphFills(m, monkeypatch)
    reqs = _requests([3, 17, 9, 40, 1, 25], ["a0", "a1", "__base__", "a2", "a1", "a0"], 8, seed=1)
    manager = m.init_continuous_batching(generation_config=greedy_config(8),
                                         continuous_batching_config=cb_config(max_batch_tokens=32))
    manager.warmup()  # the engine's own warm-up forwards (made-up requests) go through too
    manager.start()
    try:
        out = _run(manager, reqs)
    finally:
        manager.stop(block=True)
    for (prompt, name, new), tokens in zip(reqs, out):
        assert tokens == peft_alone(ref, prompt, name, new), (name, len(prompt))
    stats = manager.fastlora_graphs.stats
    assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
    assert stats["captures"] <= stats["graphed_steps"], stats  # (emulated: the engine keeps no graph)
    assert fills.eager == 0  # no layer built an eager batch inside a graphed step
    # the engine padded steps: the padded tail is a segment with no adapter
    padded = [(lens, slots) for lens, slots in fills.fills if slots[-1] == NO_ADAPTER and len(lens) > 1]
    assert padded, fills.fills
    # decode-sized and prefill-sized steps both ran (one buffer set per row tile)
    assert any(all(n == 1 for n in lens[:-1]) for lens, _ in fills.fills)
    assert any(max(lens[:-1] or [0]) > 1 for lens, _ in fills.fills)


def test_adapter_added_mid_run_drops_the_graphs(pair):
    m, ref = pair
    manager = m.init_continuous_batching(generation_config=greedy_config(6),
                                         continuous_batching_config=cb_config(max_batch_tokens=32))
    manager.start()
    try:
        first = _run(manager, _requests([5, 12], ["a0", "a1"], 6, seed=2))
        dropped = manager.fastlora_graphs.stats["graphs_dropped"]
        cfg = lora_configs(ARCHS["llama"])["a2"]
        for model in (m, ref):
            model.add_adapter("late", cfg)  # waits for the step in progress
        ref.load_state_dict(m.state_dict())  # the same random weights for "late"
        reqs = _requests([7, 3, 21], ["late", "a0", "late"], 6, seed=3)
        second = _run(manager, reqs)
    finally:
        manager.stop(block=True)
    assert first == [peft_alone(ref, p, n, 6) for p, n, _ in _requests([5, 12], ["a0", "a1"], 6, seed=2)]
    for (prompt, name, new), tokens in zip(reqs, second):
        assert tokens == peft_alone(ref, prompt, name, new), (name, len(prompt))
    assert manager.fastlora_graphs.stats["graphs_dropped"] > dropped


def test_a_step_that_cannot_be_captured_turns_graphs_off(pair, monkeypatch):
    """A LoRA layer that leaves fastlora's path inside a graphed step (injected here) would be
    captured with the step's host-side indices: the step runs eagerly instead, and so do the
    engine's later steps; every request still equals PEFT."""
    m, ref = pair
    state = get_state(m)
    blocked = state.sites[len(state.sites) // 2]
    original = Site._blocked
    armed = {"on": False}
    monkeypatch.setattr(Site, "_blocked",
                        lambda self, st, x: (armed["on"] and self is blocked) or original(self, st, x))
    manager = m.init_continuous_batching(generation_config=greedy_config(6),
                                         continuous_batching_config=cb_config(max_batch_tokens=32))
    manager.start()
    try:
        first = _run(manager, _requests([4, 9], ["a1", "a2"], 6, seed=4))
        armed["on"] = True
        reqs = _requests([11, 2, 6], ["a0", "a2", "__base__"], 6, seed=5)
        second = _run(manager, reqs)
    finally:
        manager.stop(block=True)
    graphs = manager.fastlora_graphs
    assert graphs.blocker is not None and "leave the static path" in graphs.blocker
    assert graphs.stats["graphed_steps"] > 0 and graphs.stats["eager_steps"] > 0
    assert first == [peft_alone(ref, p, n, 6) for p, n, _ in _requests([4, 9], ["a1", "a2"], 6, seed=4)]
    for (prompt, name, new), tokens in zip(reqs, second):
        assert tokens == peft_alone(ref, prompt, name, new), (name, len(prompt))


def test_graphs_stay_off_where_fastlora_cannot_follow_them(monkeypatch):
    """patch(cuda_graphs=False), and layers left on PEFT's path: the engine gets
    use_cuda_graph=False whatever the caller asked, with the reason logged."""
    m = build_peft_lm("llama")
    fastlora.patch(m, cuda_graphs=False)
    try:
        manager = m.init_continuous_batching(generation_config=greedy_config(2),
                                             continuous_batching_config=cb_config(use_cuda_graph=True))
        assert manager.continuous_batching_config.cuda_graph_booleans == (False, False)
        manager.start()
        try:
            _run(manager, _requests([3], ["a0"], 2, seed=6))
        finally:
            manager.stop(block=True)
        assert manager.fastlora_graphs is None
    finally:
        fastlora.unpatch(m)


def test_a_stopped_manager_lets_its_engine_go(pair):
    """fastlora's wrappers close reference cycles over the batch processor (its KV cache and
    graphs): once the manager stops, the processor is freed by reference counting alone, before
    any garbage collection, as it is without fastlora (a benchmark that served through the engine
    and then ran generate went out of memory)."""
    import gc
    import weakref

    m, _ = pair
    manager = m.init_continuous_batching(generation_config=greedy_config(3),
                                         continuous_batching_config=cb_config(max_batch_tokens=32))
    manager.start()
    gc.disable()
    try:
        _run(manager, _requests([4, 6], ["a0", "a1"], 3, seed=7))
        processor = weakref.ref(manager.batch_processor)
        manager.stop(block=True)
        assert processor() is None
        assert manager.fastlora_graphs.stats["graphed_steps"] > 0  # the stats stay
    finally:
        gc.enable()


def test_random_traffic_through_emulated_graphs(pair):
    """The server-like random traffic of the eager tests (bursts, streaming, cancellations, bad
    names), every step through the graphed path: each finished request equals PEFT alone."""
    from test_continuous_batching import random_traffic

    random_traffic(pair)


def test_captures_are_counted_from_the_engines_graph_key():
    """``compat.engine.cb_step_graph_held``: False while the engine holds no graph under the step's
    key (that step captures one), True once it does; None where the engine keeps no such key."""
    import types

    from peft_fastlora.compat.engine import cb_step_graph_held

    store = {}
    ios = types.SimpleNamespace(_get_graph_key=lambda: (64, 512), graphs=types.SimpleNamespace(get_graph=store.get))
    processor = types.SimpleNamespace(inputs_and_outputs=ios)
    assert cb_step_graph_held(processor) is False
    store[(64, 512)] = object()
    assert cb_step_graph_held(processor) is True
    ios._get_graph_key = lambda: (64, 768)  # more keys read: another graph
    assert cb_step_graph_held(processor) is False
    assert cb_step_graph_held(types.SimpleNamespace(inputs_and_outputs=types.SimpleNamespace())) is None
