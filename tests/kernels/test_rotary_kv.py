"""Rotary and the KV-cache write in one kernel (``ops/rotary_kv.py``, the interpreter on CPU) against
the two kernels it replaces, bit for bit; and the Llama-family attention forwards that launch it on
fastlora's static caches (``base_ops/attention_forwards.py``): which classes get them, that the
calls take the one kernel, and that a patched model still equals PEFT."""

import importlib

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.base_ops.attention_forwards import attention_form
from peft_fastlora.base_ops.rotary_forwards import install_rotary
from peft_fastlora.ops.kv_cache import kv_cache_write
from peft_fastlora.ops.rotary import apply_rotary
from peft_fastlora.ops.rotary_kv import rotary_kv_write
from peft_fastlora.instance_methods import InstancePatches

from _helpers import count_calls
from _models import build_causal_lm, build_peft_lm, left_padded_batch, with_sliding_window
from test_rotary_silu import rope_inputs

rotary_kv_ops = importlib.import_module("peft_fastlora.ops.rotary_kv")
rotary_ops = importlib.import_module("peft_fastlora.ops.rotary")
kv_ops = importlib.import_module("peft_fastlora.ops.kv_cache")


def _states(bsz, heads, kv_heads, seq, dim, dtype, cache_rows, max_len, start, cos_batch=None):
    q, k, cos, sin = rope_inputs(bsz, heads, kv_heads, seq, dim, dtype, cos_batch=cos_batch)
    # v a strided view too, as the fused projection gives it
    v = torch.randn(bsz, seq, kv_heads, dim + 3).to(dtype)[..., :dim].transpose(1, 2)
    caches = [torch.randn(cache_rows, kv_heads, max_len, dim).to(dtype) for _ in range(2)]
    return q, k, v, cos, sin, caches, torch.tensor([start])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bsz,heads,kv_heads,seq,dim,cache_rows,max_len,start,cos_batch", [
    (3, 8, 2, 1, 16, 4, 12, 5, None),  # a decode step into a cache with a padding row
    (2, 5, 5, 7, 12, 2, 20, 0, 1),  # a prefill, odd head count, half dim 6, one cos row for all
    (1, 17, 1, 3, 8, 1, 9, 7, None),  # more heads than a block; the last position falls past the cache
    (2, 4, 2, 1, 8, 2, 6, 6, None),  # a full cache: nothing written, q still rotated
])
@pytest.mark.parametrize("ticket", [True, False])
def test_one_kernel_equals_the_two(dtype, bsz, heads, kv_heads, seq, dim, cache_rows, max_len, start,
                                   cos_batch, ticket):
    q, k, v, cos, sin, (kc, vc), length = _states(bsz, heads, kv_heads, seq, dim, dtype, cache_rows, max_len,
                                                  start, cos_batch)
    kc2, vc2, length2 = kc.clone(), vc.clone(), length.clone()
    t1 = torch.zeros(1, dtype=torch.int32) if ticket else None
    t2 = torch.zeros(1, dtype=torch.int32) if ticket else None
    q_two, k_two = apply_rotary(q, k, cos, sin)
    kv_cache_write(k_two, v, kc, vc, length, ticket=t1)
    q_one = rotary_kv_write(q, k, v, cos, sin, kc2, vc2, length2, ticket=t2)
    assert torch.equal(q_one, q_two) and q_one.is_contiguous()
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert int(length2) == int(length) == start + (seq if ticket else 0)
    assert t2 is None or int(t2) == 0
    # the written slots hold the rotated keys and the values (the check is not vacuous)
    stop = min(start + seq, max_len)
    if stop > start:
        assert torch.equal(kc2[:bsz, :, start:stop], k_two[:, :, : stop - start])
        assert torch.equal(vc2[:bsz, :, start:stop], v[:, :, : stop - start])


def test_bad_inputs_are_refused():
    q, k, v, cos, sin, (kc, vc), length = _states(2, 4, 2, 1, 8, torch.float32, 2, 6, 0)
    with pytest.raises(ValueError, match="cos / sin"):
        rotary_kv_write(q, k, v, cos[:, :, :4], sin[:, :, :4], kc, vc, length)
    with pytest.raises(ValueError, match="cannot hold"):
        rotary_kv_write(q, k, v, cos, sin, kc[:1], vc[:1], length)
    with pytest.raises(ValueError, match="one \\(B, H, S, D\\) shape"):
        rotary_kv_write(q, k, v[:, :1], cos, sin, kc, vc, length)
    with pytest.raises(TypeError, match="one dtype"):
        rotary_kv_write(q, k, v, cos, sin, kc.half(), vc.half(), length)
    with pytest.raises(ValueError, match="ticket"):
        rotary_kv_write(q, k, v, cos, sin, kc, vc, length, ticket=torch.zeros(1))


# ---- the attention forwards ----------------------------------------------------------------------
@pytest.mark.parametrize("arch,with_kv", [("llama", 2), ("mistral", 2), ("qwen2", 2),
                                          ("qwen3", 0), ("gemma2", 0)])
def test_the_forward_with_the_kv_write_only_where_the_code_matches(arch, with_kv):
    """Qwen3 (q/k norms) and Gemma 2 (soft-capping) keep the forward with the one-kernel rotary."""
    patches = InstancePatches()
    model = build_causal_lm(arch)
    fused = []
    done, why = install_rotary(model, patches, fused)
    assert len(done) == 2 and why == [] and len(fused) == with_kv
    attn = model.model.layers[0].self_attn
    assert (attention_form(type(attn).forward) is not None) == bool(with_kv)
    assert (attn.forward.__func__.__name__ == "fused_rotary_kv_forward") == bool(with_kv)
    patches.restore()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_calls_the_kernel_does_not_take_run_the_original_code(monkeypatch):
    """No cache, another cache class, a positional cache, transformers' old cache name (5.24's
    decorator renames it): each call runs the class's code (with the one-kernel rotary) and gives
    its output; none launches the one kernel."""
    from transformers import DynamicCache

    patches = InstancePatches()
    one = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"), ["rotary_kv_write"])
    model = build_causal_lm("llama")
    attn = model.model.layers[0].self_attn
    done, _ = install_rotary(model, patches, [])
    torch.manual_seed(0)
    x = torch.randn(2, 3, model.config.hidden_size)
    pe = model.model.rotary_emb(x, torch.arange(3)[None].expand(2, 3))
    name = attention_form(type(attn).forward).cache

    def both(*args, **kwargs):
        fast = attn(x, pe, None, *args, **kwargs)[0]
        kwargs = {k: (DynamicCache(config=model.config) if isinstance(v, DynamicCache) else v) for k, v in kwargs.items()}
        args = [DynamicCache(config=model.config) if isinstance(v, DynamicCache) else v for v in args]
        ref = type(attn).forward(attn, x, pe, None, *args, **kwargs)[0]
        torch.testing.assert_close(fast, ref, atol=0, rtol=0)

    both()
    both(**{name: DynamicCache(config=model.config)})
    both(DynamicCache(config=model.config))
    if name == "cache":  # the old name, which transformers' decorator still takes
        both(past_key_values=DynamicCache(config=model.config))
    assert one["rotary_kv_write"] == 0
    patches.restore()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_patched_model_takes_the_one_kernel_and_equals_peft(arch, monkeypatch):
    one = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"), ["rotary_kv_write"])
    two = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.rotary_forwards"), ["apply_rotary"])
    writes = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.decode.static_cache"), ["kv_cache_write"])
    # the tiny Mistral's window is shorter than the call: without one its layers are full static ones
    model = build_peft_lm(arch, prepare_base=with_sliding_window(None) if arch == "mistral" else None)
    batch = left_padded_batch([5, 9, 3, 7])
    names = ["a0", "__base__", "a1", "a2"]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=names)
    with torch.no_grad():
        ref_tokens = model.generate(**batch, **gen)
        report = fastlora.patch(model, fuse_norms=True, fuse_rotary=True, fuse_silu_mul=True, cuda_graphs="emulate")
        tokens = model.generate(**batch, **gen)
        logits = model(**batch, adapter_names=names).logits  # no cache: the one-kernel rotary alone
        fastlora.unpatch(model)
        ref_logits = model(**batch, adapter_names=names).logits
    assert report.fused_rotary == 2 and report.fused_rotary_kv == 2 and "rotary x2 (2 with the KV write)" in str(report)
    # the prefill and every graphed step write the cache through the one kernel (the emulated
    # capture and replays count too), never through the rotary and the write apart
    assert one["rotary_kv_write"] >= 2 * 6 and writes["kv_cache_write"] == 0
    assert two["apply_rotary"] == 2  # the forward without a cache
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert all("forward" not in m.__dict__ for m in model.modules() if not hasattr(m, "lora_A"))


def test_base_model_with_q_k_v_in_one_gemm(monkeypatch):
    """A model without adapters: its q/k/v siblings share one GEMM (the first member's call
    computes all three), so the forward must call q, k, v in the template's order."""
    one = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"), ["rotary_kv_write"])
    model = build_causal_lm("llama")
    batch = left_padded_batch([5, 9, 3])
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(**batch, **gen)
        # (on the CPU the siblings share a GEMM only with the streaming kernel, under the interpreter)
        report = fastlora.patch(model, fuse=True, stream_gemm=True, fuse_rotary=True, cuda_graphs="emulate")
        tokens = model.generate(**batch, **gen)
        fastlora.unpatch(model)
    assert report.fused_base_groups >= 2 and report.fused_rotary_kv == 2, report
    assert one["rotary_kv_write"] >= 2 * 5
    assert torch.equal(tokens, ref)


def test_fuse_kv_write_off_keeps_the_two_kernels(monkeypatch):
    one = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"), ["rotary_kv_write"])
    two = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.rotary_forwards"), ["apply_rotary"])
    model = build_peft_lm("llama")
    batch = left_padded_batch([5, 3])
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, adapter_names=["a0", "a1"])
    with torch.no_grad():
        ref = model.generate(**batch, **gen)
        fastlora.patch(model, fuse_rotary=True, fuse_kv_write=False, cuda_graphs="emulate")
        tokens = model.generate(**batch, **gen)
        fastlora.unpatch(model)
    assert one["rotary_kv_write"] == 0 and two["apply_rotary"] >= 2 * 4
    assert torch.equal(tokens, ref)
