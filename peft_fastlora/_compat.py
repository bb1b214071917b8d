"""Every difference between transformers / PEFT versions, and every read of PEFT internals, in one
place. The rest of the package asks these helpers, never PEFT's private attributes directly."""

from __future__ import annotations

import inspect
import types
from typing import Dict, Optional, Tuple

import torch
from torch import nn

import peft
import transformers
from peft.tuners.lora import layer as _lora_layer

LoraLayer = _lora_layer.LoraLayer
LoraLinear = _lora_layer.Linear
LoraEmbedding = _lora_layer.Embedding

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - very old transformers
    Conv1D = None

PEFT_VERSION = peft.__version__
TRANSFORMERS_VERSION = transformers.__version__


def is_lora_layer(module: nn.Module) -> bool:
    return isinstance(module, LoraLayer)


def base_layer_of(module: nn.Module) -> nn.Module:
    """The innermost base layer of a PEFT tuner layer (the module itself otherwise)."""
    return module.get_base_layer() if isinstance(module, LoraLayer) else module


def is_conv1d(module: nn.Module) -> bool:
    return Conv1D is not None and isinstance(module, Conv1D)


def linear_in_out(base: nn.Module) -> Tuple[int, int]:
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if is_conv1d(base):  # GPT-2: weight is (in, out)
        return base.weight.shape[0], base.weight.shape[1]
    raise TypeError(f"not a linear layer: {type(base).__name__}")


def embed_scale(layer: nn.Module) -> Optional[float]:
    """Scale some embeddings (Gemma's) apply in forward; PEFT applies it to the LoRA delta too."""
    getter = getattr(layer, "_get_embed_scale", None)
    scale = getter() if getter is not None else None
    return None if scale is None else float(scale)


def lora_weights(layer: nn.Module) -> Dict[str, Tuple[torch.Tensor, torch.Tensor, float]]:
    """name -> (A (r, in), B (out, r), scaling) for every adapter the layer holds.

    For an Embedding, ``in`` is the vocabulary and the embedding scale is folded into the scaling.
    """
    out = {}
    if isinstance(layer, LoraEmbedding):
        scale = embed_scale(layer) or 1.0
        for name in layer.lora_embedding_A.keys():
            out[name] = (layer.lora_embedding_A[name], layer.lora_embedding_B[name],
                         float(layer.scaling[name]) * scale)
        return out
    for name in layer.lora_A.keys():
        if name not in layer.lora_B:
            continue
        out[name] = (layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]))
    return out


def adapter_names_of(layer: nn.Module):
    return set(layer.lora_A.keys()) | set(layer.lora_embedding_A.keys())


def unsupported_reason(layer: nn.Module, adapter: str) -> Optional[str]:
    """Why fastlora cannot compute this adapter in this layer (PEFT's own path then serves it)."""
    if layer.use_dora.get(adapter, False):
        return "DoRA"
    if getattr(layer, "lora_bias", {}).get(adapter, False):
        return "lora_bias"
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None:
        return f"LoRA variant {type(variant).__name__}"
    return None


def layer_is_merged(layer: nn.Module) -> bool:
    return bool(layer.merged_adapters)


def layer_adapters_disabled(layer: nn.Module) -> bool:
    return bool(layer.disable_adapters)


def layer_dropout_active(layer: nn.Module) -> bool:
    """Whether PEFT's forward would apply a random LoRA dropout here.

    Only this makes a layer's own ``training`` flag matter to PEFT's mixed-batch path (PEFT checks
    the model's flag, not the layer's). ``add_adapter`` leaves the modules it creates in training
    mode inside an eval model; with ``lora_dropout=0`` they still compute exactly what eval would.
    """
    for d in getattr(layer, "lora_dropout", {}).values():
        if d.training and not isinstance(d, nn.Identity) and not (isinstance(d, nn.Dropout) and d.p == 0):
            return True
    return False


# ---- transformers: decode-step kwargs (used by the CUDA-graph runner) -----------------------
def forward_accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def cache_kwarg_name(model: nn.Module) -> str:
    """transformers >= 5.2x renamed the forward kwarg ``past_key_values`` to ``cache``."""
    return "cache" if forward_accepts(model, "cache") else "past_key_values"


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers (or plain torch) model inside a PeftModel / LoraModel, else the model."""
    inner = model
    if isinstance(inner, peft.PeftModel):
        inner = inner.base_model
    if isinstance(inner, peft.tuners.tuners_utils.BaseTuner):
        inner = inner.model
    return inner


def generate_cache_kwarg(model: nn.Module) -> str:
    """Name under which ``generate`` takes a user cache (follows the forward's name)."""
    return cache_kwarg_name(model)


def make_static_cache(model: nn.Module, max_cache_len: int, batch_size: Optional[int] = None,
                      kernel_writes: bool = True):
    """A ``StaticCache``; with ``batch_size``, allocated now for that many rows and able to take
    a prefill of fewer rows (it fills the first ones), so one cache and one decode graph serve
    every batch up to ``batch_size`` (the rest are padding rows). ``kernel_writes``: full-attention
    layers write new keys and values with ``ops.kv_cache`` where it applies."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    if batch_size is None:
        return cache
    cfg = model.config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param = next(model.parameters())
    probe = torch.zeros(batch_size, kv_heads, 1, head_dim, dtype=param.dtype, device=param.device)
    for layer in cache.layers:
        layer.lazy_initialization(probe, probe)
        layer.update = types.MethodType(_update_first_rows, layer)
        layer._fastlora_kernel_writes = kernel_writes
    return cache


def _update_first_rows(layer, key_states, value_states, *args, **kwargs):
    """``update`` of a static cache layer that also accepts fewer rows than it holds (it fills the
    first ones). Where ``ops.kv_cache`` takes the tensors, the write is one kernel and the length
    increment a second, instead of transformers' five kernels; otherwise transformers' update runs."""
    rows, full_k, full_v = key_states.shape[0], layer.keys, layer.values
    if getattr(layer, "_fastlora_kernel_writes", False) and _kv_kernel_applies(layer, key_states, value_states):
        from .ops.kv_cache import kv_cache_write

        kv_cache_write(key_states, value_states, full_k, full_v, layer.cumulative_length)
        layer.cumulative_length.add_(key_states.shape[-2])
        return (full_k, full_v) if rows == full_k.shape[0] else (full_k[:rows], full_v[:rows])
    if rows == full_k.shape[0]:
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    layer.keys, layer.values = full_k[:rows], full_v[:rows]  # views: writes land in the full tensors
    try:
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    finally:
        layer.keys, layer.values = full_k, full_v


def _kv_kernel_applies(layer, key, value) -> bool:
    from transformers.cache_utils import StaticLayer

    # only transformers' plain static layer: a sliding-window layer rolls its window instead
    if getattr(layer, "is_sliding", False) or getattr(type(layer), "update", None) is not StaticLayer.update:
        return False
    keys, length = getattr(layer, "keys", None), getattr(layer, "cumulative_length", None)
    if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor):
        return False
    if not isinstance(length, torch.Tensor) or length.numel() != 1 or length.device != keys.device:
        return False
    if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
        return False
    if key.dim() != 4 or key.shape != value.shape or key.shape[0] > keys.shape[0]:
        return False
    if key.shape[1:2] + key.shape[3:] != keys.shape[1:2] + keys.shape[3:] or key.shape[2] > keys.shape[2]:
        return False
    if len({key.dtype, value.dtype, keys.dtype, layer.values.dtype}) != 1 or key.device != keys.device:
        return False
    if any(t.stride(-1) != 1 for t in (key, value, keys, layer.values)):
        return False
    from ._forwards import kernel_runs_on

    return kernel_runs_on(key, value, keys)


def cache_state_tensors(cache) -> list:
    """The small tensors a static cache advances in place at each update (its fill lengths).

    A decode step run for warm-up or capture advances them; the graph runner saves and restores them
    so that the real step writes where it should.
    """
    out = []
    for layer in getattr(cache, "layers", []) or []:
        t = getattr(layer, "cumulative_length", None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out


def cache_is_graph_safe(cache) -> Optional[str]:
    """None when every layer of the cache is a static layer with device-side lengths."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return f"cache {type(cache).__name__} has no layers"
    for layer in layers:
        if not getattr(layer, "is_compileable", False) or getattr(layer, "is_sliding", False):
            return f"cache layer {type(layer).__name__} is not a static full-attention layer"
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            return f"cache layer {type(layer).__name__} tracks its length on the host"
    return None


# ---- PEFT's forward hooks after an error ---------------------------------------------------------
_HOOK_GUARD = "_enable_peft_forward_hooks"


def guard_peft_forward_hooks(peft_model: nn.Module) -> bool:
    """Make PEFT remove its per-call ``adapter_names`` hooks when the call raises.

    PEFT registers forward pre-hooks on every LoRA layer for a call with ``adapter_names`` and
    removes them only when the call returns (its context manager has no ``finally``:
    huggingface/peft#3475), so after any error inside the call (an unknown adapter, too many
    adapters for fastlora's batch) the stale hooks break every later call. This wraps the context
    manager on this model instance: on an exception, hooks added during the call are removed.
    Returns False when the model has no such context manager (nothing to guard).
    """
    import contextlib

    original = getattr(peft_model, _HOOK_GUARD, None)
    if original is None or _HOOK_GUARD in peft_model.__dict__:
        return False
    layers = [m for m in peft_model.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]

    @contextlib.contextmanager
    def guarded(*args, **kwargs):
        before = [(m, set(m._forward_pre_hooks), set(m._forward_hooks)) for m in layers]
        try:
            with original(*args, **kwargs):
                yield
        except BaseException:
            for m, pre, post in before:
                for key in [k for k in m._forward_pre_hooks if k not in pre]:
                    del m._forward_pre_hooks[key]
                    m._forward_pre_hooks_with_kwargs.pop(key, None)
                for key in [k for k in m._forward_hooks if k not in post]:
                    del m._forward_hooks[key]
                    m._forward_hooks_with_kwargs.pop(key, None)
            raise

    peft_model.__dict__[_HOOK_GUARD] = guarded
    return True


def unguard_peft_forward_hooks(peft_model: nn.Module) -> None:
    peft_model.__dict__.pop(_HOOK_GUARD, None)
