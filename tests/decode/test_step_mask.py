"""The one-token step's 4-D mask built by fastlora (``decode/step_mask.py``) against transformers'.

Every mask the fast path builds during real ``generate`` calls (emulated graphs, left-padded rows,
several lengths and batch sizes) is compared with what transformers' ``create_masks_for_generate``
returns for the same arguments: sdpa's boolean and eager's additive masks, one mask or masks keyed
by layer type, sliding windows the calls fit in. Steps past a window must never take it. Tokens
equal PEFT's throughout.
"""

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.compat.generate import static_cache_over, transformers_mask_builder
from peft_fastlora.decode import step_mask
from _models import build_peft_lm, left_padded_batch, with_sliding_window


def _same(a, b):
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("arch, attn, fast, options, window", [
    ("llama", "sdpa", True, {}, None),
    ("llama", "sdpa", True, {"decode_attention": True}, None),  # fastlora's decode attention (Triton's interpreter)
    ("qwen2", "sdpa", True, {}, None),  # configs with layer_types: the mask keyed by layer type
    ("llama", "eager", True, {}, None),  # additive float masks
    ("mistral", "sdpa", True, {}, 32),  # a sliding window the calls fit in
    ("mistral", "eager", True, {}, 32),
    ("gemma2", "eager", True, {}, 32),  # sliding and full layers, keyed; soft-capping
    ("gemma2", "eager", True, {"decode_attention": True}, 32),
    ("mistral", "sdpa", None, {}, 12),  # some calls past the window: those decode eagerly, with transformers' masks
])
def test_step_masks_equal_transformers_and_tokens_equal_peft(arch, attn, fast, options, window, monkeypatch):
    model = build_peft_lm(arch, prepare_base=with_sliding_window(window) if window else None)
    model.get_base_model().set_attn_implementation(attn)
    original, real, checked, steps = transformers_mask_builder(), step_mask.decode_mask, [], []

    def compare(store, kwargs):
        mask = real(store, kwargs)
        am = kwargs.get("attention_mask")
        # a step with a 2-D mask, or with none (transformers 5.24 drops an unpadded row's, 5.25 any
        # unpadded batch's): then only a window as long as the cache lets the fast path build it
        if kwargs["inputs_embeds"].shape[1] == 1 and (am is None or am.dim() == 2):
            steps.append(am.shape if am is not None else None)
        if mask is not None:
            assert _same(mask, original(**kwargs)), kwargs["attention_mask"]
            checked.append(am.shape if am is not None else None)
        return mask

    monkeypatch.setattr(step_mask, "decode_mask", compare)
    calls = [([5, 3, 7], ["a0", "__base__", "a1"], 6), ([4], ["a2"], 9), ([2, 6, 6, 1], ["a1", "a0", "a2", "a0"], 5),
             ([6, 6], ["a1", "__base__"], 5)]  # no padding
    refs = []
    for i, (lengths, names, new) in enumerate(calls):
        kw = left_padded_batch(lengths, seed=i)
        refs.append(model.generate(**kw, adapter_names=names, max_new_tokens=new, do_sample=False, pad_token_id=0))
    with fastlora.patched(model, cuda_graphs="emulate", **options) as report:
        if options.get("decode_attention"):
            assert report.decode_attention == "on", report.decode_attention
        for i, ((lengths, names, new), ref) in enumerate(zip(calls, refs)):
            kw = left_padded_batch(lengths, seed=i)
            out = model.generate(**kw, adapter_names=names, max_new_tokens=new, do_sample=False, pad_token_id=0)
            assert torch.equal(out, ref), (arch, attn, names)
    assert "create_masks_for_generate" not in model.get_base_model().__dict__  # removed after each call
    if fast:  # every step took the fast path, but those with no 2-D mask under a window
        assert len(steps) >= 13 and checked == [s for s in steps if s is not None or window is None], (checked, steps)
    else:  # only the calls that fit the window, never a step past it
        assert checked and max(shape[1] for shape in checked if shape is not None) <= window, checked
        assert None not in checked, checked


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_not_our_cache_or_a_prefill_goes_to_transformers(arch):
    model = build_peft_lm(arch, prepare_base=with_sliding_window(64) if arch == "mistral" else None)
    model.get_base_model().set_attn_implementation("sdpa")
    with fastlora.patched(model, cuda_graphs="emulate"):
        store = fastlora.get_state(model).graph_runner.caches
        cache = store.cache_for(2, 64)
        other = static_cache_over(model.get_base_model(), 64, [
            (torch.zeros(2, 2, 64, 8), torch.zeros(2, 2, 64, 8))] * model.get_base_model().config.num_hidden_layers)
        am = torch.ones(2, 5, dtype=torch.long)
        base = dict(config=model.get_base_model().config, attention_mask=am)
        key = "past_key_values" if "past_key_values" in transformers_mask_builder().__code__.co_varnames \
            else "cache"
        step = dict(base, inputs_embeds=torch.empty(2, 1, 0), **{key: cache})
        assert step_mask.decode_mask(store, step) is not None
        assert step_mask.decode_mask(store, dict(step, **{key: other})) is None
        assert step_mask.decode_mask(store, dict(step, inputs_embeds=torch.empty(2, 3, 0))) is None
        assert step_mask.decode_mask(store, dict(step, or_mask_function=lambda *a: True)) is None
        longer = torch.ones(2, store.length_of(cache) + 1, dtype=torch.long)
        assert step_mask.decode_mask(store, dict(step, attention_mask=longer)) is None
        if arch == "mistral":  # a window shorter than the cache (its caches never are): a step past it
            model.get_base_model().config.sliding_window = 40
            assert step_mask.decode_mask(store, dict(step, attention_mask=torch.ones(2, 40, dtype=torch.long))) is not None
            assert step_mask.decode_mask(store, dict(step, attention_mask=torch.ones(2, 41, dtype=torch.long))) is None
