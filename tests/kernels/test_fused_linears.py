"""q/k/v and gate/up siblings without LoRA in one GEMM (``base_ops.fused_linears``), on the CPU.

``patch`` installs them on CUDA only; here ``install_base_ops`` is asked for them as on CUDA (every
other base op off), on CPU tensors, which the fused GEMM serves the same way."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from peft_fastlora.base_ops import install_base_ops
from peft_fastlora.base_ops.fused_linears import install_fused_linears
from peft_fastlora.options import PatchOptions
from peft_fastlora.instance_methods import InstancePatches

from _models import tiny_llama

ONLY_FUSE = PatchOptions(decode_attention=False, fuse_norms=False, fuse_rotary=False, fuse_silu_mul=False,
                         cuda_graphs=False)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_plain_model_siblings_share_one_gemm_and_equal_the_model():
    model = tiny_llama(3)
    ids = torch.randint(3, 100, (3, 9))
    ref = _logits(model, ids)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    ops = install_base_ops(model, ONLY_FUSE, torch.device("cuda"))
    layers = model.config.num_hidden_layers
    assert len(ops.fused_groups) == 2 * layers and ops.count("fuse_base") == 5 * layers
    attn = model.model.layers[0].self_attn
    # one storage, the parameters views of it: no second copy of the weights
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.numel() * 4
    calls = []
    original = torch.nn.functional.linear
    torch.nn.functional.linear = lambda *a, **k: calls.append(a[1].shape) or original(*a, **k)
    try:
        out = _logits(model, ids)
    finally:
        torch.nn.functional.linear = original
    # per layer: q/k/v one GEMM, o, gate/up one GEMM, down; then the LM head
    assert len(calls) == 4 * layers + 1, calls
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(keys)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    ops.remove(model)
    # own storages again (two small clones may well lie side by side: compare storages, not addresses)
    assert attn.k_proj.weight.untyped_storage().data_ptr() != attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.q_proj.weight.untyped_storage().nbytes() == attn.q_proj.weight.numel() * 4
    assert "forward" not in attn.q_proj.__dict__
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)


def test_a_sibling_called_with_another_input_runs_its_own_gemm():
    patches = InstancePatches()
    model = tiny_llama(4)
    _, _, groups = install_fused_linears(model, patches)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, attn.q_proj.in_features), torch.randn(2, 5, attn.q_proj.in_features)
    with torch.no_grad():
        q = attn.q_proj(x)
        k_other = attn.k_proj(y)  # not the input q was computed for: k of y, not the kept k of x
        k, v = attn.k_proj(x), attn.v_proj(x)
        k_again = attn.k_proj(x)  # taken once: a second call computes it again
    for out, w, inp in ((q, attn.q_proj.weight, x), (k_other, attn.k_proj.weight, y), (k, attn.k_proj.weight, x),
                        (v, attn.v_proj.weight, x), (k_again, attn.k_proj.weight, x)):
        torch.testing.assert_close(out, inp @ w.T, rtol=1e-5, atol=1e-5)
    for g in groups:
        g.remove()


def test_gradients_and_training_use_the_members_own_forward():
    model = tiny_llama(5)
    ops = install_base_ops(model, ONLY_FUSE, torch.device("cuda"))
    ids = torch.randint(3, 100, (2, 7))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    attn = model.model.layers[0].self_attn
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    assert attn.k_proj.weight.grad is not None and attn.k_proj.weight.grad.abs().sum() > 0
    ops.remove(model)


def test_a_model_moved_after_fusing_falls_back_to_its_own_weights():
    model = tiny_llama(6)
    ids = torch.randint(3, 100, (2, 6))
    ops = install_base_ops(model, ONLY_FUSE, torch.device("cuda"))
    model.to(torch.float64)  # new storages: the group is no longer intact
    ref = _logits(model, ids)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        x = torch.randn(1, 3, attn.q_proj.in_features, dtype=torch.float64)
        attn.q_proj(x)
        torch.testing.assert_close(attn.k_proj(x), x @ attn.k_proj.weight.T)
    assert ref.dtype == torch.float64
    ops.remove(model)


def test_lora_siblings_are_left_to_their_site_and_the_rest_fused():
    """A PEFT model whose adapter targets q/v only: q/k/v has LoRA members (the LoRA site's group),
    gate/up has none (fused here)."""
    patches = InstancePatches()
    model = get_peft_model(tiny_llama(7), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    done, skipped, groups = install_fused_linears(model, patches)
    layers = model.config.num_hidden_layers
    assert [g.group.kind for g in groups] == ["gate_up"] * layers and not skipped
    for g in groups:
        g.remove()


def test_fuse_false_and_cpu_leave_the_siblings_alone():
    model = tiny_llama(8)
    ops = install_base_ops(model, PatchOptions(fuse=False, cuda_graphs=False), torch.device("cuda"))
    assert ops.off["fuse_base"] == "fuse=False" and not ops.fused_groups
    ops.remove(model)
    ops = install_base_ops(model, PatchOptions(cuda_graphs=False, decode_attention=False), torch.device("cpu"))
    assert ops.off["fuse_base"] == "the model is not on CUDA" and not ops.fused_groups
    ops.remove(model)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "mistral"])
def test_other_families_fused_siblings_equal_the_model(arch):
    """Qwen2's q/k/v biases go with the fused weight; Gemma 2's and Mistral's siblings fuse alike."""
    from _models import build_causal_lm

    model = build_causal_lm(arch, seed=2)
    ids = torch.randint(3, 100, (2, 11))
    ref = _logits(model, ids)
    ops = install_base_ops(model, ONLY_FUSE, torch.device("cuda"))
    assert len(ops.fused_groups) == 2 * model.config.num_hidden_layers
    if arch == "qwen2":
        assert all(g.group.bias is not None for g in ops.fused_groups if g.group.kind == "qkv")
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    ops.remove(model)


def test_save_pretrained_while_fused_reloads_the_same_weights(tmp_path):
    """The parameters are views of one fused tensor: saving writes each under its own name and
    a reload gives the same weights."""
    from transformers import LlamaForCausalLM

    model = tiny_llama(9)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ops = install_base_ops(model, ONLY_FUSE, torch.device("cuda"))
    model.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert set(again) == set(ref) and all(torch.equal(again[k], v) for k, v in ref.items())
    ops.remove(model)
