"""The one way fastlora recognises model code (``base_ops/match.py``), on every supported
architecture and on copies of the reference code: reformatted copies still match, copies that
compute something else do not, and the reason reaches the patch report and the log."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import textwrap

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.base_ops import norm_forwards
from peft_fastlora.base_ops.match import code_shape, mismatch
from peft_fastlora.base_ops.mlp_forwards import install_gated_mlps
from peft_fastlora.base_ops.norm_forwards import install_norms
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from peft_fastlora.base_ops.rotary_forwards import install_rotary
from peft_fastlora.instance_methods import InstancePatches

from _models import ARCHS, build_causal_lm, build_peft_lm

# per architecture (2 layers): (norms, rotary attentions, SiLU / GELU-tanh MLPs) given one-kernel forwards,
# and the classes left as they are, with the reason
EXPECTED = {
    "llama": ((5, 2, 2), []),
    "mistral": ((5, 2, 2), []),
    "qwen2": ((5, 2, 2), []),
    "qwen3": ((9, 2, 2), []),  # q_norm / k_norm too
    "gemma2": ((9, 2, 2), []),  # (1 + w) norms: 4 a layer; GELU-tanh MLPs
    "phi3": ((5, 0, 0), [("Phi3Attention", "transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb "
                                           "differs from the reference code")]),  # partial rotary
    "gpt2": ((0, 0, 0), []),  # LayerNorm, learned positions, GELU MLP: no candidates
}


def test_every_supported_architecture_is_covered():
    assert sorted(EXPECTED) == sorted(ARCHS)


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_what_matches_on_each_architecture(arch):
    patches = InstancePatches()
    model = build_causal_lm(arch)
    counts, skipped, done_all = [], [], []
    for install in (install_norms, install_rotary, install_gated_mlps):
        done, why = install(model, patches)
        counts.append(len(done))
        skipped.extend(why)
        done_all.extend(done)
    assert (tuple(counts), skipped) == EXPECTED[arch]
    patches.restore()
    assert not any("forward" in m.__dict__ for m in model.modules())


# transformers' own Llama RMSNorm forward, and a copy that computes something else
LLAMA_FORWARD = textwrap.dedent(inspect.getsource(LlamaRMSNorm.forward))
CHANGED = LLAMA_FORWARD.replace("variance + self.variance_epsilon", "variance + 2 * self.variance_epsilon")
REFORMATTED = '''
@some_decorator
def forward(self, hidden_states: "torch.Tensor") -> "torch.Tensor":
    """A docstring, comments and another layout: the same code."""
    input_dtype = hidden_states.dtype  # remember
    hidden_states = hidden_states.to(
        torch.float32
    )
    variance = hidden_states.pow(2).mean(-1,
                                         keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''


def _load(tmp_path, name, source):
    """A real module (its functions have source on disk, as transformers' do)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _norm_class(tmp_path, name, forward_source):
    body = textwrap.indent(textwrap.dedent(forward_source), "    ")
    module = _load(tmp_path, name, f'''
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

def some_decorator(fn):
    return fn

class {name}(LlamaRMSNorm):
{body}
''')
    return getattr(module, name)


def test_reformatted_code_matches_and_changed_code_does_not(tmp_path):
    patches = InstancePatches()
    assert CHANGED != LLAMA_FORWARD  # the premise: the copy is altered
    ref = norm_forwards._REFERENCE
    assert code_shape(LlamaRMSNorm.forward) == ref
    Reformatted = _norm_class(tmp_path, "ReformattedRMSNorm", REFORMATTED)
    Changed = _norm_class(tmp_path, "ChangedRMSNorm", CHANGED)
    assert code_shape(Reformatted.forward) == ref
    assert mismatch(Changed.forward, ref, "ChangedRMSNorm.forward") == \
        "ChangedRMSNorm.forward differs from the reference code"
    root = torch.nn.ModuleDict({"same": Reformatted(16), "other": Changed(16)})
    done, skipped = install_norms(root, patches)
    assert [n for n, _ in done] == ["same"]
    assert skipped == [("ChangedRMSNorm", "ChangedRMSNorm.forward differs from the reference code")]


ROTARY_MODULE = '''
import torch
from torch import nn


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Reformatted, with a docstring."""
    cos = cos.unsqueeze(unsqueeze_dim); sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * SIGN * sin)
    k_embed = (k * cos) + (rotate_half(k) * SIGN * sin)
    return q_embed, k_embed


class Attention(nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
'''


@pytest.mark.parametrize("sign,matches", [("", True), ("-1", False)])
def test_rotary_copies(tmp_path, sign, matches):
    # "rotate_half(q) * SIGN * sin": with SIGN empty the code is Llama's, with -1 it is not
    patches = InstancePatches()
    source = ROTARY_MODULE.replace("SIGN * ", f"{sign} * " if sign else "")
    module = _load(tmp_path, f"rotary_{'same' if matches else 'changed'}", source)
    done, skipped = install_rotary(torch.nn.ModuleDict({"attn": module.Attention()}), patches)
    assert len(done) == int(matches)
    assert skipped == ([] if matches else
                       [("Attention", f"{module.__name__}.apply_rotary_pos_emb differs from the reference code")])


@pytest.mark.parametrize("sign,matches", [("", True), ("-1", False)])
def test_rotary_made_a_module_by_the_kernels_package(tmp_path, sign, matches):
    """transformers >= 5.25 decorates ``apply_rotary_pos_emb`` with the ``kernels`` package's
    ``use_kernel_forward_from_hub``, which makes the module-level name an ``nn.Module`` instance:
    the code behind it is still read, and the one-kernel rotary still computes the same."""
    pytest.importorskip("kernels")
    patches = InstancePatches()
    source = ROTARY_MODULE.replace("SIGN * ", f"{sign} * " if sign else "").replace(
        "\n\ndef apply_rotary_pos_emb", "\n\nfrom kernels import use_kernel_forward_from_hub\n\n\n"
        "@use_kernel_forward_from_hub('rotary_pos_emb')\ndef apply_rotary_pos_emb")
    module = _load(tmp_path, f"hub_rotary_{'same' if matches else 'changed'}", source)
    assert isinstance(module.apply_rotary_pos_emb, torch.nn.Module)  # the premise
    attn = module.Attention()
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    want = attn(q, k, cos, sin)
    done, skipped = install_rotary(torch.nn.ModuleDict({"attn": attn}), patches)
    assert len(done) == int(matches)
    assert skipped == ([] if matches else
                       [("Attention", f"{module.__name__}.apply_rotary_pos_emb differs from the reference code")])
    for got, ref in zip(attn(q, k, cos, sin), want):
        torch.testing.assert_close(got, ref)


def test_mlp_copies(tmp_path):
    patches = InstancePatches()
    module = _load(tmp_path, "mlps", '''
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        # another layout, the same code
        down_proj = self.down_proj(
            self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class ScaledMLP(MLP):
    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)
        return down_proj
''')
    done, skipped = install_gated_mlps(torch.nn.ModuleDict({"a": module.MLP(), "b": module.ScaledMLP()}), patches)
    assert [n for n, _ in done] == ["a"]
    assert skipped == [("ScaledMLP", "ScaledMLP.forward differs from the reference code")]


def test_a_mismatch_reaches_the_report_and_the_log(tmp_path, caplog):
    Changed = _norm_class(tmp_path, "ChangedRMSNorm2", CHANGED)
    model = build_peft_lm("llama")
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.__class__ = Changed
    with caplog.at_level(logging.INFO, logger="peft_fastlora"):
        report = fastlora.patch(model, fuse_norms=True)
    fastlora.unpatch(model)
    why = "ChangedRMSNorm2.forward differs from the reference code"
    assert report.fused_norms == 0 and report.base_ops_skipped == [("fuse_norms", "ChangedRMSNorm2", why)]
    assert any(why in r.getMessage() for r in caplog.records)
