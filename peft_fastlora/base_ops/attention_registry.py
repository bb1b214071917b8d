"""Decode attention through transformers' attention-function registry.

``enable_decode_attention(model)`` registers the function ``fastlora_decode`` (with, for mask
creation, the sdpa mask builder under the same name) for an sdpa model, or
``fastlora_decode_eager`` (with the eager mask builder) for an eager one, and switches the model's
``config._attn_implementation`` to it; ``disable_decode_attention`` switches back. The model code
is not copied or changed: every attention module keeps calling
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``.

The function runs ``ops.decode_attention`` for one-token steps over a 4-D mask as long as the
cache (the static cache of the graph path, or any cache whose keys have the mask's length) and
for everything else (prefill, training, unsupported head dims or devices) calls the model's own
function unchanged: transformers' ``sdpa``, or the eager function of the model's own code. Like
them, the kernel reads sliding windows from the mask, and applies the logit soft-capping the
eager functions apply. Results are those of the model's own attention up to rounding.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..compat.attention import (attention_weights_recorded, register_attention_function,
                                release_attention_function)
from ..compat.modules import attn_implementation, set_attn_implementation
from ..compat.peft import unwrap_peft
from ..kernel_support import FLOAT_DTYPES, interpreting
from ..ops.decode_attention import decode_attention

logger = logging.getLogger("peft_fastlora")

ATTN_NAME = "fastlora_decode"  # an sdpa model's
EAGER_ATTN_NAME = "fastlora_decode_eager"  # an eager model's (its masks are additive)
ATTN_NAMES = (ATTN_NAME, EAGER_ATTN_NAME)
_PREV_ATTR = "_fastlora_prev_attn_implementation"
_PREFILL_ATTR = "_fastlora_prefill_attention"  # on an eager model's attention modules: their eager function
_MAX_HEAD_DIM = 256
# attention kwargs that change the result and that the kernel does not implement
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "head_mask")


def _sdpa():
    """transformers' sdpa function, as registered (a user's override of "sdpa" is honoured)."""

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def decode_unsupported(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, dropout: float = 0.0, **kwargs) -> Optional[str]:
    """Why this call goes to sdpa instead of the decode kernel (None: the kernel serves it)."""
    if query.dim() != 4 or query.shape[2] != 1:
        return "not a one-token step"
    if getattr(module, "training", False) or dropout:
        return "training or dropout"
    if attention_weights_recorded(kwargs):  # the kernel computes no weights to return
        return "the attention weights are returned"
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
        own = module.__dict__.get(_PREFILL_ATTR) or _sdpa()
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    out = decode_attention(query, key, value, attention_mask, scaling=scaling, softcap=kwargs.get("softcap"))
    return out, None


def _chunked_reason(inner: nn.Module) -> Optional[str]:
    """Sliding windows are in the masks the kernel reads; chunked attention is not known to be."""
    cfg = inner.config
    if any("chunked" in str(t) for t in getattr(cfg, "layer_types", None) or []):
        return "chunked attention layers"
    if getattr(cfg, "attention_chunk_size", None) is not None:
        return "chunked attention"
    return None


def _eager_functions(inner: nn.Module):
    """Each attention module's eager function (the one its model code falls back to), or why not."""
    found = {}
    for m in inner.modules():
        if not (hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")):
            continue
        fn = getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None)
        if not callable(fn):
            return None, f"{type(m).__name__} has no eager_attention_forward in its model code"
        found[m] = fn
    if not found:
        return None, "no attention module found"
    return found, None


def enable_decode_attention(hf_model: nn.Module) -> Optional[str]:
    """Route ``hf_model``'s attention through ``fastlora_decode``.

    Args:
        hf_model: a transformers model (a PeftModel is unwrapped).
    Returns:
        None when enabled (or already enabled), else why the model keeps its attention.
    """
    inner = unwrap_peft(hf_model)
    cfg = getattr(inner, "config", None)
    current = attn_implementation(inner)
    if current is None:
        return "not a transformers model"
    if current in ATTN_NAMES:
        return None
    if current not in ("sdpa", "eager"):
        return f"attention implementation {current!r} (only sdpa and eager models are switched)"
    if getattr(cfg, "sub_configs", None):
        return "composite model (sub-configs)"
    why = _chunked_reason(inner)
    if why:
        return why
    if current == "sdpa" and getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "logit soft-capping with sdpa (which does not apply it)"
    eager = None
    if current == "eager":
        eager, why = _eager_functions(inner)
        if why:
            return why
    name = EAGER_ATTN_NAME if current == "eager" else ATTN_NAME
    register_attention_function(name, fastlora_decode_attention, mask=current)
    inner.__dict__[_PREV_ATTR] = current
    for m, fn in (eager or {}).items():
        m.__dict__[_PREFILL_ATTR] = fn
    try:
        set_attn_implementation(inner, name)
    except Exception as e:  # transformers refused the name: leave the model as it was
        _undo(inner, current)
        return f"transformers refused {name!r}: {e}"
    if attn_implementation(inner) != name:
        kept = attn_implementation(inner)
        _undo(inner, current)
        return f"transformers kept attention implementation {kept!r}"
    return None


def _undo(inner: nn.Module, current: str) -> None:
    set_attn_implementation(inner, current)
    inner.__dict__.pop(_PREV_ATTR, None)
    for m in inner.modules():
        m.__dict__.pop(_PREFILL_ATTR, None)
    release_attention_function(EAGER_ATTN_NAME if current == "eager" else ATTN_NAME)


def disable_decode_attention(hf_model: nn.Module) -> None:
    """Restore the attention implementation ``enable_decode_attention`` replaced (no-op otherwise)."""
    inner = unwrap_peft(hf_model)
    prev = inner.__dict__.pop(_PREV_ATTR, None)
    if prev is None:
        return
    if attn_implementation(inner) in ATTN_NAMES:
        set_attn_implementation(inner, prev)
    for m in inner.modules():
        m.__dict__.pop(_PREFILL_ATTR, None)
    release_attention_function(EAGER_ATTN_NAME if prev == "eager" else ATTN_NAME)


def decode_attention_enabled(hf_model: nn.Module) -> bool:
    return attn_implementation(unwrap_peft(hf_model)) in ATTN_NAMES
