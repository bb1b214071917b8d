"""The KV-cache write kernel against ``index_copy_`` (the interpreter on CPU), and fastlora's static
cache layers (``static_cache.make_static_cache``) against transformers' own ``StaticLayer.update``."""

import copy
import gc
import importlib
import weakref

import pytest
import torch

from peft_fastlora.decode.static_cache import make_static_cache, StaticCacheStore
from peft_fastlora.ops.kv_cache import kv_cache_write

from _helpers import count_calls
from _models import llama_config


def states(bsz, heads, seq, dim, dtype):
    """k / v as views of one fused projection output, as the attention modules pass v."""
    fused = torch.randn(bsz, seq, 2 * heads * dim).to(dtype)
    k = fused[..., : heads * dim].view(bsz, seq, heads, dim).transpose(1, 2)
    v = fused[..., heads * dim:].view(bsz, seq, heads, dim).transpose(1, 2)
    return k, v


def reference(k_cache, v_cache, k, v, start):
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pos = torch.arange(start, start + k.shape[2])
    keep = pos < k_cache.shape[2]
    rows = k.shape[0]
    k_ref[:rows].index_copy_(2, pos[keep], k[:, :, keep])
    v_ref[:rows].index_copy_(2, pos[keep], v[:, :, keep])
    return k_ref, v_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bsz,cache_rows,heads,seq,dim,max_len,start", [
    (3, 3, 2, 1, 16, 10, 0),    # first decode position
    (3, 5, 2, 1, 16, 10, 9),    # the last position, fewer rows than the cache holds
    (2, 2, 3, 7, 12, 20, 4),    # a prefill of 7 at an offset, head dim 12
    (1, 2, 1, 19, 8, 20, 0),    # a prefill longer than one block
    (2, 2, 2, 4, 8, 10, 8),     # runs past the end: positions >= 10 are dropped
])
def test_write_equals_index_copy(dtype, bsz, cache_rows, heads, seq, dim, max_len, start):
    k, v = states(bsz, heads, seq, dim, dtype)
    k_cache = torch.randn(cache_rows, heads, max_len, dim).to(dtype)
    v_cache = torch.randn(cache_rows, heads, max_len, dim).to(dtype)
    k_ref, v_ref = reference(k_cache, v_cache, k, v, start)
    length = torch.tensor(start)
    kv_cache_write(k, v, k_cache, v_cache, length)
    assert int(length) == start  # the caller advances it
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("bsz,heads,seq,start", [(3, 2, 1, 0), (2, 3, 19, 4), (1, 1, 1, 9), (2, 2, 4, 8)])
def test_ticket_advances_the_length_once(bsz, heads, seq, start):
    """With a ticket the launch itself advances the length by the positions written, after every
    program wrote at the old one; the ticket is back at zero, so the next launch does it again."""
    k_cache, v_cache = torch.randn(bsz, heads, 10 + seq, 8), torch.randn(bsz, heads, 10 + seq, 8)
    length, ticket = torch.tensor(start), torch.zeros(1, dtype=torch.int32)
    for step in range(3):
        k, v = states(bsz, heads, seq, 8, torch.float32)
        k_ref, v_ref = reference(k_cache, v_cache, k, v, start + step * seq)
        kv_cache_write(k, v, k_cache, v_cache, length, ticket=ticket)
        assert int(length) == start + (step + 1) * seq and int(ticket) == 0
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_ticket_with_nothing_to_write_still_advances():
    cache, length, ticket = torch.zeros(0, 2, 5, 8), torch.tensor(2), torch.zeros(1, dtype=torch.int32)
    k = torch.zeros(0, 2, 3, 8)
    kv_cache_write(k, k, cache, cache.clone(), length, ticket=ticket)
    assert int(length) == 5 and int(ticket) == 0


def test_bad_inputs():
    k, v = states(2, 2, 1, 8, torch.float32)
    cache = torch.zeros(2, 2, 5, 8)
    with pytest.raises(ValueError, match="one"):
        kv_cache_write(k, v[..., :4], cache, cache.clone(), torch.tensor(0))
    with pytest.raises(ValueError, match="cannot hold"):
        kv_cache_write(k, v, cache[:1], cache[:1].clone(), torch.tensor(0))
    with pytest.raises(TypeError, match="dtype"):
        kv_cache_write(k, v, cache.half(), cache.half(), torch.tensor(0))
    with pytest.raises(ValueError, match="length"):
        kv_cache_write(k, v, cache, cache.clone(), torch.tensor(0.0))
    with pytest.raises(ValueError, match="ticket"):
        kv_cache_write(k, v, cache, cache.clone(), torch.tensor(0), ticket=torch.zeros(1, dtype=torch.int64))


def test_static_cache_layers_match_transformers_update(monkeypatch):
    from transformers import LlamaForCausalLM


    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"), ["kv_cache_write"])

    cfg = llama_config(vocab_size=64, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    ours = make_static_cache(model, 12, batch_size=4)  # fastlora's: padded rows, kernel writes
    theirs = make_static_cache(model, 12, batch_size=3)
    theirs_layer = theirs.layers[0]
    theirs_layer.update = type(theirs_layer).update.__get__(theirs_layer)  # transformers' own update
    for seq in (5, 1, 1):  # a prefill, then two decode steps, for 3 of the 4 rows
        k, v = states(3, 2, seq, 8, torch.float32)
        got_k, got_v = ours.layers[0].update(k, v, 0)
        want_k, want_v = theirs_layer.update(k, v, 0)
        assert got_k.shape == want_k.shape
        torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)
        torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)
        assert int(ours.layers[0].cumulative_length) == int(theirs_layer.cumulative_length)
    assert not ours.layers[0].keys[3].any()  # the padding row was never written
    assert calls["kv_cache_write"] == 3  # every update took the kernel, which advanced the length itself
    assert int(ours.layers[0]._fastlora_ticket) == 0


def test_a_cleared_store_frees_its_buffers_by_reference_counting():
    """A store's caches reach its buffers through their layers: once the caller lets go of a
    cache, clearing the store frees the KV memory at once. A layer in a reference cycle (its
    ``update`` a method bound to itself, say) would keep it allocated until Python's cyclic
    collector ran, which a call short of GPU memory does not wait for."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(vocab_size=64, pad_token_id=None))
    store = StaticCacheStore(model)
    cache = store.cache_for(2, 12)
    k, v = states(2, 2, 3, 8, torch.float32)
    got = cache.layers[0].update(k, v, 0)  # the layers' update still reaches the layer
    torch.testing.assert_close(got[0][:, :, :3], k, atol=0, rtol=0)
    twin = copy.deepcopy(cache.layers[1])  # a copied layer updates itself, as with a bound method
    twin.update(k, v, 1)
    assert int(twin.cumulative_length) == 3 and int(cache.layers[1].cumulative_length) == 0
    buffers = [weakref.ref(t) for pair in store._buffers for t in pair]
    del cache, got, twin
    collecting = gc.isenabled()
    gc.disable()
    try:
        store.clear()
        assert buffers and all(ref() is None for ref in buffers)
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
@pytest.mark.parametrize("fits", [True, False])
def test_sliding_window_models_use_graphs_within_their_window(arch, fits):
    """Mistral (every layer sliding) and Gemma 2 (alternating sliding and full layers, soft-capped):
    a call whose sequence fits the window decodes through the graphs over full-attention static
    layers (no token leaves the window, so masks and attention are the same); a longer one decodes
    eagerly with the reason logged. Tokens equal PEFT's either way."""
    import peft_fastlora as fastlora

    from _models import build_peft_lm, left_padded_batch

    model = build_peft_lm(arch)
    model.generation_config.eos_token_id = None
    window = 24  # the masks read the config's window
    model.base_model.model.config.sliding_window = window
    batch = left_padded_batch([5, 9, 3, 7])
    new = window - 9 if fits else window
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, adapter_names=["a0", "__base__", "a1", "a2"])
    with torch.no_grad():
        ref = model.generate(**batch, **kw)
        report = fastlora.patch(model, cuda_graphs="emulate")
        out = model.generate(**batch, **kw)
        stats = fastlora.get_state(model).graph_runner.stats
        fastlora.unpatch(model)
    assert torch.equal(out, ref)
    assert report.cuda_graphs == "emulated", report.cuda_graphs
    if fits:
        assert stats["replays"] == new - 1 and stats["eager_steps"] == 0, stats
    else:
        assert stats["replays"] == 0, stats
        assert any("past the model's 24-token sliding window" in r for r in stats["eager_reasons"]), stats


@pytest.mark.parametrize("option,expect_kernel", [("auto", True), (False, False)])
def test_fuse_kv_write_option(option, expect_kernel, monkeypatch):
    import peft_fastlora as fastlora

    from _models import build_peft_lm, left_padded_batch

    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"), ["kv_cache_write"])
    model = build_peft_lm("llama")
    model.generation_config.eos_token_id = None
    batch = left_padded_batch([5, 9, 3])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=["a0", "__base__", "a2"])
    with torch.no_grad():
        ref = model.generate(**batch, **kw)
        fastlora.patch(model, cuda_graphs="emulate", fuse_kv_write=option)
        out = model.generate(**batch, **kw)
        fastlora.unpatch(model)
    assert torch.equal(out, ref)
    assert bool(calls["kv_cache_write"]) == expect_kernel
    with pytest.raises(ValueError, match="fuse_kv_write"):
        fastlora.patch(model, fuse_kv_write="yes")
