"""Variable-length attention for transformers' continuous-batching engine.

The engine packs the prefill chunks and decode tokens of many requests into one row. With
``paged|sdpa`` (what it runs when flash-attention is not installed) it attends every query of
the row to every key read for the step through one masked attention: the cost grows with the
square of the requests in flight, and it builds that mask on the host at every step. The engine
also hands each attention call the packed layout (``cu_seq_lens_q`` / ``cu_seq_lens_k``), which
is all a variable-length kernel needs: each request's queries against its own keys only.

``PAGED_NAME`` is that attention (``paged|fastlora_varlen`` on transformers before 5.24,
``fastlora_flash_varlen`` from 5.24: ``compat.engine.cb_varlen_attention_name``): the engine's own
cache update (called here with its read and write indices before 5.24, by the model's attention
from 5.24), then PyTorch's bundled flash-attention varlen kernel
(``aten._flash_attention_forward``: causal aligned to the end of each request's keys, grouped
query heads, sliding windows) on CUDA in fp16 / bf16. Nothing is copied from the model code;
the engine keeps its scheduler, cache and graphs, and builds no mask for this implementation.
Elsewhere (tests on CPU) a per-request torch reference computes the same thing.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..compat.attention import flash_varlen, flash_varlen_has_window, has_flash_varlen
from ..compat.engine import (IN_PLACE_KV, cb_full_attention_views, cb_layer_indices, cb_paged_attention_name,
                             cb_step_pages, cb_varlen_attention_name)
from ..compat.modules import attn_implementation, multi_device_reason
from ..kernel_support import interpreting, triton_missing
from ..ops.paged_varlen import paged_varlen_attention as paged_kernel, paged_varlen_reference
from .attention_registry import _PREV_ATTR as DECODE_PREV_ATTR, ATTN_NAMES as DECODE_NAMES

PAGED_NAME = cb_varlen_attention_name()  # what this transformers' engine accepts
IN_PLACE_NAME = cb_paged_attention_name()  # the attention that reads the paged cache in place
_MAX_HEAD_DIM = 256


def varlen_blocker(inner: nn.Module, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the engine of this model keeps its own attention (None: the flash varlen kernel applies)."""
    return kernel_blocker(dtype, device) or _model_blocker(
        inner, sliding_needs_window=not flash_varlen_has_window())


def forced_varlen_blocker(inner: nn.Module, device: torch.device) -> Optional[str]:
    """Why ``engine_attention="varlen"`` would give this model wrong results (None: it would not;
    off fp16 / bf16 CUDA it runs the per-request reference)."""
    return _model_blocker(inner, sliding_needs_window=device.type == "cuda" and not flash_varlen_has_window(),
                          needs_flash=False)


def in_place_blocker(inner: nn.Module, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the engine of this model cannot read its paged cache through ``ops.paged_varlen``
    (None: it can; sliding-window layers, which the engine lays out otherwise, take the varlen
    path)."""
    why = triton_missing()
    if why is not None:
        return why
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{dtype} (the kernel takes fp16, bf16 or fp32)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return "a GPU older than sm80"
    if device.type != "cuda" and not interpreting():
        return f"the model is on {device.type} (the kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1)"
    split = multi_device_reason(inner)
    if split is not None:  # each step's page table lives on one device
        return split
    return forced_varlen_blocker(inner, device)


def kernel_blocker(dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why ``paged|fastlora_varlen`` runs its torch reference here (None: the flash kernel), which
    syncs with the host and so cannot be captured in a CUDA graph."""
    if device.type != "cuda":
        return "the model is not on CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{dtype} (the flash kernel takes fp16 / bf16)"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "a GPU older than sm80"
    return None


def _model_blocker(inner: nn.Module, sliding_needs_window: bool, needs_flash: bool = True) -> Optional[str]:
    cfg = getattr(inner, "config", None)
    current = attn_implementation(inner)
    if current in DECODE_NAMES:  # fastlora's decode attention: the engine runs the model's own
        current = inner.__dict__.get(DECODE_PREV_ATTR, current)
    if current not in ("sdpa", "eager"):
        return f"attention implementation {current!r}"
    if getattr(cfg, "sub_configs", None):
        return "composite model (sub-configs)"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "logit soft-capping"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim > _MAX_HEAD_DIM or head_dim % 8:
        return f"head dim {head_dim}"
    if needs_flash and not has_flash_varlen():
        return f"torch {torch.__version__} has no aten._flash_attention_forward"
    if sliding_needs_window and has_sliding_layers(inner):
        return "sliding windows (this torch's flash varlen kernel takes no window)"
    return None


def has_sliding_layers(inner: nn.Module) -> bool:
    """Whether some attention layer of the model has a sliding window (those take the varlen path,
    which gathers the keys a step reads, under the in-place attention too)."""
    cfg = getattr(inner, "config", None)
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    return bool(windowed) or any(getattr(m, "sliding_window", None) for m in inner.modules())


def _window(module: nn.Module, kwargs: dict) -> Optional[int]:
    """The layer's sliding window (None: full attention). Some models pass it to the attention
    function (Mistral's attention has no attribute for it); others keep it on the module."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    return getattr(module, "sliding_window", None)


def _of_layer(per_type, sliding):
    """The value of this layer's type out of the engine's per-layer-type dict (a tensor or int as is)."""
    if not isinstance(per_type, dict):
        return per_type
    key = "sliding_attention" if sliding else "full_attention"
    return per_type[key] if key in per_type or len(per_type) != 1 else next(iter(per_type.values()))


def varlen_reference(q, k, v, cu_q, cu_k, scale: float, window_left: int = -1) -> torch.Tensor:
    """Per request: its queries (the last ones of its keys) against its own keys, causal, with an
    optional left window; q (Tq, H, D), k / v (Tk, KVH, D). Rows past ``cu_q[-1]`` are zero."""
    return paged_varlen_reference(q, k, v, None, cu_q, cu_k, scale, window_left)


def paged_varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    """An attention function for ``AttentionInterface`` under ``PAGED_NAME``: called by the engine's
    forwards with query (1, H, Tq, D) and the engine's paged-attention kwargs; key / value (1, KVH,
    T, D) are the step's new tokens (before 5.24: updated into the cache here) or already every key
    the step reads (from 5.24: the model's attention updated the cache). Returns ((Tq, H, D), None)."""
    if kwargs.get("cu_seq_lens_q") is None:
        raise ValueError(f"{PAGED_NAME!r} serves transformers' continuous-batching engine (it needs its paged "
                         "cache and packed layout); a plain forward uses the model's own attention")
    if kwargs.get("block_table") is not None:
        raise ValueError(f"{PAGED_NAME!r} does not take the engine's block-table decode path")
    if dropout:
        raise ValueError(f"{PAGED_NAME!r} is for inference (dropout {dropout})")
    sliding = _window(module, kwargs)
    if "max_length_q" in kwargs:  # 5.24 on: the keys and values the step reads, as (1, KVH, T, D)
        cu_k, max_q, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"]
        k, v = (t.squeeze(0).transpose(0, 1) for t in (key, value))
    else:
        cache = kwargs.get("cache")
        if cache is None:
            raise ValueError(f"{PAGED_NAME!r} needs the engine's paged cache")
        cu_k, max_q, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_q"], kwargs["max_seqlen_k"]
        k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                            read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    cu_k, max_k = _of_layer(cu_k, sliding), _of_layer(max_k, sliding)
    q = query.transpose(1, 2).squeeze(0)
    scale = scaling if scaling is not None else module.scaling
    window_left = int(sliding) - 1 if sliding else -1
    cu_q = kwargs["cu_seq_lens_q"]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = flash_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_q.to(torch.int32),
                           cu_k.to(torch.int32), int(max_q), int(max_k), scale, window_left)
    else:
        out = varlen_reference(q, k, v, cu_q, cu_k, scale, window_left)
    return out, None


def paged_in_place_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    """An attention function for ``AttentionInterface`` under ``IN_PLACE_NAME``: as
    ``paged_varlen_attention``, but a full-attention layer reads the paged cache in place
    (``ops.paged_varlen``: the queries of a kv head's group in one tile, split over the keys, each
    request's keys found through the step's page table), with no gathered copy of the keys and
    values. From 5.24 the cache's update wrote the step's new keys and values and left the views
    and the pages in the kwargs (``compat.engine.cb_write_only_updates``); before, they are written
    here. Other layers take ``paged_varlen_attention``."""
    views = kwargs.pop(IN_PLACE_KV, None)
    if views is not None:  # 5.24 on
        cu_k, max_q, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"]
    elif (kwargs.get("cache") is not None and "write_index" in kwargs and kwargs.get("block_table") is None
          and not dropout):
        cache, layer = kwargs["cache"], module.layer_idx
        found = cb_full_attention_views(cache, layer)
        pages = cb_step_pages(cache, layer) if found is not None else None
        if pages is not None:
            _, write_index = cb_layer_indices(cache, layer, kwargs)
            for view, new in zip(found, (key, value)):
                view.index_copy_(0, write_index, new.squeeze(0).transpose(0, 1))
            views = (*found, pages)
            cu_k, max_q, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_q"], kwargs["max_seqlen_k"]
    if views is None:
        return paged_varlen_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    sliding = _window(module, kwargs)
    cu_k, max_k = _of_layer(cu_k, sliding), _of_layer(max_k, sliding)
    k_view, v_view, pages = views
    scale = scaling if scaling is not None else module.scaling
    out = paged_kernel(query.transpose(1, 2).squeeze(0), k_view, v_view, pages,
                       kwargs["cu_seq_lens_q"].to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), scale,
                       int(sliding) - 1 if sliding else -1)
    return out, None
