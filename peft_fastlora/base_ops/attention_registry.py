"""Decode attention through transformers' attention-function registry.

``enable_decode_attention(model)`` registers the function ``fastlora_decode`` (and, for mask
creation, the sdpa mask builder under the same name) and switches the model's
``config._attn_implementation`` to it; ``disable_decode_attention`` switches back. The model code
is not copied or changed: every attention module keeps calling
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``.

The function runs ``ops.decode_attention`` for one-token steps over a 4-D mask as long as the
cache (the static cache of the graph path, or any cache whose keys have the mask's length) and
for everything else (prefill, training, sliding windows, unsupported head dims or devices) calls
transformers' own ``sdpa`` function unchanged. Results are those of sdpa up to rounding.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from .. import _compat
from ..kernel_support import FLOAT_DTYPES, interpreting

logger = logging.getLogger("peft_fastlora")

ATTN_NAME = "fastlora_decode"
_PREV_ATTR = "_fastlora_prev_attn_implementation"
_MAX_HEAD_DIM = 256
# attention kwargs that change the result and that the kernel does not implement
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "head_mask")


def _sdpa():
    """transformers' sdpa function, as registered (a user's override of "sdpa" is honoured)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def decode_unsupported(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, dropout: float = 0.0, **kwargs) -> Optional[str]:
    """Why this call goes to sdpa instead of the decode kernel (None: the kernel serves it)."""
    if query.dim() != 4 or query.shape[2] != 1:
        return "not a one-token step"
    if getattr(module, "training", False) or dropout:
        return "training or dropout"
    if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None) is not None:
        return "sliding window"
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            return f"attention kwarg {name!r}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return "autograd"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return "no 4-D attention mask"
    bsz, heads, _, dim = query.shape
    if key.dim() != 4 or key.shape != value.shape or key.shape[0] != bsz or key.shape[3] != dim:
        return "key / value shapes"
    if dim > _MAX_HEAD_DIM:
        return f"head dim {dim} > {_MAX_HEAD_DIM}"
    if heads % key.shape[1]:
        return "query heads not a multiple of kv heads"
    m = attention_mask
    if m.shape[1] != 1 or m.shape[2] != 1 or m.shape[3] != key.shape[2] or m.shape[0] not in (1, bsz):
        return f"mask {tuple(m.shape)} is not (B, 1, 1, {key.shape[2]})"
    if m.dtype != torch.bool and not m.is_floating_point():
        return f"mask dtype {m.dtype}"
    if query.dtype not in FLOAT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtypes"
    if query.device.type == "cuda":
        if interpreting():
            return "Triton interpreter with CUDA tensors"
        if query.device.index != torch.cuda.current_device():
            return "not on the current CUDA device (Triton launches there)"
    elif not (query.device.type == "cpu" and interpreting()):
        return f"device {query.device.type}"
    return None


def fastlora_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """An attention function for ``AttentionInterface`` (same call and return as sdpa's).

    Shapes: query (B, H, q_len, D), key / value (B, KVH, L, D) (the whole static cache),
    attention_mask (B, 1, q_len, L) bool or additive float. Returns ((B, q_len, H, D), None).
    """
    why = decode_unsupported(module, query, key, value, attention_mask, dropout, **kwargs)
    if why is not None:
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from ..ops.decode_attention import decode_attention

    out = decode_attention(query, key, value, attention_mask, scaling=scaling, softcap=kwargs.get("softcap"))
    return out, None


def _sliding_reason(inner: nn.Module) -> Optional[str]:
    cfg = inner.config
    layer_types = getattr(cfg, "layer_types", None) or []
    if any("sliding" in str(t) or "chunked" in str(t) for t in layer_types):
        return "sliding-window attention layers"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention (config.sliding_window)"
    if getattr(cfg, "attention_chunk_size", None) is not None:
        return "chunked attention"
    for m in inner.modules():
        if getattr(m, "sliding_window", None) is not None and hasattr(m, "layer_idx"):
            return "sliding-window attention layers"
    return None


def enable_decode_attention(hf_model: nn.Module) -> Optional[str]:
    """Route ``hf_model``'s attention through ``fastlora_decode``.

    Args:
        hf_model: a transformers model (a PeftModel is unwrapped).
    Returns:
        None when enabled (or already enabled), else why the model keeps its attention.
    """
    inner = _compat.unwrap_peft(hf_model)
    cfg = getattr(inner, "config", None)
    current = _compat.attn_implementation(inner)
    if current is None:
        return "not a transformers model"
    if current == ATTN_NAME:
        return None
    if current != "sdpa":
        return f"attention implementation {current!r} (only sdpa models are switched)"
    if getattr(cfg, "sub_configs", None):
        return "composite model (sub-configs)"
    why = _sliding_reason(inner)
    if why:
        return why
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "logit soft-capping (the sdpa path, used for prefill, does not apply it)"
    _compat.register_attention_function(ATTN_NAME, fastlora_decode_attention)
    inner.__dict__[_PREV_ATTR] = current
    try:
        _compat.set_attn_implementation(inner, ATTN_NAME)
    except Exception as e:  # transformers refused the name: leave the model as it was
        _compat.set_attn_implementation(inner, current)
        inner.__dict__.pop(_PREV_ATTR, None)
        return f"transformers refused {ATTN_NAME!r}: {e}"
    if _compat.attn_implementation(inner) != ATTN_NAME:
        kept = _compat.attn_implementation(inner)
        _compat.set_attn_implementation(inner, current)
        inner.__dict__.pop(_PREV_ATTR, None)
        return f"transformers kept attention implementation {kept!r}"
    return None


def disable_decode_attention(hf_model: nn.Module) -> None:
    """Restore the attention implementation ``enable_decode_attention`` replaced (no-op otherwise)."""
    inner = _compat.unwrap_peft(hf_model)
    prev = inner.__dict__.pop(_PREV_ATTR, None)
    if prev is None:
        return
    if _compat.attn_implementation(inner) == ATTN_NAME:
        _compat.set_attn_implementation(inner, prev)


def decode_attention_enabled(hf_model: nn.Module) -> bool:
    return _compat.attn_implementation(_compat.unwrap_peft(hf_model)) == ATTN_NAME
