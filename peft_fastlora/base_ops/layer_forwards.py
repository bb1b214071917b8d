"""Llama-family decoder layers whose ``residual + attention output`` and post-attention RMSNorm
are one Triton launch (``ops.add_rms_norm``), on this model instance only.

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

from .install import candidates, set_instance_forward
from .match import mismatch, reference_shape
from .norm_forwards import norm_eps, norm_form, norm_kernel_applies

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
_REFERENCES = tuple(reference_shape(_TEMPLATE.format(cache=c)) for c in ("past_key_values", "cache"))
_SUBMODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _verdict(cls) -> Optional[str]:
    forward = cls.__dict__["forward"]
    whys = [mismatch(forward, ref, f"{cls.__name__}.forward") for ref in _REFERENCES]
    return None if None in whys else whys[0]


def _defaults(forward) -> Dict[str, object]:
    """The keyword parameters after ``hidden_states`` and their defaults: what the original forward
    passes on to ``self_attn`` when the caller leaves them out."""
    params = list(inspect.signature(inspect.unwrap(forward)).parameters.values())[2:]
    return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _make_forward(defaults: Dict[str, object], original):
    from ..ops.rms_norm import add_rms_norm

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
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    return fast_forward


def install_decoder_layers(root: nn.Module) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every Llama-family decoder layer under ``root`` whose post-attention norm runs the
    one-kernel forward the fused residual add. Call after ``install_norms``.

    Returns (the layers changed, (class, reason) for layers with these submodules whose forward
    differs; a layer whose norm keeps its own forward is left as it is, the norm's reason reported).
    """
    done, skipped, verdicts = [], {}, {}
    for name, m, forward in candidates(root, _SUBMODULES):
        cls = type(m)
        if cls not in verdicts:
            verdicts[cls] = _verdict(cls)
        if verdicts[cls] is not None:
            skipped[cls.__name__] = verdicts[cls]
            continue
        if norm_form(m.post_attention_layernorm) is None:  # (the norm's own reason is reported)
            continue
        set_instance_forward(m, _make_forward(_defaults(forward), m.forward))
        done.append((name, m))
    return done, sorted(skipped.items())
