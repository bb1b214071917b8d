"""Decode attention on the GPU: bf16 (and fp16) at Llama-3-8B attention shapes, against the fp32
reference and against transformers' own sdpa attention function, eagerly and replayed from a
CUDA graph whose inputs change in place between replays."""

from __future__ import annotations

import pytest
import torch

from _graphs import captured

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN, FILLED = 32, 8, 128, 512, 200
# (dtype, atol, rtol) against the fp32 reference of the same rounded inputs: the kernel's products
# are exact and it accumulates in fp32; the probabilities are rounded to the input dtype before
# the P @ V product (as flash attention does) and the output once (outputs are ~0.1 here)
TOLERANCES = {torch.bfloat16: (4e-3, 1.6e-2), torch.float16: (1e-3, 4e-3)}


class _AttnStub(torch.nn.Module):
    """What ``sdpa_attention_forward`` reads from an attention module."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(bsz, dtype, seed=0, filled=FILLED, cache_len=CACHE_LEN):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(bsz, HEADS, 1, HEAD_DIM, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(bsz, KV_HEADS, cache_len, HEAD_DIM, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(bsz, KV_HEADS, cache_len, HEAD_DIM, device="cuda", dtype=dtype, generator=g)
    # every row filled to the same cache index, left padding of 0..47 positions
    pad = torch.randint(0, 48, (bsz,), device="cuda", generator=g)
    pad[0] = 0
    pos = torch.arange(cache_len, device="cuda")
    mask = ((pos[None] >= pad[:, None]) & (pos[None] < filled))[:, None, None, :]
    return q, k, v, mask


def _check(out, ref, atol, rtol, name):
    err = (out.float() - ref.float()).abs()
    bad = err > atol + rtol * ref.float().abs()
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {out.numel()} differ, max {err.max().item():.3g} "
                           f"at {tuple(bad.nonzero()[0].tolist())}")
    assert err.mean().item() < atol / 4, f"{name}: mean error {err.mean().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bsz", [1, 32, 128])
def test_8b_shapes_match_reference_and_hf_sdpa(bsz, dtype):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference

    atol, rtol = TOLERANCES[dtype]
    q, k, v, mask = _inputs(bsz, dtype)
    out = decode_attention(q, k, v, mask)
    _check(out, decode_attention_reference(q, k, v, mask), atol, rtol, "reference")
    # additive mask, as the eager mask builder makes it
    add = torch.zeros(mask.shape, device="cuda", dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    _check(decode_attention(q, k, v, add), decode_attention_reference(q, k, v, add), atol, rtol, "additive")
    hf, _ = sdpa_attention_forward(_AttnStub(HEADS // KV_HEADS), q, k, v, mask, scaling=HEAD_DIM ** -0.5)
    _check(out, hf, 2 * atol, 2 * rtol, "hf sdpa")


@pytest.mark.parametrize("launch", [{}, dict(num_warps=4, block_n=64)], ids=["config", "four_warps"])
@pytest.mark.parametrize("bsz", [17, 33, 48, 96, 116, 200])
def test_every_launch_class_on_cuda(bsz, launch):
    """Batches on both sides of each class boundary of the launcher's config (8 kv heads on 132
    SMs: 1-2, 2-3, 3-7 and 7+ programs an SM), and the same shapes launched with four warps over 64
    positions, over short, long and one-position contexts, dense spans and spans with holes."""
    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference

    dtype = torch.bfloat16
    atol, rtol = TOLERANCES[dtype]
    for seed, filled, cache_len in ((20, 200, 512), (21, 1500, 2048), (22, 1, 512)):
        q, k, v, mask = _inputs(bsz, dtype, seed=seed, filled=filled, cache_len=cache_len)
        holes = mask.clone()
        holes[1::2] &= torch.rand(holes[1::2].shape, device="cuda") < 0.6
        for name, m in (("dense", mask), ("holes", holes)):
            _check(decode_attention(q, k, v, m, **launch), decode_attention_reference(q, k, v, m), atol, rtol,
                   f"bsz={bsz} filled={filled} {name} {launch}")


def test_one_warp_class_in_fp32_on_cuda():
    """fp32 inputs (the dots in fp32) through the one-warp programs of 128 rows."""
    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_config, decode_attention_reference

    assert decode_attention_config(128, KV_HEADS, HEADS // KV_HEADS, CACHE_LEN, HEAD_DIM,
                                   torch.device("cuda"))["num_warps"] == 1
    q, k, v, mask = _inputs(128, torch.float32, seed=30)
    _check(decode_attention(q, k, v, mask), decode_attention_reference(q, k, v, mask), 2e-5, 2e-5, "fp32")


@pytest.mark.parametrize("bsz", [1, 4, 32, 128])
def test_inside_a_cuda_graph(bsz):
    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference

    dtype = torch.bfloat16
    atol, rtol = TOLERANCES[dtype]
    q, k, v, mask = _inputs(bsz, dtype, seed=1)
    graph, out = captured(lambda: decode_attention(q, k, v, mask))
    for seed, filled in ((2, 137), (3, CACHE_LEN), (4, 1)):
        q2, k2, v2, m2 = _inputs(bsz, dtype, seed=seed, filled=filled)
        q.copy_(q2), k.copy_(k2), v.copy_(v2), mask.copy_(m2)
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(q, k, v, mask)  # filled=1: padded rows attend nothing -> 0
        _check(out, ref, atol, rtol, f"replay filled={filled}")


@pytest.mark.parametrize("prewait", ["off", "span"])
@pytest.mark.parametrize("bsz", [1, 32])
def test_after_pdl_kernels_that_write_q_and_the_cache_in_a_graph(bsz, prewait):
    """The step's chain in one graph: ``apply_rotary`` writes q, ``kv_cache_write`` this step's
    K/V slot (both PDL kernels, which let the attention launch before they finish), then the
    attention, whose mask scan may run before its wait. The new slot's keys are
    large, so an attention that read its K/V before they were written would be far off."""
    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference
    from peft_fastlora.ops.kv_cache import kv_cache_write
    from peft_fastlora.ops.rotary import apply_rotary

    dtype = torch.bfloat16
    atol, rtol = TOLERANCES[dtype]
    g = torch.Generator(device="cuda").manual_seed(5)
    _, k_cache, v_cache, mask = _inputs(bsz, dtype, seed=6)
    q_raw = torch.randn(bsz, HEADS, 1, HEAD_DIM, device="cuda", dtype=dtype)
    k_raw = torch.randn(bsz, KV_HEADS, 1, HEAD_DIM, device="cuda", dtype=dtype)
    v_raw = torch.randn(bsz, KV_HEADS, 1, HEAD_DIM, device="cuda", dtype=dtype)
    ang = torch.rand(bsz, 1, HEAD_DIM, device="cuda")
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    length = torch.zeros(1, dtype=torch.int64, device="cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")

    def chain():
        q, k = apply_rotary(q_raw, k_raw, cos, sin)
        kv_cache_write(k, v_raw, k_cache, v_cache, length, ticket=ticket)
        return q, decode_attention(q, k_cache, v_cache, mask, prewait=prewait)

    graph, (q_out, out) = captured(chain)
    pos = torch.arange(CACHE_LEN, device="cuda")
    for step, slot in enumerate((FILLED, 37, CACHE_LEN - 1, 0)):
        length.fill_(slot)
        mask.copy_((pos <= slot)[None, None, None, :].expand_as(mask))
        for t in (q_raw, k_raw, v_raw):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(dtype) * (4 if t is k_raw else 1))
        graph.replay()
        torch.cuda.synchronize()
        assert int(length) == slot + 1, f"step {step}: the length was not advanced"
        ref = decode_attention_reference(q_out, k_cache, v_cache, mask)
        err = (out.float() - ref.float()).abs()
        assert not (err > atol + rtol * ref.float().abs()).any(), \
            f"{prewait} bsz={bsz} slot={slot}: max error {err.max().item():.3g}"
        # the check can fail: without this step's slot the output is far off
        without = decode_attention_reference(q_out, k_cache, v_cache, mask & (pos != slot))
        assert (without.float() - ref.float()).abs().max().item() > 50 * atol


@pytest.mark.parametrize("bsz", [1, 32, 128])
def test_spans_with_holes_or_a_bias_on_cuda(bsz):
    """A span that is not dense (holes inside it; an additive mask with values other than 0) makes
    the blocks read the mask again: every row of such a batch matches the reference, and dense rows
    beside them too (the choice is a program's, made from its own row's scan)."""
    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference

    dtype = torch.bfloat16
    atol, rtol = TOLERANCES[dtype]
    q, k, v, mask = _inputs(bsz, dtype, seed=12)
    g = torch.Generator(device="cuda").manual_seed(13)
    holes = mask.clone()
    holes[::2] &= torch.rand(holes[::2].shape, device="cuda", generator=g) < 0.7  # every other row
    _check(decode_attention(q, k, v, holes), decode_attention_reference(q, k, v, holes), atol, rtol, "holes")
    add = torch.zeros(mask.shape, device="cuda", dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    add[::2, ..., 60:90] += torch.linspace(-3, 3, 30, device="cuda", dtype=dtype)  # a bias inside the span
    _check(decode_attention(q, k, v, add), decode_attention_reference(q, k, v, add), atol, rtol, "bias")


def test_tiny_llama_generate_on_cuda_equal_tokens():
    from _models import tiny_llama

    from peft_fastlora.base_ops.attention_registry import disable_decode_attention, enable_decode_attention

    model = tiny_llama(0, vocab_size=96, hidden_size=256, intermediate_size=384, num_attention_heads=8,
                       attn_implementation="sdpa").cuda().eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 96, (4, 11), device="cuda")
    am = torch.ones_like(ids)
    am[1, :3] = 0
    am[3, :10] = 0
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=16, do_sample=False,
              cache_implementation="static", disable_compile=True)  # eager: not inductor
    with torch.no_grad():
        ref = model.generate(**kw)
        assert enable_decode_attention(model) is None
        out = model.generate(**kw)
        disable_decode_attention(model)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_and_soft_capped_models_call_by_call_on_cuda(arch):
    """fp32 Mistral (sdpa, a window shorter than the prompts) and Gemma 2 (eager: alternating
    windows, soft-capping): every attention call of a static-cache generate through the kernel
    matches the model's own function on the same inputs, and the greedy tokens are the model's."""
    from peft_fastlora.base_ops.attention_registry import disable_decode_attention, enable_decode_attention
    from test_decode_attention import _prompts, _sliding_and_softcapped, call_by_call

    model = _sliding_and_softcapped(arch).cuda()
    own = model.config._attn_implementation
    ids, mask = (t.cuda() for t in _prompts(length=9))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
              disable_compile=True)
    with torch.no_grad():
        ref = model.generate(**kw)
        assert enable_decode_attention(model) is None
        out = model.generate(**kw)
    served, diffs = call_by_call(model, own, f"gpu_{arch}", **kw)
    disable_decode_attention(model)
    n = model.config.num_hidden_layers
    assert torch.equal(out, ref)
    assert served[n:] == [None] * (5 * n), served
    assert max(diffs) < 1e-5, diffs
