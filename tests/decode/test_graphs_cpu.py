"""The decode graph runner without a GPU: ``cuda_graphs="emulate"`` runs the same runner (static
input buffers, batch info refreshed in place, cache lengths saved and restored around capture) with
each graph re-executed eagerly, so everything but the capture itself is checked here."""

import gc
import weakref

import pytest
import torch

import peft_fastlora as fastlora
from _helpers import TokenStream
from _models import tiny_peft_llama


@pytest.fixture(scope="module")
def model():
    return tiny_peft_llama(third_adapter=True)


def _inputs(batch=4):
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (batch, 7))
    mask = torch.ones_like(ids)
    if batch > 1:  # one left-padded row
        ids[1, :2] = 0
        mask[1, :2] = 0
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)


def test_emulated_graphs_equal_peft_and_reuse_one_capture(model):
    kw = _inputs()
    mixes = [["a", "a", "a", "a"], ["a", "__base__", "b", "c"], ["__base__"] * 4]
    refs = [model.generate(**kw, adapter_names=n) for n in mixes]
    with fastlora.patched(model, cuda_graphs="emulate"):
        outs = [model.generate(**kw, adapter_names=n) for n in mixes]
        stats = fastlora.get_state(model).graph_runner.stats
    for n, o, r in zip(mixes, outs, refs):
        assert torch.equal(o, r), n
    assert stats["captures"] == 1 and stats["replays"] == 3 * 9 and stats["eager_steps"] == 0, stats


def test_sampling_with_seed_matches(model):
    kw = dict(_inputs(), do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    names = ["b", "a", "__base__", "c"]
    torch.manual_seed(5)
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate"):
        torch.manual_seed(5)
        out = model.generate(**kw, adapter_names=names)
        runner = fastlora.get_state(model).graph_runner
        # transformers' sampling loop replayed the graph; nothing of its last step stays held
        assert runner.stats["replays"] > 0 and runner.last_step is None, runner.stats
    assert torch.equal(out, ref)


def test_beam_search_decodes_eagerly_with_reason(model):
    kw = dict(_inputs(), num_beams=2)
    names = ["a", "b", "c", "__base__"]
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=names)
        stats = fastlora.get_state(model).graph_runner.stats
    assert torch.equal(out, ref)
    assert stats["captures"] == 0 and "beam search reorders the cache" in stats["eager_reasons"]


def _q_lora_b(model, name="a"):
    return model.base_model.model.model.layers[0].self_attn.q_proj.lora_B[name].weight


@pytest.mark.parametrize("how", ["in_place", "dot_data"])
def test_weight_values_changed_between_calls_keep_the_graph(model, how):
    # new values land in the stacks in place at the next call: the captured graph stays valid
    kw = _inputs()
    names = ["a", "c", "a", "b"]
    with fastlora.patched(model, cuda_graphs="emulate"):
        model.generate(**kw, adapter_names=names)
        with torch.no_grad():
            (_q_lora_b(model) if how == "in_place" else _q_lora_b(model).data).mul_(3.0)
        out = model.generate(**kw, adapter_names=names)
        stats = fastlora.get_state(model).graph_runner.stats
    ref = model.generate(**kw, adapter_names=names)
    with torch.no_grad():
        _q_lora_b(model).div_(3.0)
    assert torch.equal(out, ref)
    assert stats["captures"] == 1 and stats["replays"] == 18, stats


def test_weight_replaced_between_calls_recaptures(model):
    # a parameter re-pointed at new storage: the stacks are rebuilt, the graph holding them dropped
    kw = _inputs()
    names = ["a", "c", "a", "b"]
    old = _q_lora_b(model).data
    with fastlora.patched(model, cuda_graphs="emulate"):
        model.generate(**kw, adapter_names=names)
        _q_lora_b(model).data = old * 3.0
        out = model.generate(**kw, adapter_names=names)
        stats = fastlora.get_state(model).graph_runner.stats
    ref = model.generate(**kw, adapter_names=names)
    _q_lora_b(model).data = old
    assert torch.equal(out, ref)
    assert stats["captures"] == 2 and stats["graphs"] == 1, stats


def test_graph_options(model):
    with fastlora.patched(model, cuda_graphs=False):
        assert fastlora.get_state(model).graph_runner is None
        assert fastlora.get_state(model).graph_blocker == "cuda_graphs=False"
    with fastlora.patched(model):  # "auto" on a CPU model: off, with the reason
        assert fastlora.get_state(model).graph_blocker == "the model is not on CUDA"


@pytest.mark.parametrize("batch", [3, 5])
def test_batch_padded_to_bucket(model, batch):
    kw = _inputs(batch)
    names = (["a", "__base__", "b", "c", "a"] * 2)[:batch]
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=[4, 8]):
        out = model.generate(**kw, adapter_names=names)
        runner = fastlora.get_state(model).graph_runner
        stats = dict(runner.stats)
        caches = runner.caches.shapes()
    assert torch.equal(out, ref)
    assert stats["captures"] == 1 and stats["eager_steps"] == 0, stats
    assert caches == {(4 if batch <= 4 else 8): 256}


def test_one_bucket_graph_serves_two_batch_sizes(model):
    names6 = ["a", "b", "c", "__base__", "a", "b"]
    refs = {n: model.generate(**_inputs(n), adapter_names=names6[:n]) for n in (5, 6)}
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=[8]):
        outs = {n: model.generate(**_inputs(n), adapter_names=names6[:n]) for n in (5, 6)}
        stats = fastlora.get_state(model).graph_runner.stats
    for n in (5, 6):
        assert torch.equal(outs[n], refs[n]), n
    assert stats["captures"] == 1, stats


def test_batch_larger_than_buckets_decodes_eagerly(model):
    kw = _inputs(4)
    names = ["a", "b", "c", "a"]
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=[1, 2]):
        out = model.generate(**kw, adapter_names=names)
        stats = fastlora.get_state(model).graph_runner.stats
    assert torch.equal(out, ref)
    assert stats["captures"] == 0
    assert stats["eager_reasons"] == {"batch larger than the largest graph bucket (2 rows)": 1}


@pytest.mark.parametrize("free", [0, None, 1 << 50], ids=["short", "unknown", "plenty"])
def test_an_eager_call_short_of_memory_frees_the_graphs_first(model, monkeypatch, free):
    """A call past the largest bucket decodes eagerly with its own cache: where the device's free
    memory would not hold it beside the graphs' static cache, the graphs and the cache are freed
    first (and captured again by the next call that takes them); with room, or where the free
    memory is unknown (off CUDA), they stay. Tokens equal PEFT's throughout."""
    small, large = _inputs(2), _inputs(4)
    two, four = ["a", "c"], ["a", "b", "c", "__base__"]
    refs = [model.generate(**small, adapter_names=two), model.generate(**large, adapter_names=four)]
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=[1, 2]):
        runner = fastlora.get_state(model).graph_runner
        monkeypatch.setattr(runner, "_free_bytes", lambda: free)
        assert torch.equal(model.generate(**small, adapter_names=two), refs[0])
        held = runner.stats["cache_bytes"]
        assert held > 0 and runner.stats["graphs"] == 1
        buffers = [weakref.ref(t) for pair in runner.caches._buffers for t in pair]
        collecting = gc.isenabled()
        gc.disable()  # freed means freed now, not at the cyclic collector's next pass
        try:
            assert torch.equal(model.generate(**large, adapter_names=four), refs[1])
            alive = sum(ref() is not None for ref in buffers)
        finally:
            if collecting:
                gc.enable()
        stats = runner.stats
        freed = free == 0
        assert alive == (0 if freed else len(buffers)), alive
        assert stats["released_for_room"] == int(freed), stats
        assert (stats["cache_bytes"], stats["graphs"]) == ((0, 0) if freed else (held, 1)), stats
        assert torch.equal(model.generate(**small, adapter_names=two), refs[0])
        assert runner.stats["captures"] == 1 + freed and runner.stats["graphs"] == 1, runner.stats


def test_a_cache_that_grows_frees_the_old_one_first(model, monkeypatch):
    """A call past the shared buffers' size makes new ones: the graphs holding the old buffers are
    freed before the new ones are allocated, so the peak is the new size, not old + new."""
    small, large = _inputs(2), _inputs(4)
    two, four = ["a", "c"], ["a", "b", "c", "__base__"]
    refs = [model.generate(**small, adapter_names=two), model.generate(**large, adapter_names=four)]
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=[2, 4]):
        runner = fastlora.get_state(model).graph_runner
        assert torch.equal(model.generate(**small, adapter_names=two), refs[0])
        assert runner.stats["graphs"] == 1
        old = [weakref.ref(t) for pair in runner.caches._buffers for t in pair]
        alive_at_growth = []  # the old buffers still alive once the store let go of them
        drop = runner.caches._drop_buffers

        def counting_drop():
            drop()
            alive_at_growth.append(sum(ref() is not None for ref in old))

        monkeypatch.setattr(runner.caches, "_drop_buffers", counting_drop)
        collecting = gc.isenabled()
        gc.disable()  # freed means freed now, not at the cyclic collector's next pass
        try:
            assert torch.equal(model.generate(**large, adapter_names=four), refs[1])
        finally:
            if collecting:
                gc.enable()
        assert alive_at_growth == [0], alive_at_growth
        assert runner.stats["graphs"] == 1 and runner.stats["captures"] == 2, runner.stats
        assert torch.equal(model.generate(**small, adapter_names=two), refs[0])  # recaptured in the new buffers
        assert runner.stats["captures"] == 3, runner.stats


def test_per_row_eos_and_stopping(model):
    kw = _inputs(4)
    names = ["a", "b", "c", "__base__"]
    free = model.generate(**kw, adapter_names=names)
    eos = int(free[0, 7 + 3])  # a token row 0 emits mid-way: rows finish at different steps
    kw = dict(kw, eos_token_id=eos, max_new_tokens=12)
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=names)
        stats = fastlora.get_state(model).graph_runner.stats
    assert torch.equal(out, ref)
    assert stats["replays"] > 0


def test_streamer_sees_the_same_tokens(model):
    kw = _inputs(1)
    ref_s, out_s = TokenStream(), TokenStream()
    ref = model.generate(**kw, adapter_names=["c"], streamer=ref_s)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=["c"], streamer=out_s)
        stats = fastlora.get_state(model).graph_runner.stats
    assert torch.equal(out, ref) and out_s.chunks == ref_s.chunks
    assert stats["replays"] > 0


@pytest.mark.parametrize("bad", [dict(cuda_graphs="yes"), dict(graph_buckets=[0, 4]), dict(graph_buckets=[])])
def test_bad_graph_options(model, bad):
    with pytest.raises(ValueError):
        fastlora.patch(model, **bad)
    assert fastlora.get_state(model) is None
