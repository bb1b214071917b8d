"""Decode graphs under server-like traffic, without a GPU (``cuda_graphs="emulate"``).

Sequences of ``generate`` calls that grow and shrink batch buckets and lengths, force evictions,
add and delete adapters, fail a capture on purpose, and run over a cache budget; every call's
tokens are compared with PEFT's own path on an identical model. The emulated runner is the real
runner (static caches, buffers, keys, eviction, failure handling) with each graph re-executed.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _models import build_peft_lm, left_padded_batch

ADAPTERS = ["a0", "a1", "a2"]


def _pair(arch="llama"):
    m, ref = build_peft_lm(arch), build_peft_lm(arch)
    for model in (m, ref):
        model.generation_config.eos_token_id = None  # random weights: every row runs to the end
    return m, ref


def _call(model, lengths, new, names, seed=None, **kw):
    batch = left_padded_batch(lengths, seed=len(lengths) * 7 + sum(lengths))
    if seed is not None:
        torch.manual_seed(seed)
        kw.update(do_sample=True, top_k=20, temperature=0.9)
    else:
        kw.update(do_sample=False)
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=new, pad_token_id=0, adapter_names=names, **kw)


def _same_as_peft(m, ref, lengths, new, names, seed=None, **kw):
    out = _call(m, lengths, new, names, seed, **kw)
    want = _call(ref, lengths, new, names, seed, **kw)
    assert torch.equal(out, want), (lengths, new, names, seed)
    return out


@pytest.mark.parametrize("sizes", [[1, 5], [1, 5, 1, 5], [8, 16, 5], [5, 1], [2, 3, 9, 1, 16, 4]])
def test_batch_size_sequences(sizes):
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate")
    for i, rows in enumerate(sizes):
        names = [(ADAPTERS + ["__base__"])[(i + r) % 4] for r in range(rows)]
        _same_as_peft(m, ref, [3 + (r * 5) % 9 for r in range(rows)], 4, names)
    stats = get_state(m).graph_runner.stats
    buckets = {get_state(m).graph_runner.bucket_for(r) for r in sizes}
    assert stats["eager_steps"] == 0 and stats["capture_failures"] == 0, stats
    assert set(get_state(m).graph_runner.caches.shapes()) <= buckets
    assert stats["graphs"] <= len(buckets)


def test_lengths_grow_and_shrink_one_cache_per_bucket():
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[2, 4])
    runner = get_state(m).graph_runner
    for lengths, new in (([5, 3], 4), ([250, 9], 10), ([4, 2], 3), ([300, 300, 2], 40), ([7], 5)):
        _same_as_peft(m, ref, lengths, new, ["a1", "__base__", "a2"][: len(lengths)])
    # bucket 2 grew to hold 260 tokens (320 after rounding); bucket 4 holds 340 (384); the shared
    # buffer holds the larger of the two products, not their sum
    assert runner.caches.shapes() == {2: 320, 4: 384}
    assert runner.caches.capacity_tokens == max(2 * 320, 4 * 384)
    assert runner.stats["cache_bytes"] == runner.caches.capacity_tokens * runner.caches.bytes_per_token()


def test_more_shapes_than_graphs_kept_evicts_least_recently_used():
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[1, 2, 4, 8], max_graphs=2)
    fastlora.warmup(m, batch_sizes=[8], max_length=16)  # the shared cache buffer sized once
    runner = get_state(m).graph_runner
    kept = []
    for rows in (1, 2, 4, 8, 1, 8, 2):
        _same_as_peft(m, ref, [4] * rows, 3, (ADAPTERS * 3)[:rows])
        kept.append(sorted(key[1] for key in runner.graphs))
    assert kept == [[1, 8], [1, 2], [2, 4], [4, 8], [1, 8], [1, 8], [2, 8]]  # least recently used out
    stats = runner.stats
    assert stats["evictions"] == 5 and stats["captures"] == 7 and stats["eager_steps"] == 0, stats


def test_adapters_added_and_deleted_between_calls():
    from peft import LoraConfig

    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate")
    _same_as_peft(m, ref, [4, 6, 3], 5, ["a0", "a1", "a2"])
    for model in (m, ref):
        torch.manual_seed(11)
        model.add_adapter("late", LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "down_proj"],
                                             init_lora_weights=False))
        model.eval()
    _same_as_peft(m, ref, [4, 6, 3, 5], 5, ["late", "a1", "__base__", "late"])
    for model in (m, ref):
        model.delete_adapter("a1")
    _same_as_peft(m, ref, [4, 6, 3], 5, ["a2", "late", "a0"])
    _same_as_peft(m, ref, [2], 3, ["late"])
    stats = get_state(m).graph_runner.stats
    assert stats["eager_steps"] == 0 and stats["capture_failures"] == 0, stats
    assert get_state(m).report.adapters == ["a0", "a2", "late"]


def test_random_call_sequence_like_a_server():
    rng = random.Random(3)
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[1, 2, 4, 8, 16], max_graphs=3)
    for i in range(14):
        rows = rng.randint(1, 20)  # past the last bucket too: eager, with the reason
        lengths = [rng.randint(1, 40) for _ in range(rows)]
        names = [rng.choice(ADAPTERS + ["__base__"]) for _ in range(rows)]
        seed = i if rng.random() < 0.25 else None
        _same_as_peft(m, ref, lengths, rng.randint(1, 12), names, seed)
    stats = get_state(m).graph_runner.stats
    assert stats["replays"] > 0 and stats["capture_failures"] == 0, stats
    assert len(get_state(m).graph_runner.graphs) <= 3


def test_failed_capture_runs_eagerly_logs_once_and_later_calls_work(monkeypatch, caplog):
    from peft_fastlora.decode import runner
    from peft_fastlora.decode.capture import EmulatedGraph

    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[4, 8])
    real_capture = EmulatedGraph.capture
    attempts = []

    def failing(self, fn):
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("injected capture failure")
        return real_capture(self, fn)

    monkeypatch.setattr(EmulatedGraph, "capture", failing)
    names = ["a0", "a2", "__base__"]
    with caplog.at_level(logging.WARNING, logger="peft_fastlora"):
        _same_as_peft(m, ref, [4, 6, 3], 5, names)  # bucket 4: the capture fails, eager steps
        _same_as_peft(m, ref, [5, 2, 7], 5, names)  # same shape: eager again, no second attempt
        _same_as_peft(m, ref, [5, 2, 7, 1, 1], 5, names + ["a1", "a1"])  # bucket 8: captured
    stats = get_state(m).graph_runner.stats
    assert stats["capture_failures"] == 1 and stats["captures"] == 1, stats
    reason = "capture failed (RuntimeError: injected capture failure)"
    assert stats["eager_reasons"][reason] == 8 and stats["eager_steps"] == 8
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("injected capture failure" in w for w in warnings) == 2, warnings  # capture + eager, once each
    assert runner.DecodeGraphRunner  # the module stays importable after the monkeypatch


def test_a_capture_out_of_memory_is_tried_again_at_the_next_call(monkeypatch):
    """Memory that one call lacked may be free at the next (another call's cache released): the
    shape is retried there, once a call, not at every step."""
    from peft_fastlora.decode.capture import EmulatedGraph

    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[4, 8])
    real_capture = EmulatedGraph.capture
    attempts = []

    def short_twice(self, fn):
        attempts.append(1)
        if len(attempts) <= 2:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real_capture(self, fn)

    monkeypatch.setattr(EmulatedGraph, "capture", short_twice)
    names = ["a0", "a2", "__base__"]
    _same_as_peft(m, ref, [4, 6, 3], 5, names)  # out of memory: eager, one attempt for its 4 steps
    assert len(attempts) == 1
    _same_as_peft(m, ref, [5, 2, 7], 5, names)  # tried again once: out of memory again
    assert len(attempts) == 2
    _same_as_peft(m, ref, [3, 3, 3], 5, names)  # tried again: captured, the next steps replay it
    stats = get_state(m).graph_runner.stats
    assert len(attempts) == 3 and stats["capture_failures"] == 2 and stats["captures"] == 1, stats
    assert stats["replays"] > 0 and stats["eager_steps"] == 8, stats


def test_cache_budget_sends_large_calls_to_eager():
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[2, 4], cache_budget_bytes=200_000)
    runner = get_state(m).graph_runner
    per_token = runner.caches.bytes_per_token()
    assert 2 * 256 * per_token <= 200_000 < 4 * 256 * per_token  # the test's premise
    _same_as_peft(m, ref, [4, 5], 4, ["a0", "a1"])  # 2 x 256 tokens: inside the budget
    _same_as_peft(m, ref, [4, 5, 6], 4, ["a0", "a1", "a2"])  # 4 x 256: over it
    stats = runner.stats
    assert stats["captures"] == 1 and stats["cache_bytes"] <= 200_000
    assert any("over cache_budget_bytes=200000" in r for r in stats["eager_reasons"]), stats


def test_report_and_logs_say_why_graphs_are_off(caplog):
    m, _ = _pair()
    with caplog.at_level(logging.INFO, logger="peft_fastlora"):
        report = fastlora.patch(m)  # "auto" on a CPU model
    assert report.cuda_graphs == "off (the model is not on CUDA)"
    assert "decode graphs off (the model is not on CUDA)" in str(report)
    assert any("decode graphs off (the model is not on CUDA)" in r.getMessage() for r in caplog.records)
    fastlora.unpatch(m)
    assert fastlora.patch(m, cuda_graphs="emulate").cuda_graphs == "emulated"


def test_eager_call_reasons_logged_once(caplog):
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate")
    with caplog.at_level(logging.WARNING, logger="peft_fastlora"):
        for _ in range(3):
            _same_as_peft(m, ref, [4, 3], 3, ["a0", "a1"], num_beams=2)
    stats = get_state(m).graph_runner.stats
    assert stats["eager_reasons"]["beam search reorders the cache"] == 3
    assert sum("beam search" in r.getMessage() for r in caplog.records) == 1


def test_warmup_captures_before_traffic():
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[1, 2, 4, 8])
    report = fastlora.warmup(m, batch_sizes=[3, 1], max_length=300)
    assert report.batch_sizes == [1, 4] and report.captures == 2 and report.max_length == 300
    runner = get_state(m).graph_runner
    assert runner.caches.shapes() == {1: 320, 4: 320} and report.cache_bytes == runner.stats["cache_bytes"]
    for lengths, names in (([5, 9, 2], ["a0", "__base__", "a2"]), ([40], ["a1"]), ([3, 3, 3, 3], ADAPTERS + ["a0"])):
        _same_as_peft(m, ref, lengths, 6, names)
    assert runner.stats["captures"] == 2  # served by the warmed-up graphs
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 8"):
        fastlora.warmup(m, batch_sizes=[9])
    with pytest.raises(ValueError, match="unknown adapter"):
        fastlora.warmup(m, batch_sizes=[1], adapter_names=["nope"])
    fastlora.unpatch(m)
    with pytest.raises(ValueError, match="not patched"):
        fastlora.warmup(m)
    fastlora.patch(m, cuda_graphs=False)
    assert fastlora.warmup(m).captures == 0  # graphs off: nothing to capture, no error


def test_warmup_after_adapters_changed():
    """A server that adds and deletes adapters warms up again (the change dropped the graphs): the
    warm-up takes PEFT's adapters as they are now, not the deleted one, and the traffic after it
    captures nothing more."""
    from peft import LoraConfig

    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate", graph_buckets=[1, 2, 4])
    assert fastlora.warmup(m, max_length=64).captures == 3
    for model in (m, ref):
        torch.manual_seed(11)
        model.add_adapter("late", LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "down_proj"],
                                             init_lora_weights=False))
        model.delete_adapter("a1")
        model.eval()
    report = fastlora.warmup(m, max_length=64)
    assert report.captures == 3  # every bucket again: the change dropped them
    runner = get_state(m).graph_runner
    for lengths, names in (([5, 9, 2], ["late", "__base__", "a2"]), ([7], ["late"]), ([3, 3, 3, 3], ["a0", "late"] * 2)):
        _same_as_peft(m, ref, lengths, 5, names)
    assert runner.stats["captures"] == 6 and get_state(m).report.adapters == ["a0", "a2", "late"]


@pytest.mark.parametrize("bad", [dict(max_graphs=0), dict(max_graphs=True), dict(cache_budget_bytes=-1),
                                 dict(graph_buckets=[2, 0]), dict(max_loras_per_batch=0), dict(fuse="yes")])
def test_bad_runner_options(bad):
    m, _ = _pair()
    with pytest.raises((ValueError, TypeError)):
        fastlora.patch(m, **bad)
    assert get_state(m) is None


def test_unpatch_releases_caches_and_graphs():
    m, ref = _pair()
    fastlora.patch(m, cuda_graphs="emulate")
    _same_as_peft(m, ref, [4, 6], 4, ["a0", "a1"])
    runner = get_state(m).graph_runner
    assert runner.stats["cache_bytes"] > 0 and runner.graphs
    fastlora.unpatch(m)
    assert runner.stats["cache_bytes"] == 0 and not runner.graphs


def test_dot_data_edits_of_fp32_adapters_on_a_bf16_model():
    """PEFT keeps adapters in fp32 on a bf16 model, fastlora's stacks are bf16 copies: an edit
    through ``.data`` must reach them at the next call, as it would a freshly patched model."""
    from peft import LoraConfig, get_peft_model

    from _models import build_causal_lm

    def build():
        base = build_causal_lm("llama").to(torch.bfloat16)
        base.generation_config.eos_token_id = None
        torch.manual_seed(5)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                init_lora_weights=False), adapter_name="x")
        return model.eval()

    def edit(model):
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        assert layer.lora_A["x"].weight.dtype == torch.float32  # PEFT's upcast: the premise
        layer.lora_A["x"].weight.data.mul_(-2.0)

    m, fresh = build(), build()
    fastlora.patch(m, cuda_graphs="emulate")
    before = _call(m, [5, 3], 6, ["x", "x"])
    edit(m)
    edit(fresh)
    fastlora.patch(fresh, cuda_graphs="emulate")
    after = _call(m, [5, 3], 6, ["x", "x"])
    assert torch.equal(after, _call(fresh, [5, 3], 6, ["x", "x"]))
    assert not torch.equal(after, before)  # the edit changed the tokens: the check means something
    assert get_state(m).graph_runner.stats["captures"] == 1  # values copied in place: same graph
