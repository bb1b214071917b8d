"""transformers' attention registries and torch's flash-attention varlen kernel."""

from __future__ import annotations

import types
from typing import Dict, Optional

import torch
from torch import nn

from .modules import TRANSFORMERS_VERSION


def plain_function(fn):
    """The Python function behind ``fn``. transformers >= 5.25 with the ``kernels`` package turns a
    function decorated ``use_kernel_forward_from_hub`` (``apply_rotary_pos_emb``) into an instance of
    an ``nn.Module`` class whose ``forward`` calls the original, held in its closure as ``func``;
    anything else is returned as it is."""
    if not isinstance(fn, nn.Module):
        return fn
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars:
        return fn
    inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return inner if isinstance(inner, types.FunctionType) else fn


# transformers' attention registries are process-wide: a name fastlora registers stays only while a
# model uses it (name -> models using it), so that unpatching the last one leaves them as they were
_ATTENTION_USERS: Dict[str, int] = {}


def register_attention_function(name: str, fn, mask: Optional[str] = "sdpa") -> None:
    """Make ``name`` a valid attention implementation running ``fn`` for one more model (release
    it with ``release_attention_function``), with the mask builder of ``mask`` ("sdpa": boolean
    masks; "eager": additive float masks, which the models' eager attention functions add to their
    scores): without a mask function under the same name, transformers builds no mask at all (it
    assumes a custom kernel that needs none). ``mask=None``: no mask function (a ``paged|``
    implementation: the engine builds masks only for its own ``paged|sdpa`` / ``paged|eager``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = _mask_registry()
    if name not in _ATTENTION_USERS:
        AttentionInterface.register(name, fn)
        if mask is not None and name not in masks:
            AttentionMaskInterface.register(name, {"sdpa": sdpa_mask, "eager": eager_mask}[mask])
    _ATTENTION_USERS[name] = _ATTENTION_USERS.get(name, 0) + 1


def release_attention_function(name: str) -> None:
    """One model less uses ``name``: the last one takes it out of transformers' registries."""
    from transformers import AttentionInterface

    users = _ATTENTION_USERS.get(name, 0) - 1
    if users > 0:
        _ATTENTION_USERS[name] = users
        return
    _ATTENTION_USERS.pop(name, None)
    AttentionInterface._global_mapping.pop(name, None)
    _mask_registry().pop(name, None)


def _mask_registry() -> dict:
    from transformers.masking_utils import AttentionMaskInterface

    registered = getattr(AttentionMaskInterface, "_global_mapping", None)
    if registered is None:
        raise RuntimeError(f"fastlora: transformers {TRANSFORMERS_VERSION}'s AttentionMaskInterface has no "
                           "_global_mapping; cannot tell whether a mask function is registered")
    return registered


def _flash_forward_schema():
    op = getattr(getattr(torch.ops, "aten", None), "_flash_attention_forward", None)
    try:
        return {a.name for a in op.default._schema.arguments} if op is not None else None
    except (AttributeError, RuntimeError):
        return None


def has_flash_varlen() -> bool:
    args = _flash_forward_schema()
    return args is not None and {"cum_seq_q", "cum_seq_k", "scale"} <= args


def flash_varlen_has_window() -> bool:
    args = _flash_forward_schema()
    return args is not None and "window_size_left" in args


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, window_left: int = -1):
    """``aten._flash_attention_forward`` over packed requests, causal (aligned to the end of each
    request's keys); q (Tq, H, D), k / v (Tk, KVH, D) -> (Tq, H, D)."""
    window = dict(window_size_left=window_left, window_size_right=0) if window_left >= 0 else {}
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale, **window)[0]


def attention_function(config, registry, default):
    """The attention function a transformers attention module of ``config`` calls (its
    ``_attn_implementation`` looked up in ``registry``, ``default`` for eager)."""
    return registry.get_interface(config._attn_implementation, default)


def _output_collector():
    """transformers' context variable of the outputs a forward records (None where it has none)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


_COLLECTOR = []  # [the collector or None], looked up at the first call (each decode step asks)


def attention_weights_recorded(kwargs: dict) -> bool:
    """Whether the forward running now returns the attention weights (``output_attentions``):
    transformers 5 records them from each attention module's output through hooks, while the
    forward's ``capture_outputs`` holds a collector with an ``attentions`` entry in a context
    variable; earlier code passed ``output_attentions`` down to the attention function."""
    if kwargs.get("output_attentions"):
        return True
    if not _COLLECTOR:
        _COLLECTOR.append(_output_collector())
    collected = _COLLECTOR[0].get() if _COLLECTOR[0] is not None else None
    return isinstance(collected, dict) and any("attentions" in key for key in collected)
