"""Per-request adapters in transformers' continuous batching, on CPU (torch_native backend).

Every request's greedy tokens are compared with PEFT's own ``generate`` for that prompt alone
with that adapter (float32), through ``generate_batch`` and through the manager's
``add_request``, with prefill chunks and decode tokens of different adapters in one forward,
requests arriving while others decode, ``"__base__"`` rows, and bad input.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.lora.sites import Site

from _continuous import cb_config, collect as _collect, greedy_config, peft_alone, random_prompts, requires_cb
from _models import build_peft_lm

pytestmark = requires_cb


class StepSpy:
    """Records the segments (per-sequence token counts) of every LoRA batch the backend is asked
    for, and counts layer calls that went to PEFT's per-token path."""

    def __init__(self, model, monkeypatch):
        self.segments, self.peft_calls = [], 0
        backend = get_state(model).backend
        prepare = backend.prepare_lora_batch

        def spy_prepare(fb, *args, **kwargs):
            self.segments.append(list(fb.seq_lens))
            return prepare(fb, *args, **kwargs)

        monkeypatch.setattr(backend, "prepare_lora_batch", spy_prepare)
        peft_forward = Site.peft_forward

        def spy_peft(site, context, original, x, args, kwargs, **kw):
            if context.segments is not None:
                self.peft_calls += 1
            return peft_forward(site, context, original, x, args, kwargs, **kw)

        monkeypatch.setattr(Site, "peft_forward", spy_peft)

    def mixed_forwards(self) -> int:
        """Forwards that held a decode token and a prefill chunk of different sequences."""
        return sum(1 for lens in self.segments if 1 in lens and any(n > 1 for n in lens))


def _check(ref, prompts, names, outputs, new):
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert outputs[i] == peft_alone(ref, prompt, name, new), (i, name, len(prompt))


def test_generate_batch_matches_peft_per_request(pair, monkeypatch):
    m, ref = pair
    spy = StepSpy(m, monkeypatch)
    prompts = random_prompts([3, 17, 9, 40, 1, 25, 33, 6], seed=1)
    names = ["a0", "a1", "__base__", "a2", "a1", "a0", "a2", "__base__"]
    # 16 tokens per forward: long prompts are cut in chunks that share forwards with decode tokens
    out = m.generate_batch(prompts, generation_config=greedy_config(8),
                           continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=names)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    _check(ref, prompts, names, [out[f"req_{i}"].generated_tokens for i in range(len(prompts))], 8)
    assert spy.mixed_forwards() > 0, spy.segments
    assert spy.peft_calls == 0


def test_manager_requests_arriving_while_others_decode(pair, monkeypatch):
    m, ref = pair
    spy = StepSpy(m, monkeypatch)
    manager = m.init_continuous_batching(generation_config=greedy_config(20), continuous_batching_config=cb_config())
    manager.start()
    try:
        first = manager.add_request(random_prompts([12], seed=2)[0], adapter_name="a2", streaming=True)
        partial = manager.get_result(request_id=first, timeout=30)
        assert partial is not None and not partial.is_finished()  # it is decoding now
        later = random_prompts([5, 30, 2], seed=3)
        later_names = ["a0", "__base__", "a1"]
        ids = [manager.add_request(p, adapter_name=n, max_new_tokens=10) for p, n in zip(later, later_names)]
        results = _collect(manager, [first] + ids)
    finally:
        manager.stop(block=True)
    assert results[first] == peft_alone(ref, random_prompts([12], seed=2)[0], "a2", 20)
    _check(ref, later, later_names, [results[i] for i in ids], 10)
    assert spy.mixed_forwards() > 0, spy.segments
    assert len(manager.fastlora_adapters) == 0  # nothing kept once the manager stopped


def test_add_requests_with_adapter_names_and_default_adapter(pair):
    m, ref = pair
    m.set_adapter("a1")
    prompts = random_prompts([4, 11, 7], seed=4)
    manager = m.init_continuous_batching(generation_config=greedy_config(6), continuous_batching_config=cb_config())
    manager.start()
    try:
        ids = manager.add_requests(prompts[:2], adapter_names=["a2", "__base__"])
        ids.append(manager.add_request(prompts[2]))  # no adapter named: the active one, as in PEFT
        results = _collect(manager, ids)
    finally:
        manager.stop(block=True)
    _check(ref, prompts, ["a2", "__base__", "a1"], [results[i] for i in ids], 6)


def test_a_layer_left_to_peft_gets_each_tokens_adapter(pair, monkeypatch):
    """A site that cannot take fastlora's path runs PEFT's per-row path with one row per token,
    never the active adapter for every request."""
    m, ref = pair
    spy = StepSpy(m, monkeypatch)
    state = get_state(m)
    blocked = state.sites[len(state.sites) // 2]
    original = Site._blocked
    monkeypatch.setattr(Site, "_blocked", lambda self, st, x: self is blocked or original(self, st, x))
    prompts = random_prompts([6, 19, 3], seed=5)
    names = ["a1", "a0", "a2"]
    out = m.generate_batch(prompts, generation_config=greedy_config(5),
                           continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=names)
    _check(ref, prompts, names, [out[f"req_{i}"].generated_tokens for i in range(3)], 5)
    assert spy.peft_calls > 0


@pytest.mark.parametrize("case, exc, match", [
    ("unknown", ValueError, "non-existing adapter.*nope"),
    ("length", ValueError, "Length of `adapter_names`"),
    ("type", TypeError, "adapter names must be strings"),
])
def test_generate_batch_bad_adapter_names(pair, case, exc, match):
    m, _ = pair
    prompts = random_prompts([3, 4], seed=6)
    names = {"unknown": ["a0", "nope"], "length": ["a0"], "type": ["a0", 3]}[case]
    with pytest.raises(exc, match=match):
        m.generate_batch(prompts, generation_config=greedy_config(2), continuous_batching_config=cb_config(),
                         adapter_names=names)


def test_bad_request_is_refused_and_others_run(pair):
    m, ref = pair
    prompts = random_prompts([5, 8], seed=7)
    manager = m.init_continuous_batching(generation_config=greedy_config(4), continuous_batching_config=cb_config())
    manager.start()
    try:
        good = manager.add_request(prompts[0], adapter_name="a0")
        with pytest.raises(ValueError, match="non-existing adapter.*missing"):
            manager.add_request(prompts[1], adapter_name="missing")
        late = manager.add_request(prompts[1], adapter_name="a1")
        results = _collect(manager, [good, late])
    finally:
        manager.stop(block=True)
    _check(ref, prompts, ["a0", "a1"], [results[good], results[late]], 4)


def test_adapter_deleted_in_flight_fails_only_its_requests(pair):
    m, ref = pair
    doomed_prompt, waiting_prompt = random_prompts([10, 7], seed=21)
    others, other_names = random_prompts([6, 14, 3], seed=22), ["a0", "__base__", "a1"]
    # one request decoding at a time: the second a2 request is still waiting when a2 goes
    manager = m.init_continuous_batching(generation_config=greedy_config(300),
                                         continuous_batching_config=cb_config(max_requests_per_batch=1))
    manager.start()
    try:
        doomed = manager.add_request(doomed_prompt, adapter_name="a2", streaming=True)
        partial = manager.get_result(request_id=doomed, timeout=30)
        assert partial is not None and not partial.is_finished()  # decoding now
        waiting = manager.add_request(waiting_prompt, adapter_name="a2")
        ids = [manager.add_request(p, adapter_name=n, max_new_tokens=12) for p, n in zip(others, other_names)]
        m.delete_adapter("a2")  # waits for the step in progress
        finished, deadline = {}, time.monotonic() + 60
        while len(finished) < 2 + len(ids):
            assert time.monotonic() < deadline, f"timed out; finished: {sorted(finished)}"
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                finished[r.request_id] = r
        late = manager.add_request(others[0], adapter_name="a0", max_new_tokens=12)  # still serving
        finished[late] = _collect(manager, [late])[late]
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    for rid in (doomed, waiting):
        assert finished[rid].error is not None and "'a2'" in finished[rid].error and "deleted" in finished[rid].error
    for rid, prompt, name in zip(ids, others, other_names):
        assert finished[rid].error is None, finished[rid].error
        assert list(finished[rid].generated_tokens) == peft_alone(ref, prompt, name, 12), name
    assert finished[late] == peft_alone(ref, others[0], "a0", 12)


def test_adapter_changes_wait_for_the_call_in_progress(pair):
    """PEFT's add/delete/load/set_adapter take fastlora's call lock: they never run half-way
    through a step or a generate call of another thread."""
    import threading

    m, _ = pair
    state = get_state(m)
    done = threading.Event()
    with state.call_lock:
        t = threading.Thread(target=lambda: (m.delete_adapter("a1"), done.set()))
        t.start()
        assert not done.wait(0.3)  # blocked while a call holds the lock
        assert "a1" in m.peft_config
    t.join(10)
    assert done.is_set() and "a1" not in m.peft_config
    fastlora.unpatch(m)
    assert "delete_adapter" not in m.__dict__  # the wrappers go with the patch
    fastlora.patch(m)


def _lora_b(model, name):
    return [mod.lora_B[name].weight for mod in model.modules() if hasattr(mod, "lora_B") and name in mod.lora_B]


def test_steps_copy_only_the_adapter_values_that_changed(pair, monkeypatch):
    """An engine step copies an adapter's values into the stacks only when its parameters'
    version counters moved: a server's steps copy nothing while no adapter changes, an in-place
    edit (an optimizer step) is served from the next step, and a manager started afterwards reads
    every value again, an edit through ``.data`` (which PyTorch does not count) too."""
    from peft_fastlora.lora import pool

    m, ref = pair
    copies = []
    copy = pool.foreach_copy
    monkeypatch.setattr(pool, "foreach_copy", lambda dsts, srcs, **kw: (copies.append(len(dsts)), copy(dsts, srcs, **kw)))
    prompts = random_prompts([5, 9, 3], seed=21)
    names = ["a0", "a1", "__base__"]
    manager = m.init_continuous_batching(generation_config=greedy_config(6), continuous_batching_config=cb_config())
    manager.start()
    try:
        first_ids = manager.add_requests(prompts, adapter_names=names)
        first = _collect(manager, first_ids)
        assert copies, "the manager's first step copies its adapters' values"
        copies.clear()
        again_ids = manager.add_requests(prompts, adapter_names=names)
        again = _collect(manager, again_ids)
        assert copies == [], copies  # nothing changed: no step copied a value
        assert [again[i] for i in again_ids] == [first[i] for i in first_ids]
        with torch.no_grad():  # an optimizer's update: in place, counted
            for model in (m, ref):
                for w in _lora_b(model, "a1"):
                    w.mul_(-3.0)
        ids = manager.add_requests(prompts, adapter_names=names)
        edited = _collect(manager, ids)
        assert copies, "the edited adapter's values are copied"
    finally:
        manager.stop(block=True)
    for rid, prompt, name in zip(ids, prompts, names):
        assert edited[rid] == peft_alone(ref, prompt, name, 6), name
    assert edited[ids[1]] != first[first_ids[1]]  # the edit shows in a1's tokens
    for model in (m, ref):  # through .data: not counted; a new manager reads it
        for w in _lora_b(model, "a0"):
            w.data.mul_(-2.0)
    out = m.generate_batch(prompts, generation_config=greedy_config(6),
                           continuous_batching_config=cb_config(), adapter_names=names)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert out[f"req_{i}"].generated_tokens == peft_alone(ref, prompt, name, 6), name
    assert out["req_0"].generated_tokens != edited[ids[0]]  # the edit shows in a0's tokens


@pytest.fixture
def linear_pair():
    """(patched model, PEFT reference): ``tiny_peft_llama`` with its third adapter, LoRA on linear
    layers only (the flat per-adapter and structure checks serve every engine step)."""
    import copy

    from _models import tiny_peft_llama

    m = tiny_peft_llama(third_adapter=True)
    ref = copy.deepcopy(m)
    fastlora.patch(m)
    yield m, ref
    fastlora.unpatch(m)


def test_steps_compare_storage_only_after_a_registration_or_a_start(linear_pair, monkeypatch):
    """An engine step compares its adapters' storage addresses only where a module or parameter was
    registered since, or at a manager's first step: a server's steps skip that host work while
    nothing is registered. A parameter replaced by registering another is served from the next
    step; a storage swapped through ``.data`` by the next manager."""
    from torch import nn

    from peft_fastlora.lora import watch

    m, ref = linear_pair
    compared = []
    data_ptr = watch._data_ptr
    monkeypatch.setattr(watch, "_data_ptr", lambda t: (compared.append(1), data_ptr(t))[1])
    prompts = random_prompts([5, 9, 3], seed=22)
    names = ["a", "c", "__base__"]
    manager = m.init_continuous_batching(generation_config=greedy_config(6), continuous_batching_config=cb_config())
    manager.start()
    try:
        _collect(manager, manager.add_requests(prompts, adapter_names=names))
        assert compared, "a manager's first step compares storage"
        compared.clear()
        _collect(manager, manager.add_requests(prompts, adapter_names=names))
        assert compared == [], len(compared)  # nothing registered: no comparison
        for model in (m, ref):  # registered anew: identity and storage checked at the next step
            for mod in model.modules():
                if hasattr(mod, "lora_B") and "c" in mod.lora_B:
                    mod.lora_B["c"].weight = nn.Parameter(mod.lora_B["c"].weight.detach() * -2.0)
        ids = manager.add_requests(prompts, adapter_names=names)
        replaced = _collect(manager, ids)
        assert compared
    finally:
        manager.stop(block=True)
    for rid, prompt, name in zip(ids, prompts, names):
        assert replaced[rid] == peft_alone(ref, prompt, name, 6), name
    for model in (m, ref):  # new storage, nothing registered: a new manager follows it
        for w in _lora_b(model, "a"):
            w.data = w.data * 3.0
    out = m.generate_batch(prompts, generation_config=greedy_config(6),
                           continuous_batching_config=cb_config(), adapter_names=names)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert out[f"req_{i}"].generated_tokens == peft_alone(ref, prompt, name, 6), name


def test_a_scaling_changed_while_serving_is_followed_at_the_next_step(linear_pair):
    """Engine steps check the layers' adapter sets and scalings flat (``StructureWatch``) instead of
    layer by layer: a scaling changed between steps (PEFT's ``set_scale``) still rebuilds the
    stacks before the next step, which equals PEFT with the new scaling."""
    m, ref = linear_pair
    prompts = random_prompts([5, 9, 3], seed=23)
    names = ["a", "c", "__base__"]
    manager = m.init_continuous_batching(generation_config=greedy_config(6), continuous_batching_config=cb_config())
    manager.start()
    try:
        first_ids = manager.add_requests(prompts, adapter_names=names)
        first = _collect(manager, first_ids)
        for model in (m, ref):
            for mod in model.modules():
                if hasattr(mod, "set_scale") and "c" in getattr(mod, "scaling", {}):
                    mod.set_scale("c", 4.0)
        ids = manager.add_requests(prompts, adapter_names=names)
        scaled = _collect(manager, ids)
    finally:
        manager.stop(block=True)
    for rid, prompt, name in zip(ids, prompts, names):
        assert scaled[rid] == peft_alone(ref, prompt, name, 6), name
    assert scaled[ids[1]] != first[first_ids[1]]  # the new scaling shows in c's tokens


def test_finished_requests_are_forgotten(pair):
    m, _ = pair
    manager = m.init_continuous_batching(generation_config=greedy_config(3), continuous_batching_config=cb_config())
    manager.start()
    try:
        ids = manager.add_requests(random_prompts([4] * 6, seed=8), adapter_names=["a0", "a1", "a2"] * 2)
        _collect(manager, ids)
        cancelled = manager.add_request(random_prompts([9], seed=9)[0], adapter_name="a2", max_new_tokens=200)
        manager.cancel_request(cancelled)
        last = manager.add_request(random_prompts([4], seed=10)[0], adapter_name="a1")
        _collect(manager, [last])
        # the map holds at most the last step's requests (pruned when the next step starts)
        assert len(manager.fastlora_adapters) <= 1, manager.fastlora_adapters._names
    finally:
        manager.stop(block=True)
    assert len(manager.fastlora_adapters) == 0


def test_unpatch_restores_transformers_continuous_batching(pair):
    m, _ = pair
    inner = get_state(m).inner
    assert "generate_batch" in inner.__dict__
    assert get_state(m).report.continuous_batching == "on"
    fastlora.unpatch(m)
    assert "generate_batch" not in inner.__dict__ and "init_continuous_batching" not in inner.__dict__
    fastlora.patch(m)  # the fixture unpatches


def test_config_changes_are_logged_once(pair, caplog):
    m, _ = pair
    cfg = cb_config(allow_block_sharing=True)
    with caplog.at_level("WARNING", logger="peft_fastlora"):
        for _ in range(2):
            m.generate_batch(random_prompts([3], seed=11), generation_config=greedy_config(1),
                             continuous_batching_config=cfg, adapter_names=["a0"])
    notes = [r.getMessage() for r in caplog.records if "allow_block_sharing=False" in r.getMessage()]
    assert len(notes) == 1, notes
    assert cfg.allow_block_sharing is True  # the caller's config is not changed


def test_random_traffic_like_a_server(pair):
    """Requests of random lengths and adapters arrive in random bursts while others decode; some
    stream, some are cancelled mid-way, some name a bad adapter. Every request that finishes
    equals PEFT alone; the adapter map is empty at the end."""
    random_traffic(pair)


def random_traffic(pair, **config):
    """``test_random_traffic_like_a_server`` with these engine config fields."""
    import random

    m, ref = pair
    rng = random.Random(12)
    names = ["a0", "a1", "a2", "__base__"]
    manager = m.init_continuous_batching(
        generation_config=greedy_config(12),
        continuous_batching_config=cb_config(max_batch_tokens=24, num_blocks=96, **config))
    manager.start()
    expected, cancelled, refused = {}, set(), 0
    try:
        for burst in range(8):
            for _ in range(rng.randint(1, 5)):
                prompt = random_prompts([rng.randint(1, 40)], seed=rng.randint(0, 10**6))[0]
                if rng.random() < 0.1:
                    with pytest.raises(ValueError, match="non-existing adapter"):
                        manager.add_request(prompt, adapter_name=f"typo{burst}")
                    refused += 1
                    continue
                name, new = rng.choice(names), rng.randint(1, 12)
                rid = manager.add_request(prompt, adapter_name=name, max_new_tokens=new,
                                          streaming=rng.random() < 0.3)
                expected[rid] = (prompt, name, new)
                if rng.random() < 0.15:
                    manager.cancel_request(rid)
                    cancelled.add(rid)
            time.sleep(rng.random() * 0.05)  # let some steps run before the next burst
        finished = _collect(manager, list(expected), 120, cancelled)
    finally:
        manager.stop(block=True)
    assert refused > 0 and cancelled and len(finished) >= len(expected) - len(cancelled)
    for rid, tokens in finished.items():
        prompt, name, new = expected[rid]
        assert tokens == peft_alone(ref, prompt, name, new), (rid, name, len(prompt))
    assert len(manager.fastlora_adapters) == 0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_generate_while_a_manager_serves(pair, attention):
    """A ``generate`` call in the caller's thread while the engine's thread steps. They share the
    stacks and batch buffers, so they take turns, and both give PEFT's tokens; unless the engine
    has put a paged attention implementation on the model (eager models; every model on
    transformers < 5.24), which gives a plain forward wrong results: then generate is refused."""
    m, ref = pair
    for model in (m, ref):
        model.base_model.model.set_attn_implementation(attention)
    inner = get_state(m).inner
    prompts = random_prompts([7, 20, 3, 12], seed=13)
    names = ["a1", "a2", "a0", "__base__"]
    batch = {"input_ids": torch.tensor([prompts[1][:10], prompts[3][:10]])}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    kw = dict(adapter_names=["a0", "a2"], max_new_tokens=15, do_sample=False, pad_token_id=0, eos_token_id=None)
    manager = m.init_continuous_batching(generation_config=greedy_config(30), continuous_batching_config=cb_config())
    manager.start()
    try:
        ids = manager.add_requests(prompts, adapter_names=names)
        paged = inner.config._attn_implementation != attention
        with torch.no_grad():
            if paged:
                with pytest.raises(RuntimeError, match="paged.*stop the manager first"):
                    m.generate(**batch, **kw)
            else:
                got = [m.generate(**batch, **kw) for _ in range(3)]  # while the manager decodes
                want = ref.generate(**batch, **kw)
                for g in got:
                    assert torch.equal(g, want)
        results = _collect(manager, ids)
    finally:
        manager.stop(block=True)
    _check(ref, prompts, names, [results[i] for i in ids], 30)
    with torch.no_grad():  # the manager stopped: generate is back
        assert torch.equal(m.generate(**batch, **kw), ref.generate(**batch, **kw))


def test_layers_left_on_peft_serve_only_the_active_adapter(monkeypatch):
    """A LoRA layer left on PEFT's path applies PEFT's active adapter to every token: requests for
    it are served (and equal PEFT), any other adapter is refused with the reason."""
    from peft_fastlora import state as fastlora_state
    from peft_fastlora.compat.adapters import lora_layer_blocker

    m = build_peft_lm("llama")
    ref = copy.deepcopy(m)
    original = lora_layer_blocker
    monkeypatch.setattr(fastlora_state, "lora_layer_blocker",
                        lambda layer: "kept on PEFT for this test" if getattr(layer, "_left", False) else original(layer))
    m.base_model.model.model.layers[1].mlp.down_proj._left = True
    report = fastlora.patch(m)
    try:
        assert len(report.left_on_peft) == 1
        assert report.continuous_batching.startswith("active adapter only"), report.continuous_batching
        m.set_adapter("a1")
        prompts = random_prompts([5, 12], seed=14)
        out = m.generate_batch(prompts, generation_config=greedy_config(5), continuous_batching_config=cb_config(),
                               adapter_names=["a1", "a1"])
        _check(ref, prompts, ["a1", "a1"], [out[f"req_{i}"].generated_tokens for i in range(2)], 5)
        with pytest.raises(ValueError, match="on PEFT's path.*requests for __base__, a0 cannot"):
            m.generate_batch(prompts, generation_config=greedy_config(2), continuous_batching_config=cb_config(),
                             adapter_names=["a0", "__base__"])
    finally:
        fastlora.unpatch(m)


def test_dora_steps_compare_values_only_after_an_edit(monkeypatch):
    """DoRA's column scales are checked against their inputs' values at each call (one host sync);
    an engine step skips that comparison where the version counters of A, B and the magnitude did
    not move. An in-place edit of a magnitude between steps is followed from the next step."""
    from peft import LoraConfig

    from peft_fastlora.lora import slot_loader

    m = build_peft_lm("llama")
    torch.manual_seed(6)
    m.add_adapter("dora", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                     init_lora_weights=False, use_dora=True))
    m.eval()
    ref = copy.deepcopy(m)
    fastlora.patch(m)
    compared = []
    sync = slot_loader.sync_tables
    monkeypatch.setattr(slot_loader, "sync_tables",
                        lambda pending: (compared.append(sum(len(p[2]) for p in pending)), sync(pending))[1])
    prompts = random_prompts([6, 3], seed=9)
    names = ["dora", "a0"]
    manager = m.init_continuous_batching(generation_config=greedy_config(5), continuous_batching_config=cb_config())
    manager.start()
    try:
        _collect(manager, manager.add_requests(prompts, adapter_names=names))
        compared.clear()
        _collect(manager, manager.add_requests(prompts, adapter_names=names))
        assert compared and not any(compared), compared  # no step compared a value
        with torch.no_grad():  # in place: counted
            for model in (m, ref):
                for name, p in model.named_parameters():
                    if "lora_magnitude_vector.dora" in name:
                        p.mul_(1.5)
        ids = manager.add_requests(prompts, adapter_names=names)
        out = _collect(manager, ids)
        assert any(compared)
    finally:
        manager.stop(block=True)
        fastlora.unpatch(m)
    _check(ref, prompts, names, [out[i] for i in ids], 5)


@pytest.mark.parametrize("kind", ["lora_bias", "dora"])
def test_adapter_kind_per_request(kind, monkeypatch):
    """Requests for an adapter with a bias on B, or a DoRA one, beside plain and base requests:
    every step on fastlora's path (DoRA's scales recomputed at each step's boundary), each request
    equal to PEFT alone with its adapter."""
    from peft import LoraConfig

    m = build_peft_lm("llama")
    torch.manual_seed(5)
    m.add_adapter(kind, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                                   init_lora_weights=False, **{"use_dora" if kind == "dora" else kind: True}))
    with torch.no_grad():  # a DoRA magnitude off its initial norms
        for name, p in m.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.3)
    m.eval()
    ref = copy.deepcopy(m)
    report = fastlora.patch(m)
    try:
        assert report.adapter_fallbacks == [] and report.continuous_batching == "on", report
        spy = StepSpy(m, monkeypatch)
        prompts = random_prompts([5, 21, 2, 12, 30], seed=4)
        names = [kind, "a0", "__base__", kind, "a1"]
        out = m.generate_batch(prompts, generation_config=greedy_config(6),
                               continuous_batching_config=cb_config(max_batch_tokens=16), adapter_names=names)
        _check(ref, prompts, names, [out[f"req_{i}"].generated_tokens for i in range(len(prompts))], 6)
        assert spy.peft_calls == 0
    finally:
        fastlora.unpatch(m)


def test_request_adapters_read_in_bulk_as_one_by_one():
    """An engine step reads every request's adapter at once: the same names as one by one, a
    forked sequence's from its parent, an id with none on record refused (``names_of``) or None
    (``lookup_all``)."""
    from peft_fastlora.compat.engine import CB_CHILD_MARK
    from peft_fastlora.continuous.engine import RequestAdapters

    adapters = RequestAdapters()
    adapters.assign("r0", "a0")
    adapters.assign("r1", "__base__")
    ids = ["r1", "r0", f"r0{CB_CHILD_MARK}1"]
    assert adapters.names_of(ids) == ["__base__", "a0", "a0"] == [adapters.name_of(i) for i in ids]
    assert adapters.lookup_all(ids + ["nobody"]) == ["__base__", "a0", "a0", None]
    with pytest.raises(RuntimeError, match="'nobody' has no adapter on record"):
        adapters.names_of(ids + ["nobody"])


@pytest.mark.parametrize("pair_options", [dict(backend="triton", fuse_silu_mul=True,
                                               tuning=fastlora.Tuning(glu_expand_min_tokens=8))])
def test_engine_steps_keep_gate_up_deltas_out_of_the_activation(pair, monkeypatch):
    """``Tuning.glu_expand_min_tokens`` is for prefills: an engine step (one row of many sequences,
    prefill chunks beside decode tokens, tiles that mix them) never takes ``ops.glu_expand``,
    however many tokens it holds; every request's tokens equal PEFT's alone."""
    import peft_fastlora.ops as ops

    m, ref = pair
    assert get_state(m).report.lora_glu_expand_mlps == m.config.num_hidden_layers
    launches, launch = [], ops.glu_expand

    def spy(y, *args, **kw):
        launches.append(y.shape[0])
        return launch(y, *args, **kw)

    monkeypatch.setattr(ops, "glu_expand", spy)
    prompts = random_prompts([150, 9, 66, 1], seed=4)  # (a first step of 128 tokens of one prompt)
    names = ["a0", "a1", "__base__", "a2"]
    out = m.generate_batch(prompts, generation_config=greedy_config(3),
                           continuous_batching_config=cb_config(max_batch_tokens=128), adapter_names=names)
    _check(ref, prompts, names, [out[f"req_{i}"].generated_tokens for i in range(len(prompts))], 3)
    assert launches == []


def test_a_patched_base_with_peft_layers_asks_for_adapter_names():
    """The base model under a PeftModel, patched itself: transformers' ``active_adapters`` is a
    method there (its PEFT integration loaded none), so a request naming no adapter is refused
    with the reason, and a named one is served as PEFT serves it."""
    m = build_peft_lm("llama")
    ref = copy.deepcopy(m)
    base = m.get_base_model()
    fastlora.patch(base)
    prompts = random_prompts([6, 9], seed=7)
    manager = base.init_continuous_batching(generation_config=greedy_config(4), continuous_batching_config=cb_config())
    manager.start()
    try:
        with pytest.raises(ValueError, match="0 adapters are active .*name the adapter of each request"):
            manager.add_request(prompts[0])
        ids = manager.add_requests(prompts, adapter_names=["a2", "a1"])
        results = _collect(manager, ids)
    finally:
        manager.stop(block=True)
        fastlora.unpatch(base)
    _check(ref, prompts, ["a2", "a1"], [results[i] for i in ids], 4)
