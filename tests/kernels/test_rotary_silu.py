"""Rotary and gated act-mul (SiLU, GELU-tanh) kernels against torch's formulas (the interpreter on CPU), and their
installation on model instances: which models get them, that unpatch removes them, that other
instances and the classes stay untouched, and that a patched model still equals PEFT."""

import importlib

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.base_ops.mlp_forwards import install_gated_mlps
rotary_ops = importlib.import_module("peft_fastlora.ops.rotary")  # the modules, not the launchers
silu_ops = importlib.import_module("peft_fastlora.ops.silu_mul")  # that ops/__init__ exports
from peft_fastlora.ops.rotary import apply_rotary, apply_rotary_reference
from peft_fastlora.ops.silu_mul import act_mul, act_mul_reference, silu_mul, silu_mul_reference
from peft_fastlora.base_ops.rotary_forwards import install_rotary, rebind_global
from peft_fastlora.instance_methods import InstancePatches

from _helpers import count_calls
from _models import build_causal_lm, build_peft_lm, left_padded_batch

# rotary: each op rounded like torch's, so the kernel reproduces the formula bit for bit.
# SiLU: exp differs by an ulp between implementations; fp16 output rounding hides it mostly.
SILU_TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (1e-3, 1e-3)}
# GELU-tanh on the interpreter: tanh from exp against torch's CPU tanh; where 1 + tanh cancels
# (x below about -4) both are a few fp32 ulps of 1 apart, so fp32 takes an absolute 1e-5 there
# (the GPU test holds libdevice's tanhf to torch's CUDA kernel within a bf16 rounding)
GELU_TOL = {torch.float32: (1e-5, 2e-6), torch.float16: (1e-3, 1e-3)}
DTYPES = [torch.float32, torch.float16]


def rope_inputs(bsz, heads, kv_heads, seq, dim, dtype, cos_batch=None, fused=True):
    """q / k as views of one fused projection output (the layout the attention modules pass)."""
    if fused:
        out = torch.randn(bsz, seq, (heads + 2 * kv_heads) * dim).to(dtype)
        q = out[..., : heads * dim].view(bsz, seq, heads, dim).transpose(1, 2)
        k = out[..., heads * dim: (heads + kv_heads) * dim].view(bsz, seq, kv_heads, dim).transpose(1, 2)
    else:
        q = torch.randn(bsz, heads, seq, dim).to(dtype)
        k = torch.randn(bsz, kv_heads, seq, dim).to(dtype)
    nb = bsz if cos_batch is None else cos_batch
    pos = torch.arange(seq)[None] + torch.randint(0, 50, (nb, 1))  # rows at different positions
    freqs = pos[..., None].float() / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


# ---- kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [
    (3, 4, 2, 1, 16),   # decode step, GQA
    (2, 5, 5, 7, 12),   # prefill, odd head count, half dim 6 (not a power of two)
    (1, 17, 1, 3, 8),   # more heads than one block, MQA
    (4, 2, 1, 1, 2),    # the smallest head dim
])
def test_rotary_equals_formula(dtype, shape):
    q, k, cos, sin = rope_inputs(*shape, dtype)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    torch.testing.assert_close(q_out, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_ref, atol=0, rtol=0)


def test_rotary_broadcast_cos_and_contiguous_inputs():
    q, k, cos, sin = rope_inputs(3, 4, 2, 5, 8, torch.float32, cos_batch=1, fused=False)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_ref, atol=0, rtol=0)


def test_rotary_leaves_inputs_alone():
    q, k, cos, sin = rope_inputs(2, 4, 2, 1, 8, torch.float32)
    before = q.clone(), k.clone()
    apply_rotary(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_rotary_bad_inputs():
    q, k, cos, sin = rope_inputs(2, 4, 2, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="cos / sin"):
        apply_rotary(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="must be"):
        apply_rotary(q, k[:1], cos, sin)
    with pytest.raises(TypeError, match="dtype"):
        apply_rotary(q, k, cos.half(), sin.half())
    q7, k7, c7, s7 = rope_inputs(1, 2, 1, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="odd"):
        apply_rotary(q7[..., :7], k7[..., :7], c7[..., :7], s7[..., :7])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1), (5, 33), (3, 1500), (2, 2048)])
def test_silu_mul_equals_torch(dtype, rows, n):
    fused = (torch.randn(rows, 2 * n) * 4).to(dtype)
    gate, up = fused[:, :n], fused[:, n:]  # strided views, as the fused gate/up GEMM gives them
    atol, rtol = SILU_TOL[dtype]
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_reference(gate, up), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1), (5, 33), (2, 2048)])
def test_gelu_tanh_mul_equals_torch(dtype, rows, n):
    """torch's ``gelu(approximate="tanh")`` (tanhf) against the kernel's ``x * sigmoid(2z)``: the
    same function, an ulp apart in fp32; inputs past +-10 check both tails (no overflow to NaN)."""
    fused = (torch.randn(rows, 2 * n) * 4).to(dtype)
    fused[0, 0] = 60.0
    fused[-1, min(1, n - 1)] = -60.0
    gate, up = fused[:, :n], fused[:, n:]
    atol, rtol = GELU_TOL[dtype]
    got, want = act_mul(gate, up, "gelu_tanh"), act_mul_reference(gate, up, "gelu_tanh")
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if n > 1:  # and not SiLU's values (the flag reaches the kernel)
        assert not torch.allclose(got, act_mul_reference(gate, up, "silu"), atol=atol, rtol=rtol)


def test_silu_mul_3d_and_bad_inputs():
    gate, up = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_reference(gate, up), atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="differ"):
        silu_mul(gate, up[..., :9])
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(gate.transpose(0, 2), up.transpose(0, 2))
    with pytest.raises(ValueError, match="unknown gated activation 'relu'"):
        act_mul(gate, up, "relu")


# ---- installation -------------------------------------------------------------------------------
def _helper(x):
    return x + 1


def test_rebind_keeps_decorators_and_changes_only_the_copy():
    import functools

    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return fn(*args, **kwargs) * 10
        return wrapped

    @deco
    def f(x):
        return _helper(x)

    g = rebind_global(f, "_helper", lambda x: x + 2)
    assert f(1) == 20 and g(1) == 30  # the wrapper kept, the global swapped in the copy only
    assert _helper(1) == 2
    assert rebind_global(f, "not_used", None) is None


@pytest.mark.parametrize("arch,expected,skipped", [
    ("llama", 2, []), ("qwen3", 2, []), ("mistral", 2, []), ("gemma2", 2, []),
    ("phi3", 0, [("Phi3Attention", "transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb differs "
                                   "from the reference code")]),  # partial rotary
    ("gpt2", 0, [])])  # no rotary at all
def test_rotary_installed_only_where_the_code_matches(arch, expected, skipped):
    patches = InstancePatches()
    model = build_causal_lm(arch)
    other = build_causal_lm(arch)
    done, why = install_rotary(model, patches)
    assert len(done) == expected and why == skipped
    assert all("forward" not in m.__dict__ for m in other.modules())
    patches.restore()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("arch,expected,skipped", [
    ("llama", 2, []), ("qwen2", 2, []), ("gemma2", 2, []),
    ("gemma2_python_gelu", 0, [("Gemma2MLP", "activation GELUTanh is neither SiLU nor torch's GELU-tanh")]),
    ("phi3", 0, [])])  # a pre-fused gate_up_proj: not a gate/up/down MLP
def test_act_mlp_installed_only_for_silu_or_gelu_tanh_gated_llama_mlps(arch, expected, skipped):
    from transformers.activations import GELUTanh

    patches = InstancePatches()
    model = build_causal_lm(arch.replace("_python_gelu", ""))
    if arch.endswith("_python_gelu"):  # transformers' Python formula: other roundings, left alone
        for layer in model.model.layers:
            layer.mlp.act_fn = GELUTanh(use_gelu_tanh_python=True)
    done, why = install_gated_mlps(model, patches)
    assert len(done) == expected and why == skipped
    patches.restore()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_gradients_take_torch_ops():
    patches = InstancePatches()
    model = build_causal_lm("llama").train()
    install_rotary(model, patches), install_gated_mlps(model, patches)
    ids = torch.randint(3, 100, (2, 5))
    model(input_ids=ids, labels=ids).loss.backward()  # the kernels have no backward
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    patches.restore()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_patched_model_equals_peft_with_all_small_ops(arch, monkeypatch):
    rotary_calls = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.rotary_forwards"), ["apply_rotary"])
    # Llama's forward takes the rotary and the KV write as one kernel on fastlora's caches
    rotary_kv_calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.decode.static_cache"),
                                  ["rotary_kv_write"])
    silu_calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.mlp_forwards"), ["act_mul"])
    model = build_peft_lm(arch)
    batch = left_padded_batch([5, 9, 3, 7])
    names = ["a0", "__base__", "a1", "a2"]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=names)
    with torch.no_grad():
        ref_logits = model(**batch, adapter_names=names).logits
        ref_tokens = model.generate(**batch, **gen)
        report = fastlora.patch(model, fuse_norms=True, fuse_rotary=True, fuse_silu_mul=True,
                                cuda_graphs="emulate")
        logits = model(**batch, adapter_names=names).logits
        tokens = model.generate(**batch, **gen)
        fastlora.unpatch(model)
        after = model(**batch, adapter_names=names).logits
    assert report.fused_rotary == 2 and report.fused_mlps == 2
    with_kv = " (2 with the KV write)" if arch == "llama" else ""  # (test_rotary_kv.py)
    assert f"rotary x2{with_kv}, cos/sin from a table in graphs x1, act-mul x2" in str(report)
    rotations = rotary_calls["apply_rotary"] + rotary_kv_calls["rotary_kv_write"]
    assert rotations >= 2 * 7 and silu_calls["act_mul"] >= 2 * 7  # prefill and every step
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(after, ref_logits, atol=0, rtol=0)
    assert all("forward" not in m.__dict__ for m in model.modules() if not hasattr(m, "lora_A"))


def test_options_off_and_validated():
    model = build_peft_lm("llama")
    report = fastlora.patch(model, fuse_rotary=False, fuse_silu_mul=False, fuse_norms=False)
    assert report.fused_rotary == report.fused_mlps == report.fused_norms == 0
    fastlora.unpatch(model)
    with pytest.raises(ValueError, match="fuse_rotary"):
        fastlora.patch(model, fuse_rotary="yes")
    with pytest.raises(ValueError, match="fuse_silu_mul"):
        fastlora.patch(model, fuse_silu_mul=1.5)
