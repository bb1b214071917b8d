"""Decode attention (``ops/decode_attention.py``, ``attention.py``) on CPU, under Triton's interpreter.

The kernel against a plain torch reference (K/V repeated to every head, masked fp32 softmax) with
rows of different filled lengths (left padding, a length of 1, lengths reaching the cache end),
GQA ratios 1/4/8, odd cache lengths, several splits, bool and additive masks, soft-capping; then
the registered attention function against transformers' sdpa on a tiny Llama's real decode steps
over a StaticCache, and greedy ``generate`` with and without it. bf16 is the GPU tier's job (the
interpreter keeps bf16 as raw uint16).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora import env  # noqa: E402
from peft_fastlora.base_ops.attention_registry import (  # noqa: E402
    ATTN_NAME,
    decode_attention_enabled,
    decode_unsupported,
    disable_decode_attention,
    enable_decode_attention,
    fastlora_decode_attention,
)
from peft_fastlora.ops.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_config,
    decode_attention_reference,
    interpreting,
)

# (dtype, atol, rtol): both sides accumulate in fp32; fp32 differs by summation order only
# (observed < 1e-6), fp16 by the final rounding of an output that is an average of fp16 values
TOLERANCES = [
    (torch.float32, 2e-5, 2e-5),
    (torch.float16, 2e-3, 2e-3),
]
DTYPE_IDS = ["fp32", "fp16"]

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="CPU tests run under TRITON_INTERPRET=1")


def assert_close(actual, expected, atol, rtol, name=""):
    """allclose (a NaN is a mismatch), printing the first differing elements."""
    a, e = actual.detach().float(), expected.detach().float()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = ~((a - e).abs() <= atol + rtol * e.abs())
    if bad.any():
        idx = bad.nonzero()
        lines = [f"{name}: {len(idx)} of {a.numel()} elements differ (atol {atol}, rtol {rtol})"]
        for i in idx[:8].tolist():
            lines.append(f"  at {tuple(i)}: got {a[tuple(i)].item():.6g}, expected {e[tuple(i)].item():.6g}")
        raise AssertionError("\n".join(lines))


def make_mask(starts, ends, kv_len, additive_dtype=None):
    """(B, 1, 1, L): row b attends to [starts[b], ends[b]) (left padding before, unfilled after)."""
    pos = torch.arange(kv_len)
    m = (pos[None] >= torch.tensor(starts)[:, None]) & (pos[None] < torch.tensor(ends)[:, None])
    m = m[:, None, None, :]
    if additive_dtype is None:
        return m
    return torch.zeros(m.shape, dtype=additive_dtype).masked_fill(~m, torch.finfo(additive_dtype).min)


def rand_qkv(bsz, heads, kv_heads, kv_len, dim, dtype, strided=False):
    q = torch.randn(bsz, heads, 1, dim, dtype=dtype)
    if strided:
        # keys and values as views of a wider buffer, heads-major as HF's projections give them
        buf = torch.randn(bsz, kv_len, kv_heads, 2 * dim + 3, dtype=dtype)
        k = buf[..., :dim].transpose(1, 2)
        v = buf[..., dim + 3:].transpose(1, 2)
        q = torch.randn(bsz, 1, heads, dim + 5, dtype=dtype)[..., :dim].transpose(1, 2)
    else:
        k = torch.randn(bsz, kv_heads, kv_len, dim, dtype=dtype)
        v = torch.randn(bsz, kv_heads, kv_len, dim, dtype=dtype)
    return q, k, v


# ---- the kernel --------------------------------------------------------------------------------
# (batch, heads, kv heads, cache length, head dim, [start, end) per row, splits, block_n)
CASES = {
    # left padding of different widths, one row with one attended position, one at the cache end
    "gqa4_pad_len1_end": (4, 8, 2, 37, 16, [3, 0, 36, 10], [20, 9, 37, 37], 3, 16),
    "mha_odd_len": (3, 3, 3, 29, 8, [0, 5, 0], [29, 6, 17], 2, 16),
    "gqa8_one_split": (2, 8, 1, 45, 32, [7, 0], [45, 1], 1, 16),
    "gqa4_many_splits": (2, 4, 1, 67, 16, [0, 30], [67, 61], 5, 16),
    "head_dim_24_block64": (2, 8, 2, 70, 24, [2, 0], [70, 33], 2, 64),
}


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, dtype, atol, rtol):
    b, h, kvh, kv_len, d, starts, ends, splits, bn = CASES[case]
    q, k, v = rand_qkv(b, h, kvh, kv_len, d, dtype, strided=case.startswith("gqa4_pad"))
    mask = make_mask(starts, ends, kv_len)
    out = decode_attention(q, k, v, mask, num_splits=splits, block_n=bn)
    ref = decode_attention_reference(q, k, v, mask)
    assert out.shape == (b, 1, h, d) and out.dtype == dtype
    assert_close(out, ref, atol, rtol, case)


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_additive_mask_scaling_softcap(dtype, atol, rtol):
    b, h, kvh, kv_len, d = 3, 8, 2, 41, 16
    q, k, v = rand_qkv(b, h, kvh, kv_len, d, dtype)
    q = q * 4  # large scores, so the soft-cap bends them
    mask = make_mask([0, 4, 40], [41, 30, 41], kv_len, additive_dtype=dtype)
    mask[0, ..., 3] = float("-inf")  # -inf and finfo.min both mean masked
    mask[1, ..., 10:20] += torch.linspace(-2, 2, 10, dtype=dtype)  # a real additive bias
    for softcap in (None, 2.0):
        out = decode_attention(q, k, v, mask, scaling=0.37, softcap=softcap, num_splits=2, block_n=16)
        ref = decode_attention_reference(q, k, v, mask, scaling=0.37, softcap=softcap)
        assert_close(out, ref, atol, rtol, f"softcap={softcap}")


@needs_interpreter
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_mask_with_holes(dtype, atol, rtol):
    """Masked positions inside the attended span (not a static cache's pattern, but allowed)."""
    b, h, kvh, kv_len, d = 3, 4, 2, 53, 16
    q, k, v = rand_qkv(b, h, kvh, kv_len, d, dtype)
    mask = torch.rand(b, 1, 1, kv_len) < 0.5
    mask[2] = False
    mask[2, ..., 7] = mask[2, ..., 50] = True  # two positions, 43 apart
    out = decode_attention(q, k, v, mask, num_splits=2, block_n=16)
    assert_close(out, decode_attention_reference(q, k, v, mask), atol, rtol, "holes")


@needs_interpreter
def test_masked_blocks_are_not_read():
    """NaN in every K/V position no row attends: a block that is read would poison the output."""
    b, h, kvh, kv_len, d = 2, 4, 1, 64, 16
    q, k, v = rand_qkv(b, h, kvh, kv_len, d, torch.float32)
    starts, ends = [16, 0], [32, 16]  # whole 16-blocks only
    mask = make_mask(starts, ends, kv_len)
    ref = decode_attention_reference(q, k, v, mask)
    for row, (s, e) in enumerate(zip(starts, ends)):
        keep = torch.zeros(kv_len, dtype=torch.bool)
        keep[s:e] = True
        k[row, :, ~keep] = float("nan")
        v[row, :, ~keep] = float("nan")
    for splits in (1, 3):
        out = decode_attention(q, k, v, mask, num_splits=splits, block_n=16)
        assert_close(out, ref, 2e-5, 2e-5, f"splits={splits}")


@needs_interpreter
def test_row_with_nothing_to_attend_is_zero_and_batch_broadcast_mask():
    q, k, v = rand_qkv(2, 4, 2, 20, 8, torch.float32)
    none = torch.zeros(2, 1, 1, 20, dtype=torch.bool)
    out = decode_attention(q, k, v, none, num_splits=2, block_n=16)
    assert torch.equal(out, torch.zeros_like(out))
    shared = make_mask([2], [19], 20)  # (1, 1, 1, L): one mask for every row
    out = decode_attention(q, k, v, shared, num_splits=2, block_n=16)
    assert_close(out, decode_attention_reference(q, k, v, shared.expand(2, -1, -1, -1)), 2e-5, 2e-5)


@needs_interpreter
@pytest.mark.parametrize("case", ["gqa4_pad_len1_end", "gqa4_many_splits"])
def test_mask_scan_before_the_wait_gives_the_same_bits(case):
    """``prewait``: the span found before the PDL wait ("span") or after it ("off"): the same
    arithmetic, bit for bit."""
    b, h, kvh, kv_len, d, starts, ends, splits, bn = CASES[case]
    q, k, v = rand_qkv(b, h, kvh, kv_len, d, torch.float32, strided=True)
    mask = make_mask(starts, ends, kv_len)
    outs = {w: decode_attention(q, k, v, mask, num_splits=splits, block_n=bn, prewait=w)
            for w in ("off", "span", None)}  # None: the config's choice
    assert torch.equal(outs["off"], outs["span"]) and torch.equal(outs["off"], outs[None])
    assert_close(outs["off"], decode_attention_reference(q, k, v, mask), 2e-5, 2e-5, case)
    with pytest.raises(ValueError, match="prewait"):
        decode_attention(q, k, v, mask, prewait="early")


@needs_interpreter
@pytest.mark.parametrize("case", ["gqa4_pad_len1_end", "gqa4_many_splits"])
def test_dense_spans_skip_the_mask_with_the_same_bits(case):
    """A dense span (all attended, no additive value but 0) lets the blocks skip the mask load;
    holes and a bias inside the span keep it. Each gives the bits of blocks that always read it."""
    b, h, kvh, kv_len, d, starts, ends, splits, bn = CASES[case]
    # the split class (100 SMs): dense spans skip the mask
    assert decode_attention_config(b, kvh, h // kvh, kv_len, d, torch.device("cpu"), sms=100)["dense_spans"]
    q, k, v = rand_qkv(b, h, kvh, kv_len, d, torch.float32)
    dense = make_mask(starts, ends, kv_len)
    holes = dense.clone()
    holes[0, ..., starts[0] + 2] = False
    biased = make_mask(starts, ends, kv_len, additive_dtype=torch.float32)
    biased[0, ..., starts[0] + 1:starts[0] + 4] += 0.5
    for name, mask in (("dense", dense), ("holes", holes), ("additive", biased),
                       ("additive dense", make_mask(starts, ends, kv_len, additive_dtype=torch.float32))):
        got = decode_attention(q, k, v, mask, num_splits=splits, block_n=bn, dense_spans=True)
        always = decode_attention(q, k, v, mask, num_splits=splits, block_n=bn, dense_spans=False)
        assert torch.equal(got, always), name
        assert_close(got, decode_attention_reference(q, k, v, mask), 2e-5, 2e-5, f"{case} {name}")


@needs_interpreter
@pytest.mark.parametrize("bsz,block_n,warps", [(1, 64, 4), (2, 128, 4), (5, 64, 4), (7, 64, 4), (14, 16, 1)])
def test_every_launch_class_of_the_config(bsz, block_n, warps):
    """The launcher's own config in each of its classes (on the interpreter's 4 "SMs", 2 kv heads:
    split, one to two programs an SM, two to three, four warps, one warp over 16 positions) against
    the reference, rows of different spans, one with holes."""
    kv_heads, kv_len = 2, 150
    cfg = decode_attention_config(bsz, kv_heads, 4, kv_len, 32, torch.device("cpu"))
    assert (cfg["block_n"], cfg["num_warps"]) == (block_n, warps)
    torch.manual_seed(bsz)
    q, k, v = rand_qkv(bsz, 8, kv_heads, kv_len, 32, torch.float32)
    starts = [(7 * i) % 40 for i in range(bsz)]
    ends = [kv_len - (5 * i) % 60 for i in range(bsz)]
    mask = make_mask(starts, ends, kv_len)
    mask[0, ..., starts[0] + 3:starts[0] + 20:2] = False
    assert_close(decode_attention(q, k, v, mask), decode_attention_reference(q, k, v, mask), 2e-5, 2e-5,
                 f"bsz={bsz}")


def test_config_is_static_and_sane():
    cpu = torch.device("cpu")  # an H200's 132 SMs, Llama-3-8B's 8 kv heads of 4 query heads, 128 dims

    def h200(*args):
        return decode_attention_config(*args, sms=132)

    one = h200(1, 8, 4, 512, 128, cpu)
    assert one["block_h"] == 16 and one["block_d"] == 128 and one["block_n"] == 64
    assert one["num_splits"] == 8 and one["prewait"] == "span"  # split: the mask scan before the wait
    assert one["num_warps"] == 4
    mid = h200(32, 8, 4, 512, 128, cpu)  # 256 programs: two per SM, longer blocks
    assert mid["num_splits"] == 1 and mid["block_n"] == 128 and mid["prewait"] == "off"
    assert h200(48, 8, 4, 512, 128, cpu)["block_n"] == 64  # 384: nearly three per SM
    four = h200(64, 8, 4, 512, 128, cpu)  # 512 programs: under seven per SM
    assert four["num_warps"] == 4 and four["block_n"] == 64
    big = h200(128, 8, 4, 512, 128, cpu)  # 1,024: one-warp programs
    assert big["num_splits"] == 1 and big["prewait"] == "off"
    assert big["num_warps"] == 1 and big["block_n"] == 16
    assert h200(116, 8, 4, 512, 128, cpu)["num_warps"] == 1  # 928 >= 7 x 132
    assert h200(115, 8, 4, 512, 128, cpu)["num_warps"] == 4
    assert h200(96, 8, 4, 512, 128, cpu)["num_warps"] == 4
    # dense spans skip the mask at one row (splits) and 128 rows, not at 32 (measured slower there)
    assert one["dense_spans"] and big["dense_spans"] and not mid["dense_spans"]
    assert h200(1, 1, 1, 30, 256, cpu)["block_n"] == 32
    assert h200(32, 8, 1, 512, 256, cpu)["block_n"] == 32  # wide heads keep theirs
    wide = h200(128, 8, 2, 512, 256, cpu)  # no one-warp programs for them
    assert wide["block_n"] == 32 and wide["num_warps"] == 4


def test_launcher_rejects_bad_shapes():
    q, k, v = rand_qkv(2, 4, 2, 20, 8, torch.float32)
    with pytest.raises(ValueError, match="mask"):
        decode_attention(q, k, v, torch.ones(2, 1, 1, 19, dtype=torch.bool))
    with pytest.raises(ValueError, match="query heads"):
        decode_attention(q, k[:, :1].expand(2, 3, 20, 8), v[:, :1].expand(2, 3, 20, 8),
                         torch.ones(2, 1, 1, 20, dtype=torch.bool))
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q.expand(2, 4, 2, 8), k, v, torch.ones(2, 1, 1, 20, dtype=torch.bool))


# ---- the registered function on a tiny Llama --------------------------------------------------
def _tiny_llama(attn="sdpa", **kw):
    from _models import tiny_llama

    model = tiny_llama(0, vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                       max_position_embeddings=128, attn_implementation=attn, **kw)
    model.generation_config.eos_token_id = None
    return model


def _prompts(bsz=3, length=9):
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (bsz, length))
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 4, 8][:bsz]):  # left padding; the last row has one real token
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


@needs_interpreter
def test_registered_function_matches_sdpa_on_llama_decode_steps():
    """Every attention call of a static-cache generate is run both ways on the same inputs."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _tiny_llama()
    assert enable_decode_attention(model) is None
    served, diffs = [], []

    def both(module, query, key, value, attention_mask, **kwargs):
        ref, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        out, w = fastlora_decode_attention(module, query, key, value, attention_mask, **kwargs)
        served.append(decode_unsupported(module, query, key, value, attention_mask, **kwargs))
        diffs.append((out.float() - ref.float()).abs().max().item())
        assert out.shape == ref.shape and w is None
        return out, w

    AttentionInterface.register("fastlora_test_both", both)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("fastlora_test_both", sdpa_mask)
    model.set_attn_implementation("fastlora_test_both")
    ids, mask = _prompts()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                       cache_implementation="static")
    n_layers = model.config.num_hidden_layers
    assert served[:n_layers] == ["not a one-token step"] * n_layers  # prefill went to sdpa
    assert served[n_layers:] == [None] * (4 * n_layers)  # every decode step to the kernel
    assert max(diffs) < 1e-5, diffs


@needs_interpreter
def test_generate_greedy_tokens_equal_with_and_without():
    model = _tiny_llama()
    ids, mask = _prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(**kw)
        assert enable_decode_attention(model) is None
        assert model.config._attn_implementation == ATTN_NAME and decode_attention_enabled(model)
        assert enable_decode_attention(model) is None  # idempotent
        out = model.generate(**kw)
        # and through the dynamic cache too (the mask then has the keys' length as well)
        out_dyn = model.generate(**dict(kw, cache_implementation=None))
        disable_decode_attention(model)
    assert model.config._attn_implementation == "sdpa" and not decode_attention_enabled(model)
    assert torch.equal(out, ref), (out, ref)
    assert torch.equal(out_dyn, ref), (out_dyn, ref)
    disable_decode_attention(model)  # a no-op now


def _small(**kw):
    return dict(dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2), **kw)


def test_enable_refuses_what_it_does_not_implement():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    capped = _tiny_llama()
    capped.config.attn_logit_softcapping = 2.0  # an sdpa model whose config asks for soft-capping
    assert "soft-capping with sdpa" in enable_decode_attention(capped)
    assert capped.config._attn_implementation == "sdpa"
    flex = _tiny_llama(attn="flex_attention") if _has_flex() else None
    if flex is not None:
        assert "only sdpa and eager" in enable_decode_attention(flex)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **_small(attn_implementation="sdpa")))
    assert enable_decode_attention(qwen2) is None  # a window in the config, but not used
    disable_decode_attention(qwen2)
    assert qwen2.config._attn_implementation == "sdpa"
    assert enable_decode_attention(torch.nn.Linear(2, 2)) == "not a transformers model"


def _has_flex():
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return "flex_attention" in ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False


def _sliding_and_softcapped(arch):
    """Mistral (sdpa, a window shorter than the prompts) and Gemma 2 (eager: alternating sliding
    layers, logit soft-capping, a query scale of its own), tiny, fp32."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    if arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=5, **_small(vocab_size=96, attn_implementation="sdpa")))
    elif arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(head_dim=8, sliding_window=5, attn_logit_softcapping=0.05,
                                               query_pre_attn_scalar=6, **_small(vocab_size=96, attn_implementation="eager")))
    else:
        model = _tiny_llama(attn="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


@needs_interpreter
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "llama-eager"])
def test_sliding_windows_soft_capping_and_eager_models_give_their_own_tokens(arch):
    """The kernel serves their decode steps (windows from the masks, soft-capping as eager applies
    it) and their own function the rest: greedy tokens equal the model's own attention, through a
    static and a dynamic cache, with prompts and outputs longer than the window."""
    model = _sliding_and_softcapped(arch)
    own = model.config._attn_implementation
    ids, mask = _prompts(length=9)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    calls = []
    caller = importlib.import_module("peft_fastlora.base_ops.attention_registry")  # where the kernel is called
    real = caller.decode_attention

    def counted(*a, **k):
        calls.append(k.get("softcap"))
        return real(*a, **k)

    with torch.no_grad():
        want = {c: model.generate(**kw, cache_implementation=c) for c in ("static", None)}
        assert enable_decode_attention(model) is None and decode_attention_enabled(model)
        caller.decode_attention = counted
        try:
            got = {c: model.generate(**kw, cache_implementation=c) for c in ("static", None)}
        finally:
            caller.decode_attention = real
        disable_decode_attention(model)
    assert model.config._attn_implementation == own
    assert not any("_fastlora_prefill_attention" in m.__dict__ for m in model.modules())
    for c in want:
        assert torch.equal(got[c], want[c]), (arch, c, got[c], want[c])
    assert len(calls) >= 2 * 5 * model.config.num_hidden_layers  # every decode step of both calls
    assert set(calls) == ({0.05} if arch == "gemma2" else {None})


@needs_interpreter
@pytest.mark.parametrize("arch", ["gemma2", "llama-eager"])
def test_decode_steps_that_return_attention_weights_run_the_models_own_function(arch):
    """``output_attentions``: the kernel computes no weights, so the steps that return them run the
    model's own function: every step has one tensor per layer, equal to the model's own."""
    model = _sliding_and_softcapped(arch)
    ids, mask = _prompts(length=9)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_attentions=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**kw, cache_implementation="static")
        assert enable_decode_attention(model) is None
        try:
            got = model.generate(**kw, cache_implementation="static")
        finally:
            disable_decode_attention(model)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.attentions) == len(want.attentions) == 3
    for step, step_ref in zip(got.attentions, want.attentions, strict=True):
        assert len(step) == len(step_ref) == model.config.num_hidden_layers
        for t, t_ref in zip(step, step_ref, strict=True):
            torch.testing.assert_close(t, t_ref, atol=1e-6, rtol=1e-6)


def test_fallback_reasons():
    module = torch.nn.Module().eval()
    q, k, v = rand_qkv(2, 4, 2, 20, 8, torch.float32)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    assert decode_unsupported(module, q.expand(2, 4, 3, 8), k, v, mask) == "not a one-token step"
    assert decode_unsupported(module, q, k, v, None) == "no 4-D attention mask"
    assert decode_unsupported(module, q, k, v, mask, sliding_window=4) is None  # the mask holds the window
    assert decode_unsupported(module, q, k, v, mask, dropout=0.1) == "training or dropout"
    assert "mask" in decode_unsupported(module, q, k, v, mask[..., :19])
    assert decode_unsupported(module, q, k, v, mask, s_aux=torch.zeros(4)) == "attention kwarg 's_aux'"
    module.train()
    assert decode_unsupported(module, q, k, v, mask) == "training or dropout"


def call_by_call(model, own: str, label: str, **generate_kw):
    """Generate with every attention call run both by the model's own function (``own``: "sdpa" or
    "eager", the implementation before ``enable_decode_attention``, which must have run: it sets
    the eager prefill functions) and by fastlora's, on the same inputs. Returns fastlora's fallback
    reason per call (None: the kernel) and the largest difference per call."""
    import sys

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    eager = own == "eager"
    own_fn = sys.modules[type(model.model.layers[0].self_attn).__module__].eager_attention_forward if eager \
        else sdpa_attention_forward
    served, diffs = [], []

    def both(module, query, key, value, attention_mask, **kwargs):
        want = own_fn(module, query, key, value, attention_mask, **kwargs)[0]
        got, w = fastlora_decode_attention(module, query, key, value, attention_mask, **kwargs)
        served.append(decode_unsupported(module, query, key, value, attention_mask, **kwargs))
        diffs.append((got.float() - want.float()).abs().max().item())
        return got, w

    name = f"fastlora_test_both_{label}"
    AttentionInterface.register(name, both)
    AttentionMaskInterface.register(name, eager_mask if eager else sdpa_mask)
    model.set_attn_implementation(name)
    with torch.no_grad():
        model.generate(**generate_kw)
    return served, diffs


@needs_interpreter
@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_every_attention_call_matches_the_models_own_function(arch):
    """Each attention call of a generate is run by the model's own function and by fastlora's on
    the same inputs (greedy tokens alone can miss a soft-capping or window error on a tiny model)."""
    model = _sliding_and_softcapped(arch)
    own = model.config._attn_implementation
    assert enable_decode_attention(model) is None
    ids, mask = _prompts(length=9)
    served, diffs = call_by_call(model, own, arch, input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                 do_sample=False, cache_implementation="static")
    disable_decode_attention(model)
    n = model.config.num_hidden_layers
    assert served[n:] == [None] * (5 * n), served  # every decode step through the kernel
    assert max(diffs) < 1e-5, diffs


def _splits_under(sms: str) -> int:
    """``num_splits`` of one CPU launch in a fresh process with FASTLORA_INTERPRETER_SMS (read at import)."""
    code = ("from peft_fastlora.ops.decode_attention import decode_attention_config as c; import torch; "
            "print(c(2, 8, 4, 4096, 128, torch.device('cpu'))['num_splits'])")
    env = dict(os.environ, FASTLORA_INTERPRETER_SMS=sms)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout)


def test_interpreter_sm_count_from_the_environment(monkeypatch):
    """The interpreter plans launches for FASTLORA_INTERPRETER_SMS SMs (more SMs: more splits than
    this process's default of 4); a value that is not a positive integer is refused, by name."""
    assert env.INTERPRETER_SMS == 4, "the tests run with the default"
    few = decode_attention_config(2, 8, 4, 4096, 128, torch.device("cpu"))["num_splits"]
    assert _splits_under("132") > few
    for bad in ("lots", "0", "-3"):
        monkeypatch.setenv("FASTLORA_INTERPRETER_SMS", bad)
        with pytest.raises(ValueError, match="FASTLORA_INTERPRETER_SMS must be a positive integer"):
            env._positive_int("FASTLORA_INTERPRETER_SMS", 4)
