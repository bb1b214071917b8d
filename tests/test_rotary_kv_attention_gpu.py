"""The rotary, the KV write and decode attention in one kernel on the GPU: bf16 and fp16 at
Llama-3-8B attention shapes against the two kernels it replaces (the cache bit for bit) and the fp32
reference; in a CUDA graph after a PDL kernel that writes its q/k/v, replayed as decode steps
advance the length; and a tiny Llama and Qwen2 through fastlora's graphs against PEFT's tokens."""

from __future__ import annotations

import gc

import pytest
import torch

import peft_fastlora as fastlora

from _models import build_peft_lm, left_padded_batch

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN = 32, 8, 128, 512
# (dtype, atol, rtol) of the output against the two kernels: the same rounded inputs, the softmax
# summed in another order; against the fp32 reference: test_decode_attention_gpu.py's table
TOLERANCES = {torch.bfloat16: (4e-3, 1.6e-2), torch.float16: (1e-3, 4e-3)}


def _step_inputs(bsz, dtype, g, start):
    """A fused q/k/v output's views (the layout the attention forward passes), rotary rows at
    different positions per row, a cache with random old contents and a left-padded mask."""
    fused = torch.randn(bsz, 1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", generator=g).to(dtype)
    q, k, v = (t.view(bsz, 1, -1, HEAD_DIM).transpose(1, 2)
               for t in fused.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
    pos = torch.randint(0, 4000, (bsz, 1), device="cuda", generator=g)
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    emb = torch.cat([pos[..., None].float() * inv] * 2, dim=-1)
    pad = torch.randint(0, 48, (bsz,), device="cuda", generator=g)
    pad[0] = 0
    cols = torch.arange(CACHE_LEN, device="cuda")
    mask = ((cols[None] >= pad[:, None]) & (cols[None] <= start))[:, None, None, :]
    return q, k, v, emb.cos().to(dtype), emb.sin().to(dtype), mask


def _check(out, ref, atol, rtol, name):
    err = (out.float() - ref.float()).abs()
    bad = err > atol + rtol * ref.float().abs()
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {out.numel()} differ, max {err.max().item():.3g} "
                           f"at {tuple(bad.nonzero()[0].tolist())}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bsz,start", [(1, 200), (1, 3000 % CACHE_LEN), (32, 191), (32, 0), (128, 511), (200, 77)])
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_8b_shapes_equal_the_two_kernels(bsz, start, dtype, additive):
    from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference
    from peft_fastlora.ops.rotary_kv import rotary_kv_write
    from peft_fastlora.ops.rotary_kv_attention import rotary_kv_attention

    atol, rtol = TOLERANCES[dtype]
    g = torch.Generator(device="cuda").manual_seed(bsz * 1000 + start)
    q, k, v, cos, sin, mask = _step_inputs(bsz, dtype, g, start)
    if additive:
        mask = torch.zeros(mask.shape, device="cuda", dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    caches = [torch.randn(bsz + 1, KV_HEADS, CACHE_LEN, HEAD_DIM, device="cuda", generator=g).to(dtype)
              for _ in range(2)]
    two = [c.clone() for c in caches]
    lengths = [torch.tensor(start, device="cuda") for _ in range(2)]
    tickets = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]
    out = rotary_kv_attention(q, k, v, cos, sin, caches[0], caches[1], mask, lengths[0], ticket=tickets[0])
    q_rot = rotary_kv_write(q, k, v, cos, sin, two[0], two[1], lengths[1], ticket=tickets[1])
    ref = decode_attention(q_rot, two[0][:bsz], two[1][:bsz], mask)
    assert torch.equal(caches[0], two[0]) and torch.equal(caches[1], two[1])
    assert int(lengths[0]) == int(lengths[1]) == start + 1 and int(tickets[0]) == 0
    _check(out, ref, atol, rtol, "one kernel against two")
    _check(out, decode_attention_reference(q_rot, two[0][:bsz], two[1][:bsz], mask), atol, rtol, "reference")


@pytest.mark.parametrize("bsz", [1, 4, 32, 128])
def test_in_a_graph_after_a_pdl_kernel_that_writes_q_k_v(bsz):
    """One graph: a PDL kernel (the RMSNorm) writes the q/k/v buffer, then the one kernel; replayed
    as decode steps, each writing a new slot and advancing the length. Scores are large, so a kernel
    that read q/k/v before they were written, or left the new token out, would be far off."""
    from peft_fastlora.ops.decode_attention import decode_attention_reference
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.rotary import apply_rotary_reference
    from peft_fastlora.ops.rotary_kv_attention import rotary_kv_attention

    dtype = torch.bfloat16
    atol, rtol = TOLERANCES[dtype]
    g = torch.Generator(device="cuda").manual_seed(7)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    src = torch.randn(bsz, 1, width, device="cuda", generator=g).to(dtype)
    # the norm's weight scales q and k up: peaked softmaxes, in which the new token's weight is large
    weight = torch.full((width,), 3.0, device="cuda", dtype=dtype)
    weight[(HEADS + KV_HEADS) * HEAD_DIM:] = 1.0
    cos = torch.empty(bsz, 1, HEAD_DIM, device="cuda", dtype=dtype)
    sin = torch.empty_like(cos)
    k_cache, v_cache = (torch.randn(bsz, KV_HEADS, CACHE_LEN, HEAD_DIM, device="cuda", generator=g).to(dtype)
                        for _ in range(2))
    cols = torch.arange(CACHE_LEN, device="cuda")
    mask = torch.zeros(bsz, 1, 1, CACHE_LEN, dtype=torch.bool, device="cuda")
    length = torch.zeros(1, dtype=torch.int64, device="cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step():
        fused = rms_norm(src, weight, 1e-6)  # PDL: the next kernel may launch before it ends
        q, k, v = (t.view(bsz, 1, -1, HEAD_DIM).transpose(1, 2)
                   for t in fused.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
        return (q, k, v), rotary_kv_attention(q, k, v, cos, sin, k_cache, v_cache, mask, length, ticket=ticket)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            (q, k, v), out = step()
    finally:
        gc.enable()
    start = 190
    for i in range(4):
        slot = start + i
        length.fill_(slot)
        mask.copy_((cols <= slot)[None, None, None, :].expand_as(mask))
        src.copy_(torch.randn(src.shape, device="cuda", generator=g).to(dtype))
        ang = torch.rand(bsz, 1, HEAD_DIM, device="cuda", generator=g) * 6
        cos.copy_(ang.cos()), sin.copy_(ang.sin())
        old = (k_cache.clone(), v_cache.clone())
        graph.replay()
        torch.cuda.synchronize()
        assert int(length) == slot + 1, f"step {i}: the length was not advanced"
        q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
        assert torch.equal(k_cache[:, :, slot], k_ref[:, :, 0]) and torch.equal(v_cache[:, :, slot], v[:, :, 0])
        assert torch.equal(k_cache[:, :, :slot], old[0][:, :, :slot])  # nothing else written
        ref = decode_attention_reference(q_ref, k_cache, v_cache, mask)
        _check(out, ref, atol, rtol, f"bsz={bsz} step {i}")
        without = decode_attention_reference(q_ref, k_cache, v_cache, mask & (cols != slot))
        assert (without.float() - ref.float()).abs().max().item() > 10 * atol  # the check can fail


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_through_graphs_equal_peft_tokens(arch):
    """fp32 tiny models, the defaults on CUDA (decode attention, one-kernel rotary, graphs), two
    calls of different sizes: every decode step takes the one kernel and the tokens are PEFT's."""
    from peft_fastlora.decode import static_cache

    model = build_peft_lm(arch).cuda()
    calls = []
    original = static_cache.rotary_attention_update

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    static_cache.rotary_attention_update = counted
    try:
        for lengths, names in (([5, 9, 3, 7], ["a0", "__base__", "a1", "a2"]),
                               ([4, 11, 6, 2, 8, 3, 9], ["a2", "a1", "a0", "__base__", "a0", "a2", "a1"])):
            batch = {k: t.cuda() for k, t in left_padded_batch(lengths).items()}
            gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, adapter_names=names)
            with torch.no_grad():
                ref = model.generate(**batch, **gen)
                fastlora.patch(model)
                before = len(calls)
                tokens = model.generate(**batch, **gen)
                fastlora.unpatch(model)
            assert len(calls) - before >= model.config.num_hidden_layers, len(calls) - before
            assert torch.equal(tokens, ref)
    finally:
        static_cache.rotary_attention_update = original
