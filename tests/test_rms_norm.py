"""The one-kernel RMSNorm against transformers' own Llama and Gemma 2 RMSNorms (the interpreter on
CPU)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peft_fastlora.base_ops.install import remove_instance_forwards
from peft_fastlora.base_ops.norm_forwards import install_norms
from peft_fastlora.ops.rms_norm import rms_norm

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
    done, skipped = install_norms(root)
    assert [n for n, _ in done] == ["a", "g"]
    assert skipped == [("OtherGemmaRMSNorm", "OtherGemmaRMSNorm._norm differs from the reference code")]
    x = torch.randn(2, 16)
    with torch.no_grad():
        outs = {k: root[k](x) for k in ("a", "g")}
    remove_instance_forwards(done)
    assert "forward" not in root["a"].__dict__ and "forward" not in root["g"].__dict__
    for k, out in outs.items():
        torch.testing.assert_close(out, root[k](x), atol=1e-6, rtol=1e-5)


def test_gradients_take_the_original_forward():
    norm = LlamaRMSNorm(16)
    done, _ = install_norms(torch.nn.ModuleDict({"n": norm}))
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()  # the kernel has no backward: the original forward must have run
    assert x.grad is not None
    remove_instance_forwards(done)


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
    assert "RMSNorm x5" in str(report)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
