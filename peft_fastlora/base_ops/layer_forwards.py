"""Llama-family decoder layers whose ``residual + attention output`` and post-attention RMSNorm
are one Triton launch (``ops.add_rms_norm``), on this model instance only; and Gemma 2's, whose
sandwich norms take two: the post-attention norm, the add and the pre-feedforward norm in one
(``ops.norm_add_norm``), the post-feedforward norm and the add in another (``ops.norm_add``).

A layer is changed only when its class's ``forward`` computes what the Llama family's does
(``match.py``: Llama, Mistral, Qwen2, Qwen3, ...; transformers names the cache argument
``past_key_values`` before 5.2x and ``cache`` after, and both forms are recognised) and its
post-attention norm runs the one-kernel forward (``norm_forwards``). The instance forward calls
the same submodules with the same arguments in the same order; only the add and the norm become
one kernel. A call the kernel does not take (positional extras, gradients, a norm whose forward was
replaced since) runs the original forward.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

from torch import nn

from .install import candidates
from ..instance_methods import InstancePatches
from .match import mismatch, reference_shape
from .norm_forwards import norm_eps, norm_form, norm_kernel_applies
from ..ops.rms_norm import add_rms_norm, norm_add, norm_add_norm

_TEMPLATE = '''
def forward(self, hidden_states, attention_mask=None, position_ids=None, {cache}=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        {cache}={cache},
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
'''
_GEMMA2_TEMPLATE = '''
def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, {cache}=None,
            **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        {cache}={cache},
        **kwargs,
    )
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.pre_feedforward_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
'''
_CACHE_NAMES = ("past_key_values", "cache")  # transformers' names before and after 5.2x
_REFERENCES = {"llama": tuple(reference_shape(_TEMPLATE.format(cache=c)) for c in _CACHE_NAMES),
               "gemma2": tuple(reference_shape(_GEMMA2_TEMPLATE.format(cache=c)) for c in _CACHE_NAMES)}
_SUBMODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_GEMMA2_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _verdict(cls) -> Tuple[Optional[str], Optional[str]]:
    """(the layer's kind, "llama" or "gemma2", or None; the reason when None)."""
    forward = cls.__dict__["forward"]
    whys = {kind: [mismatch(forward, ref, f"{cls.__name__}.forward") for ref in refs]
            for kind, refs in _REFERENCES.items()}
    for kind, why in whys.items():
        if None in why:
            return kind, None
    return None, whys["llama"][0]


def _defaults(forward) -> Dict[str, object]:
    """The keyword parameters after ``hidden_states`` and their defaults: what the original forward
    passes on to ``self_attn`` when the caller leaves them out."""
    params = list(inspect.signature(inspect.unwrap(forward)).parameters.values())[2:]
    return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _make_forward(defaults: Dict[str, object], original):

    def fast_forward(self, hidden_states, *args, **kwargs):
        norm = self.post_attention_layernorm
        form = norm_form(norm)
        if args or form is None or not norm_kernel_applies(hidden_states, norm.weight):
            return original(hidden_states, *args, **kwargs)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **{**defaults, **kwargs})
        if (hidden_states.shape == residual.shape and hidden_states.dtype == residual.dtype
                and norm_kernel_applies(hidden_states, norm.weight)):
            hidden_states, residual = add_rms_norm(hidden_states, residual, norm.weight, norm_eps(norm, form),
                                                   unit_offset=form == "gemma")
        else:
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = norm(hidden_states)
        stream = self.__dict__.get("_fastlora_stream")  # the residual add in down_proj's GEMM (stream_linears)
        target = None if stream is None else stream.residual_target(self)
        if target is None:
            return residual + self.mlp(hidden_states)
        stream.expect_add(target, residual)
        try:
            hidden_states = self.mlp(hidden_states)
        finally:
            took = stream.took_add()
        return hidden_states if took else residual + hidden_states

    return fast_forward


def _sandwich(norms, x):
    """(form, eps of each) when Gemma 2's three norms run one-kernel forwards of one form and the
    kernel takes ``x``, else None."""
    forms = {norm_form(n) for n in norms}
    if len(forms) != 1 or None in forms or any(n.weight.shape != norms[0].weight.shape for n in norms):
        return None
    form = forms.pop()
    if not all(norm_kernel_applies(x, n.weight) for n in norms):
        return None
    return form, [norm_eps(n, form) for n in norms]


def _make_gemma2_forward(defaults: Dict[str, object], original):

    def fast_forward(self, hidden_states, *args, **kwargs):
        norms = [getattr(self, n) for n in _GEMMA2_NORMS]
        plan = None if args else _sandwich(norms, hidden_states)
        if plan is None:
            return original(hidden_states, *args, **kwargs)
        form, (eps_a, eps_b, eps_c) = plan
        gemma = form == "gemma"
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **{**defaults, **kwargs})
        if hidden_states.shape != residual.shape or hidden_states.dtype != residual.dtype \
                or _sandwich(norms, hidden_states) is None:
            hidden_states = residual + norms[0](hidden_states)
            return hidden_states + norms[2](self.mlp(norms[1](hidden_states)))
        hidden_states, residual = norm_add_norm(hidden_states, residual, norms[0].weight, eps_a, norms[1].weight,
                                                eps_b, unit_offset=gemma)
        hidden_states = self.mlp(hidden_states)
        if hidden_states.shape != residual.shape or hidden_states.dtype != residual.dtype \
                or _sandwich(norms, hidden_states) is None:
            return residual + norms[2](hidden_states)
        return norm_add(hidden_states, residual, norms[2].weight, eps_c, unit_offset=gemma)

    return fast_forward


def install_decoder_layers(root: nn.Module, patches: InstancePatches) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every Llama-family decoder layer under ``root`` whose post-attention norm runs the
    one-kernel forward the fused residual add, and every Gemma 2 layer whose three sandwich norms
    do the fused norms and adds. Call after ``install_norms``.

    Returns (the layers changed, (class, reason) for layers with these submodules whose forward
    differs; a layer whose norm keeps its own forward is left as it is, the norm's reason reported).
    """
    done, skipped, verdicts = [], {}, {}
    for name, m, forward in candidates(root, _SUBMODULES):
        cls = type(m)
        if cls not in verdicts:
            verdicts[cls] = _verdict(cls)
        kind, why = verdicts[cls]
        if kind is None:
            skipped[cls.__name__] = why
            continue
        norms = [getattr(m, n, None) for n in (_GEMMA2_NORMS if kind == "gemma2" else ("post_attention_layernorm",))]
        if any(n is None or norm_form(n) is None for n in norms):  # (the norm's own reason is reported)
            continue
        make = _make_gemma2_forward if kind == "gemma2" else _make_forward
        patches.bind(m, "forward", make(_defaults(forward), m.forward))
        done.append((name, m))
    return done, sorted(skipped.items())
