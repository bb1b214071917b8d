"""The one-kernel RMSNorm against transformers' own Llama and Gemma 2 RMSNorms, with and without
the residual add before it, and the decoder layers that use the fused add (the interpreter on CPU)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peft_fastlora.base_ops.layer_forwards import install_decoder_layers
from peft_fastlora.base_ops.norm_forwards import install_norms
from peft_fastlora.ops.rms_norm import add_rms_norm, norm_add, norm_add_norm, rms_norm
from peft_fastlora.instance_methods import InstancePatches

TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 96), (1, 1, 100), (7, 33)])
def test_matches_hf_rms_norm(dtype, shape):
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.5 + 1)
    x = (torch.randn(shape) * 3).to(dtype)
    ref = norm(x)
    out = rms_norm(x, norm.weight, norm.variance_epsilon)
    atol, rtol = TOL[dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 33)])
def test_matches_hf_gemma2_rms_norm(dtype, shape):
    """Gemma's form: (1 + w) and the product in float32, one rounding."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    norm = Gemma2RMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.5)
    x = (torch.randn(shape) * 3).to(dtype)
    ref = norm(x)
    out = rms_norm(x, norm.weight, norm.eps, unit_offset=True)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # the Llama form on the same weight is another function: the flag is what makes it equal
    assert not torch.allclose(rms_norm(x, norm.weight, norm.eps).float(), ref.float(), atol=1e-2)


def test_strided_rows():
    x = torch.randn(4, 130)[:, :64]  # rows 130 apart, last dim contiguous
    w = torch.randn(64)
    ref = LlamaRMSNorm(64)
    ref.weight.data.copy_(w)
    torch.testing.assert_close(rms_norm(x, w, ref.variance_epsilon), ref(x), atol=1e-6, rtol=1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(TypeError, match="dtype"):
        rms_norm(torch.randn(2, 8), torch.randn(8, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(8, 2).T, torch.randn(8), 1e-6)


def test_install_llama_and_gemma_forms_and_undo():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    patches = InstancePatches()

    class OtherGemmaRMSNorm(Gemma2RMSNorm):  # Gemma's forward, another _norm: not the kernel's function
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.eps)

        def forward(self, x):
            output = self._norm(x.float())
            output = output * (1.0 + self.weight.float())
            return output.type_as(x)

    root = torch.nn.ModuleDict({"a": LlamaRMSNorm(16), "g": Gemma2RMSNorm(16), "o": OtherGemmaRMSNorm(16)})
    with torch.no_grad():
        root["g"].weight.normal_()
    done, skipped = install_norms(root, patches)
    assert [n for n, _ in done] == ["a", "g"]
    assert skipped == [("OtherGemmaRMSNorm", "OtherGemmaRMSNorm._norm differs from the reference code")]
    x = torch.randn(2, 16)
    with torch.no_grad():
        outs = {k: root[k](x) for k in ("a", "g")}
    patches.restore()
    assert "forward" not in root["a"].__dict__ and "forward" not in root["g"].__dict__
    for k, out in outs.items():
        torch.testing.assert_close(out, root[k](x), atol=1e-6, rtol=1e-5)


def test_gradients_take_the_original_forward():
    patches = InstancePatches()
    norm = LlamaRMSNorm(16)
    done, _ = install_norms(torch.nn.ModuleDict({"n": norm}), patches)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()  # the kernel has no backward: the original forward must have run
    assert x.grad is not None
    patches.restore()


def test_patch_fuse_norms_matches_peft():
    import peft_fastlora as fastlora
    from peft import LoraConfig, get_peft_model
    from _models import tiny_llama

    base = tiny_llama(0, vocab_size=96, pad_token_id=None)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="x").eval()
    ids = torch.randint(0, 96, (3, 6))
    names = ["x", "__base__", "x"]
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=names).logits
        report = fastlora.patch(model, fuse_norms=True)
        out = model(input_ids=ids, adapter_names=names).logits
        fastlora.unpatch(model)
    assert report.fused_norms == 2 * 2 + 1  # two per layer and the final norm
    assert report.fused_add_norms == 2  # the post-attention norm of each layer takes the residual add
    assert "RMSNorm x5 (2 with the residual add)" in str(report)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


# ---- the residual add fused into the norm ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_matches_add_then_norm(dtype, unit_offset):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(3)
    wide = torch.randn(2, 3, 130, dtype=dtype)
    x = wide[..., :96]  # rows 130 apart, as a slice of a wider GEMM output
    residual = torch.randn(2, 3, 96, dtype=dtype)
    norm = (Gemma2RMSNorm(96) if unit_offset else LlamaRMSNorm(96)).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        want_sum = residual + x  # torch's add rounds to the dtype; the norm reads the rounded sum
        want = norm(want_sum)
    eps = norm.eps if unit_offset else norm.variance_epsilon
    out, summed = add_rms_norm(x, residual, norm.weight, eps, unit_offset=unit_offset)
    assert torch.equal(summed, want_sum) and summed.is_contiguous()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_norm_add_and_norm_add_norm_match_torch(dtype, unit_offset):
    """Gemma 2's sandwich: ``s = residual + norm_a(x)`` and ``norm_b(s)``, against the modules
    (each norm's output rounded to the dtype, the add rounded, the second norm reading the rounded
    sum); strided rows, eps and weights differing between the two norms."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(4)
    wide = torch.randn(2, 3, 130, dtype=dtype) * 3
    x = wide[..., :96]
    residual = torch.randn(2, 3, 96, dtype=dtype)
    make = (lambda eps: Gemma2RMSNorm(96, eps=eps)) if unit_offset else (lambda eps: LlamaRMSNorm(96, eps=eps))
    norm_a, norm_b = make(1e-6).to(dtype), make(1e-5).to(dtype)
    with torch.no_grad():
        for n in (norm_a, norm_b):
            n.weight.normal_()
        want_sum = residual + norm_a(x)
        want = norm_b(want_sum)
    eps = (lambda n: n.eps) if unit_offset else (lambda n: n.variance_epsilon)
    atol, rtol = TOL[dtype]
    summed = norm_add(x, residual, norm_a.weight, eps(norm_a), unit_offset=unit_offset)
    torch.testing.assert_close(summed, want_sum, atol=atol, rtol=rtol)
    out, summed2 = norm_add_norm(x, residual, norm_a.weight, eps(norm_a), norm_b.weight, eps(norm_b),
                                 unit_offset=unit_offset)
    assert torch.equal(summed2, summed) and summed2.is_contiguous()
    torch.testing.assert_close(out, norm_b(summed2), atol=atol, rtol=rtol)  # from the sum it returned
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="weight"):
        norm_add_norm(x, residual, norm_a.weight[:95], 1e-6, norm_b.weight, 1e-6)


def test_add_rms_norm_bad_inputs():
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float16), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(torch.randn(2, 8), torch.randn(8, 2).T, torch.randn(8), 1e-6)


def _layer_inputs(model, ids):
    inner = model.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    return h, dict(position_embeddings=inner.rotary_emb(h, pos), position_ids=pos, attention_mask=None)


def _fused_launches(model):
    """Install the one-kernel norms and decoder layers on ``model`` (2 layers), run its first layer
    and compare it with its own forward before, then remove them and compare again. Returns the
    launches of that run which took a residual, as (norm before the add, norm after it)."""
    patches = InstancePatches()
    ids = torch.randint(0, 64, (2, 5))
    h, kw = _layer_inputs(model, ids)
    layer = model.model.layers[0]
    with torch.no_grad():
        want = layer(h, **kw)
        norms, _ = install_norms(model, patches)
        layers, skipped = install_decoder_layers(model, patches)
        assert [n for n, _ in layers] == ["model.layers.0", "model.layers.1"] and skipped == []
        calls = []
        original = add_rms_norm.__globals__["_launch"]

        def counted(*a, **k):
            if a[1] is not None:
                calls.append((k.get("pre") is not None, k.get("post", True)))
            return original(*a, **k)

        add_rms_norm.__globals__["_launch"] = counted
        try:
            got = layer(h, **kw)
        finally:
            add_rms_norm.__globals__["_launch"] = original
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        patches.restore()
        assert "forward" not in layer.__dict__
        torch.testing.assert_close(layer(h, **kw), want, atol=0, rtol=0)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_decoder_layers_with_the_fused_add_match_and_undo(arch):
    import transformers

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    conf, lm = (getattr(transformers, n) for n in classes[arch])
    torch.manual_seed(0)
    model = lm(conf(**cfg)).eval()
    # one launch took the residual add: the post-attention norm (the last add stays torch's)
    assert _fused_launches(model) == [(False, True)]


def test_gemma2_layers_fuse_their_sandwich_norms_and_undo():
    """Gemma 2's layers: the post-attention norm, add and pre-feedforward norm in one launch, the
    post-feedforward norm and add in another; the layer's output as before, then its own forward
    back after removal."""
    from _models import build_causal_lm

    assert _fused_launches(build_causal_lm("gemma2")) == [(True, True), (True, False)]


def test_layers_whose_norm_or_forward_differ_keep_theirs():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from _models import tiny_llama

    patches = InstancePatches()

    class ScaledLayer(LlamaDecoderLayer):  # adds the attention output twice: not the reference
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                              position_ids=position_ids, past_key_values=past_key_values,
                                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            hidden_states = residual + 2 * hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            return residual + hidden_states

    model = tiny_llama(0, vocab_size=64, pad_token_id=None)
    changed = model.model.layers[0]
    changed.__class__ = ScaledLayer
    norms, _ = install_norms(model, patches)
    del model.model.layers[1].post_attention_layernorm.forward  # its own norm again: not the fused form
    layers, skipped = install_decoder_layers(model, patches)
    assert layers == []
    assert skipped == [("ScaledLayer", "ScaledLayer.forward differs from the reference code")]
    patches.restore()


def test_fused_layer_with_gradients_takes_the_original_forward():
    from _models import tiny_llama

    patches = InstancePatches()
    model = tiny_llama(0, vocab_size=64, pad_token_id=None)
    norms, _ = install_norms(model, patches)
    layers, _ = install_decoder_layers(model, patches)
    ids = torch.randint(0, 64, (2, 5))
    h, kw = _layer_inputs(model, ids)
    model.model.layers[0](h.detach().requires_grad_(), **kw).sum().backward()  # no backward in the kernel
    patches.restore()
