"""On the GPU: the rotary and SiLU-mul kernels in bf16 at Llama-3-8B shapes, Gemma's RMSNorm at
Gemma-2-9B's width, and greedy decoding
through fastlora's graphs (decode attention, one-kernel norms, rotary and SiLU-mul all on, their
defaults on CUDA) equal to PEFT's own path for tiny Llama, Qwen2 and Gemma 2 and the 1B Llama
shape, in float32 so that tokens can be compared exactly."""

from __future__ import annotations

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.compat.peft import unwrap_peft

from _models import build_peft_lm, left_padded_batch, tiny_llama, with_sliding_window

pytestmark = pytest.mark.gpu


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 bits of mantissa)."""
    exp = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -100)))
    return torch.pow(2.0, exp - 7)


@pytest.mark.parametrize("bsz,seq", [(1, 1), (32, 1), (128, 1), (4, 128)])
def test_rotary_bf16_bit_exact_at_8b_shapes(bsz, seq):
    from peft_fastlora.ops.rotary import apply_rotary, apply_rotary_reference

    heads, kv_heads, dim = 32, 8, 128
    fused = torch.randn(bsz, seq, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    q = fused[..., : heads * dim].view(bsz, seq, heads, dim).transpose(1, 2)
    k = fused[..., heads * dim: (heads + kv_heads) * dim].view(bsz, seq, kv_heads, dim).transpose(1, 2)
    pos = torch.arange(seq, device="cuda")[None] + torch.randint(0, 4000, (bsz, 1), device="cuda")
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    emb = torch.cat([pos[..., None].float() * inv] * 2, dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    for name, out, ref in (("q", q_out, q_ref), ("k", k_out, k_ref)):
        diff = (out.float() - ref.float()).abs()
        assert torch.equal(out, ref), (f"{name}: {int((diff > 0).sum())} of {diff.numel()} differ, "
                                       f"max {diff.max().item():.3g} ({(diff / _bf16_ulp(ref)).max().item():.2f} ulp)")


@pytest.mark.parametrize("with_ticket", [False, True])
@pytest.mark.parametrize("bsz,seq,start", [(1, 1, 200), (32, 1, 511), (128, 1, 37), (4, 128, 0)])
def test_rotary_kv_write_bf16_equals_the_two_kernels_at_8b_shapes(bsz, seq, start, with_ticket):
    from peft_fastlora.ops.kv_cache import kv_cache_write
    from peft_fastlora.ops.rotary import apply_rotary
    from peft_fastlora.ops.rotary_kv import rotary_kv_write

    heads, kv_heads, dim, max_len = 32, 8, 128, 512
    fused = torch.randn(bsz, seq, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(bsz, seq, -1, dim).transpose(1, 2)
               for t in fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    pos = torch.arange(seq, device="cuda")[None] + torch.randint(0, 4000, (bsz, 1), device="cuda")
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    emb = torch.cat([pos[..., None].float() * inv] * 2, dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    caches = [torch.randn(bsz + 1, kv_heads, max_len, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    two = [c.clone() for c in caches]
    lengths = [torch.tensor(start, device="cuda") for _ in range(2)]
    tickets = [torch.zeros(1, dtype=torch.int32, device="cuda") if with_ticket else None for _ in range(2)]
    q_two, k_two = apply_rotary(q, k, cos, sin)
    kv_cache_write(k_two, v, two[0], two[1], lengths[0], ticket=tickets[0])
    q_one = rotary_kv_write(q, k, v, cos, sin, caches[0], caches[1], lengths[1], ticket=tickets[1])
    assert torch.equal(q_one, q_two)
    assert torch.equal(caches[0], two[0]) and torch.equal(caches[1], two[1])
    assert int(lengths[1]) == int(lengths[0]) == start + (seq if with_ticket else 0)
    stop = min(start + seq, max_len)  # the written slots (not a vacuous check)
    assert torch.equal(caches[0][:bsz, :, start:stop], k_two[:, :, : stop - start])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 32, 128])
def test_act_mul_bf16_within_one_ulp(rows, act):
    from peft_fastlora.ops.silu_mul import act_mul, act_mul_reference

    n = 14336
    fused = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16) * 3
    gate, up = fused[:, :n], fused[:, n:]
    out, ref = act_mul(gate, up, act), act_mul_reference(gate, up, act)
    diff = (out.float() - ref.float()).abs()
    # the activation's exp (GELU-tanh: against torch's tanhf) differs from torch's by an fp32 ulp or
    # so, which can move a rounding by one bf16 ulp
    assert (diff <= _bf16_ulp(ref) * 2).all(), diff.max()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 32, 128])
def test_gemma_rms_norm_bf16_within_one_ulp(rows):
    """Gemma's (1 + w) form at Gemma-2-9B's width against transformers' own norm."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from peft_fastlora.ops.rms_norm import rms_norm

    norm = Gemma2RMSNorm(3584).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(rows, 3584, device="cuda", dtype=torch.bfloat16) * 3
    with torch.no_grad():
        out, ref = rms_norm(x, norm.weight, norm.eps, unit_offset=True), norm(x)
    diff = (out.float() - ref.float()).abs()
    # the mean's summation order differs from torch's: at most a bf16 ulp after the one rounding
    assert (diff <= _bf16_ulp(ref)).all(), diff.max()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 32, 128])
def test_gemma2_sandwich_norms_bf16_within_one_ulp(rows):
    """Gemma 2's post-attention norm, residual add and pre-feedforward norm in one kernel (and the
    norm + add of the feedforward side), at Gemma-2-9B's width, against transformers' norms and
    torch's add: the sum within an ulp of the first norm's rounding, the second norm within an ulp
    of the norm of the sum returned."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from peft_fastlora.ops.rms_norm import norm_add, norm_add_norm

    norm_a, norm_b = Gemma2RMSNorm(3584).cuda().bfloat16(), Gemma2RMSNorm(3584).cuda().bfloat16()
    with torch.no_grad():
        norm_a.weight.normal_(0, 0.3)
        norm_b.weight.normal_(0, 0.3)
    x = torch.randn(rows, 3584, device="cuda", dtype=torch.bfloat16) * 3
    residual = torch.randn(rows, 3584, device="cuda", dtype=torch.bfloat16) * 3
    with torch.no_grad():
        normed_a = norm_a(x)
        want_sum = residual + normed_a
        out, summed = norm_add_norm(x, residual, norm_a.weight, norm_a.eps, norm_b.weight, norm_b.eps,
                                    unit_offset=True)
        alone = norm_add(x, residual, norm_a.weight, norm_a.eps, unit_offset=True)
        renormed = norm_b(summed)
    assert torch.equal(alone, summed)
    # norm_a's output may round the other way (an ulp of it), which the add can carry
    sum_diff = (summed.float() - want_sum.float()).abs()
    assert (sum_diff <= _bf16_ulp(normed_a) + _bf16_ulp(want_sum)).all(), sum_diff.max()
    assert (sum_diff > 0).float().mean() < 0.01
    diff = (out.float() - renormed.float()).abs()
    assert (diff <= _bf16_ulp(renormed)).all(), diff.max()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 32, 128])
def test_add_rms_norm_bf16_at_8b_width(rows):
    """The residual add and Llama's norm in one kernel, at the 8B width, the attention output read
    as a strided slice of a wider (folded) GEMM output, against torch's add then transformers' norm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from peft_fastlora.ops.rms_norm import add_rms_norm

    norm = LlamaRMSNorm(4096).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    attn = (torch.randn(rows, 4096 + 128, device="cuda", dtype=torch.bfloat16) * 3)[:, :4096]
    residual = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 3
    with torch.no_grad():
        want_sum = residual + attn
        want = norm(want_sum)
        out, summed = add_rms_norm(attn, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(summed, want_sum)
    diff = (out.float() - want.float()).abs()
    # rounded to bf16, multiplied by the weight, rounded again (as torch): one ulp of each rounding
    assert (diff <= 2 * _bf16_ulp(want)).all(), diff.max()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("gemma2", "eager")])
def test_step_mask_waits_for_nothing(arch, attn):
    """The one-token step's mask (sdpa's booleans; eager's additive floats, keyed by layer type for
    Gemma 2's sliding and full layers) is built with the host never waiting for the GPU: with
    graphs, the host builds the next step's inputs while the GPU runs this one."""
    from peft_fastlora.compat.generate import transformers_mask_builder
    from peft_fastlora.decode import step_mask

    model = build_peft_lm(arch, prepare_base=with_sliding_window(64) if arch == "gemma2" else None).cuda()
    unwrap_peft(model).set_attn_implementation(attn)
    with fastlora.patched(model):
        store = fastlora.get_state(model).graph_runner.caches
        key = "past_key_values" if "past_key_values" in transformers_mask_builder().__code__.co_varnames \
            else "cache"
        step = dict(config=unwrap_peft(model).config, inputs_embeds=torch.empty(2, 1, 0, device="cuda"),
                    attention_mask=torch.ones(2, 5, dtype=torch.long, device="cuda"),
                    **{key: store.cache_for(2, 64)})
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mask = step_mask.decode_mask(store, step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (its values against transformers' own, in real generate calls: decode/test_step_mask.py)
    masks = list(mask.values()) if isinstance(mask, dict) else [mask]
    assert mask is not None and len(masks) == (2 if arch == "gemma2" else 1)
    for m in masks:
        seen = m[:, 0, 0, :5] if m.dtype == torch.bool else m[:, 0, 0, :5] == 0
        hidden = ~m[:, 0, 0, 5:] if m.dtype == torch.bool else m[:, 0, 0, 5:] == torch.finfo(m.dtype).min
        assert seen.all() and hidden.all() and (m.dtype == torch.bool) == (attn == "sdpa")


# Gemma 2: soft-capping keeps HF's attention under sdpa; its 6-token sliding window is shorter than these calls,
# so their decode steps are eager (graphs serve calls within the window); the rotary kernel still runs
@pytest.mark.parametrize("arch,attention,graphs,norms", [("llama", "on", True, 5), ("qwen2", "on", True, 5),
                                                         ("gemma2", "off", False, 9)])
def test_tiny_models_graphs_equal_peft(arch, attention, graphs, norms):
    model = build_peft_lm(arch).cuda()
    try:
        unwrap_peft(model).set_attn_implementation("sdpa")  # the tiny builders use eager
    except ValueError:  # newer transformers refuse SDPA for Gemma 2 (it cannot soft-cap): eager stays,
        assert arch == "gemma2"  # and fastlora's decode attention, which soft-caps, takes it
        attention = "on"
    model.generation_config.eos_token_id = None
    batch = {k: v.cuda() for k, v in left_padded_batch([5, 9, 3, 7, 9, 6]).items()}
    names = ["a0", "__base__", "a1", "a2", "a0", "a2"]
    kw = dict(max_new_tokens=48, do_sample=False, pad_token_id=0, adapter_names=names)
    with torch.no_grad():
        ref = model.generate(**batch, **kw)
        report = fastlora.patch(model)
        out = model.generate(**batch, **kw)
        runner = fastlora.get_state(model).graph_runner
        stats = runner.stats if runner is not None else None
        fastlora.unpatch(model)
    assert report.decode_attention.startswith(attention), report.decode_attention
    assert report.fused_rotary == 2 and report.fused_norms == norms  # Gemma: (1 + w) norms, 4 a layer
    # the Llama family's attention forwards write the cache in the rotary's kernel; not Gemma 2's
    assert report.fused_rotary_kv == (0 if arch == "gemma2" else 2), report
    assert report.fused_mlps == 2  # SiLU, and Gemma's GELU-tanh
    # the Llama family's post-attention norms take the residual add; Gemma 2's sandwich norms the adds
    assert report.fused_add_norms == 2, report
    if graphs:
        assert stats["replays"] >= 40 and stats["eager_steps"] == 0, stats
    else:
        assert stats["replays"] == 0 and any("sliding window" in r for r in stats["eager_reasons"]), stats
    assert torch.equal(out, ref)


def test_1b_shape_graphs_equal_peft_over_64_steps():
    from peft import LoraConfig, get_peft_model

    with torch.device("cuda"):
        base = tiny_llama(0, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=64, rope_theta=500000.0, tie_word_embeddings=True)
    base.generation_config.eos_token_id = None
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = None
    for i, r in enumerate([16, 8, 32, 16]):
        lc = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, lc, adapter_name="a0")
        else:
            model.add_adapter(f"a{i}", lc)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    model.eval()
    ids = torch.randint(1, 128256, (6, 17), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[4, :9] = 0
    names = ["a0", "__base__", "a1", "a2", "a3", "a1"]
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0,
              adapter_names=names)
    with torch.no_grad():
        ref = model.generate(**kw)
        fastlora.patch(model)
        out = model.generate(**kw)
        stats = fastlora.get_state(model).graph_runner.stats
        fastlora.unpatch(model)
    assert stats["replays"] >= 60 and stats["eager_steps"] == 0, stats
    same = (out == ref).all(dim=1)
    assert same.all(), f"rows differing from PEFT: {(~same).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("with_ticket", [False, True])
@pytest.mark.parametrize("bsz,seq,start", [(32, 1, 200), (128, 1, 511), (4, 128, 0)])
def test_kv_cache_write_bf16_equals_index_copy(bsz, seq, start, with_ticket):
    from peft_fastlora.ops.kv_cache import kv_cache_write

    heads, dim, max_len = 8, 128, 512
    fused = torch.randn(bsz, seq, 2 * heads * dim, device="cuda", dtype=torch.bfloat16)
    k = fused[..., : heads * dim].view(bsz, seq, heads, dim).transpose(1, 2)
    v = fused[..., heads * dim:].view(bsz, seq, heads, dim).transpose(1, 2)
    k_cache = torch.randn(bsz, heads, max_len, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    pos = torch.arange(start, start + seq, device="cuda")
    k_ref, v_ref = k_cache.clone().index_copy_(2, pos, k), v_cache.clone().index_copy_(2, pos, v)
    length = torch.tensor(start, device="cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda") if with_ticket else None
    kv_cache_write(k, v, k_cache, v_cache, length, ticket=ticket)
    if with_ticket:  # a second launch writes at the length the first left (positions past the end dropped)
        kv_cache_write(k, v, k_cache, v_cache, length, ticket=ticket)
        pos, kept = pos + seq, pos + seq < max_len
        k_ref[:, :, pos[kept]], v_ref[:, :, pos[kept]] = k[:, :, kept], v[:, :, kept]
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    if with_ticket:
        assert int(length) == start + 2 * seq and int(ticket) == 0
