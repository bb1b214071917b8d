"""The rotary, the KV-cache write and decode attention in one kernel (``ops/rotary_kv_attention.py``,
the interpreter on CPU): the cache bit for bit and the output against the two kernels it replaces
(``rotary_kv_write`` then ``decode_attention``) and against torch; then the Llama-family attention
forwards that take it on one-token steps, against PEFT through emulated graphs."""

import importlib

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import _compat
from peft_fastlora.ops.decode_attention import decode_attention, decode_attention_reference
from peft_fastlora.ops.rotary import apply_rotary_reference
from peft_fastlora.ops.rotary_kv import rotary_kv_write
from peft_fastlora.ops.rotary_kv_attention import rotary_kv_attention

from _helpers import count_calls
from _models import build_peft_lm, left_padded_batch, with_sliding_window
from test_decode_attention import assert_close, make_mask
from test_rotary_silu import rope_inputs

attention_forwards = importlib.import_module("peft_fastlora.base_ops.attention_forwards")
static_cache = importlib.import_module("peft_fastlora.decode.static_cache")
rotary_kv_ops = importlib.import_module("peft_fastlora.ops.rotary_kv")

# (dtype, atol, rtol) for the output against the two kernels: the same inputs, the softmax summed in
# another order (the new position last); fp16 also by the final rounding of the output
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3)}


def _inputs(bsz, heads, kv_heads, dim, cache_rows, kv_len, start, dtype, pad=None, additive=False):
    q, k, cos, sin = rope_inputs(bsz, heads, kv_heads, 1, dim, dtype)
    v = torch.randn(bsz, 1, kv_heads, dim + 3).to(dtype)[..., :dim].transpose(1, 2)  # a strided view
    caches = [torch.randn(cache_rows, kv_heads, kv_len, dim).to(dtype) for _ in range(2)]
    pad = pad if pad is not None else [int(i * 3 % max(start, 1)) for i in range(bsz)]  # left padding
    mask = make_mask(pad, [start + 1] * bsz, kv_len, additive_dtype=dtype if additive else None)
    return q, k, v, cos, sin, caches, mask


def _both(inputs, start, ticket, scaling=None, softcap=None, **overrides):
    """(the one kernel's output, caches, length, ticket), then the two kernels' (ticket None there
    when not given)."""
    q, k, v, cos, sin, caches, mask = inputs
    runs = []
    for one in (True, False):
        kc, vc = (c.clone() for c in caches)
        length = torch.tensor([start])
        t = torch.zeros(1, dtype=torch.int32) if ticket else None
        if one:
            out = rotary_kv_attention(q, k, v, cos, sin, kc, vc, mask, length, ticket=t, scaling=scaling,
                                      softcap=softcap, **overrides)
        else:
            q_rot = rotary_kv_write(q, k, v, cos, sin, kc, vc, length, ticket=t)
            out = decode_attention(q_rot, kc[: q.shape[0]], vc[: q.shape[0]], mask, scaling=scaling,
                                   softcap=softcap, **overrides)
        runs.append((out, kc, vc, length, t))
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bsz,heads,kv_heads,dim,cache_rows,kv_len,start", [
    (3, 8, 2, 16, 4, 24, 10),  # GQA 4, a cache row more than the batch
    (2, 4, 4, 12, 2, 17, 16),  # no GQA, head dim 12 (not a power of two), odd length, the last slot
    (2, 8, 1, 16, 2, 40, 3),  # GQA 8, a short fill
    (1, 6, 2, 8, 1, 9, 0),  # the first position: the new token is all there is
])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("ticket", [True, False])
def test_equals_rotary_kv_write_then_decode_attention(dtype, bsz, heads, kv_heads, dim, cache_rows, kv_len, start,
                                                      splits, ticket):
    inputs = _inputs(bsz, heads, kv_heads, dim, cache_rows, kv_len, start, dtype)
    # 16-position blocks: the span of every case but the shortest spreads over several blocks
    # (the splits' work is blocks: a longer block would leave one split with everything)
    (out, kc, vc, length, t), (ref, kc2, vc2, length2, t2) = _both(inputs, start, ticket, num_splits=splits,
                                                                   block_n=16)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert int(length) == int(length2) == start + (1 if ticket else 0)
    assert t is None or int(t) == 0
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, ref, atol, rtol, "one kernel against two")
    # and against torch: the rotary by transformers' formula, the cache written, softmax in fp32
    q, k, v, cos, sin, caches, mask = inputs
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    kr, vr = (c.clone()[:bsz] for c in caches)
    kr[:, :, start], vr[:, :, start] = k_ref[:, :, 0], v[:, :, 0]
    assert torch.equal(kc[:bsz], kr) and torch.equal(vc[:bsz], vr)
    assert_close(out, decode_attention_reference(q_ref, kr, vr, mask), atol, rtol, "one kernel against torch")


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("prewait", ["off", "span"])
def test_masks_softcap_and_the_early_scan(additive, prewait):
    """Additive (eager) masks, soft-capping and the mask scan before the PDL wait; a row that does
    not attend its own new position (a custom mask) and a row that attends nothing."""
    dtype = torch.float32
    inputs = list(_inputs(4, 8, 2, 16, 4, 20, 11, dtype, pad=[0, 4, 2, 0], additive=additive))
    mask = inputs[-1].clone()
    masked = torch.finfo(dtype).min if additive else False
    mask[1, ..., 11] = masked  # row 1: its new position hidden
    mask[3] = masked  # row 3: nothing attended: zeros, as the two kernels give
    inputs[-1] = mask
    (out, kc, vc, *_), (ref, kc2, vc2, *_) = _both(inputs, 11, True, softcap=3.0, num_splits=2, block_n=16,
                                                  prewait=prewait)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert_close(out, ref, 2e-5, 2e-5, "with soft-capping")
    assert torch.count_nonzero(out[3]) == 0 and torch.count_nonzero(out[1]) > 0


def test_a_full_cache_writes_and_attends_nothing_new():
    """At fill length L (no slot left) nothing is written, the new token is not attended (the mask
    has no column for it), and the length still advances, as the two kernels do."""
    inputs = _inputs(2, 4, 2, 8, 2, 6, 5, torch.float32)
    q, k, v, cos, sin, caches, _ = inputs
    inputs = (q, k, v, cos, sin, caches, make_mask([0, 2], [6, 6], 6))
    (out, kc, vc, length, _), (ref, kc2, vc2, length2, _) = _both(inputs, 6, True)
    assert torch.equal(kc, caches[0]) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert int(length) == int(length2) == 7
    assert_close(out, ref, 2e-5, 2e-5, "full cache")


def test_bad_inputs_are_refused():
    q, k, v, cos, sin, (kc, vc), mask = _inputs(2, 4, 2, 8, 2, 6, 2, torch.float32)
    length = torch.tensor([2])
    with pytest.raises(ValueError, match="\\(B, H, 1, D\\)"):
        rotary_kv_attention(q.expand(2, 4, 2, 8), k.expand(2, 2, 2, 8), v.expand(2, 2, 2, 8), cos.expand(2, 2, 8),
                            sin.expand(2, 2, 8), kc, vc, mask, length)
    with pytest.raises(ValueError, match="cos / sin"):
        rotary_kv_attention(q, k, v, cos[..., :4], sin[..., :4], kc, vc, mask, length)
    with pytest.raises(ValueError, match="cannot hold"):
        rotary_kv_attention(q, k, v, cos, sin, kc[:1], vc[:1], mask, length)
    with pytest.raises(ValueError, match="mask"):
        rotary_kv_attention(q, k, v, cos, sin, kc, vc, mask[..., :5], length)
    with pytest.raises(ValueError, match="ticket"):
        rotary_kv_attention(q, k, v, cos, sin, kc, vc, mask, length, ticket=torch.zeros(1))
    with pytest.raises(ValueError, match="odd"):
        rotary_kv_attention(q[..., :7], k[..., :7], v[..., :7], cos[..., :7], sin[..., :7], kc[..., :7],
                            vc[..., :7], mask, length)


# ---- the attention forwards ----------------------------------------------------------------------
@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("mistral", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")])
def test_patched_model_decodes_through_the_one_kernel_and_equals_peft(arch, attn, monkeypatch):
    one = count_calls(monkeypatch, static_cache, ["rotary_attention_update"])
    writes = count_calls(monkeypatch, rotary_kv_ops, ["rotary_kv_write"])
    def prepare(base):
        if arch == "mistral":  # the tiny Mistral's window is shorter than the call: no window, full static layers
            with_sliding_window(None)(base)
        _compat.set_attn_implementation(base, attn)

    model = build_peft_lm(arch, prepare_base=prepare)
    batch = left_padded_batch([5, 9, 3, 7])
    names = ["a0", "__base__", "a1", "a2"]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=names)
    with torch.no_grad():
        ref = model.generate(**batch, **gen, output_logits=True, return_dict_in_generate=True)
        fastlora.patch(model, decode_attention=True, fuse_rotary=True, cuda_graphs="emulate")
        out = model.generate(**batch, **gen, output_logits=True, return_dict_in_generate=True)
        fastlora.unpatch(model)
    layers = model.config.num_hidden_layers
    # every decode step of both layers took the one kernel; the prefill took the rotary + KV write
    assert one["rotary_attention_update"] >= layers * 5 and writes["rotary_kv_write"] == layers
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")


def test_switched_off_keeps_the_two_kernels(monkeypatch):
    one = count_calls(monkeypatch, static_cache, ["rotary_attention_update"])
    writes = count_calls(monkeypatch, rotary_kv_ops, ["rotary_kv_write"])
    monkeypatch.setattr(attention_forwards, "WITH_ATTENTION", False)
    model = build_peft_lm("llama")
    batch = left_padded_batch([5, 3])
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, adapter_names=["a0", "a1"])
    with torch.no_grad():
        ref = model.generate(**batch, **gen)
        fastlora.patch(model, decode_attention=True, fuse_rotary=True, cuda_graphs="emulate")
        tokens = model.generate(**batch, **gen)
        fastlora.unpatch(model)
    assert one["rotary_attention_update"] == 0 and writes["rotary_kv_write"] >= 2 * 4
    assert torch.equal(tokens, ref)


def test_without_decode_attention_the_step_keeps_the_model_attention(monkeypatch):
    """decode_attention=False: the rotary + KV write kernel, then the model's own sdpa."""
    one = count_calls(monkeypatch, static_cache, ["rotary_attention_update"])
    model = build_peft_lm("llama")
    batch = left_padded_batch([5, 3])
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, adapter_names=["a0", "a1"])
    with torch.no_grad():
        ref = model.generate(**batch, **gen)
        fastlora.patch(model, decode_attention=False, fuse_rotary=True, cuda_graphs="emulate")
        tokens = model.generate(**batch, **gen)
        fastlora.unpatch(model)
    assert one["rotary_attention_update"] == 0
    assert torch.equal(tokens, ref)


def test_the_one_kernel_serves_up_to_three_programs_per_sm():
    from peft_fastlora.ops.decode_attention import NEW_TOKEN_MAX_PER_SM, _sm_count, new_token_fuses

    sms = _sm_count(torch.device("cpu"))
    limit = NEW_TOKEN_MAX_PER_SM * sms
    assert new_token_fuses(1, limit - 1, torch.device("cpu"))
    assert not new_token_fuses(1, limit, torch.device("cpu")) and not new_token_fuses(limit, 2, torch.device("cpu"))
