"""What fastlora reads of a PEFT LoRA layer's adapters (this rank's shards under tensor parallelism),
and how it notices that they changed.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .modules import is_dtensor, is_plain_weight, local
from .peft import LoraEmbedding, PEFT_VERSION, base_layer_of, embed_scale, quantized_base_kind, unsupported_reason
from .tensor_parallel import TP_REASON, _tp_local_adapter, tp_style


_LORA_ATTRS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "scaling", "use_dora",
               "merged_adapters", "disable_adapters")


def lora_layer_blocker(layer: nn.Module) -> Optional[str]:
    """Why fastlora cannot read this LoRA layer (None: it can): the attributes it reads, and
    tensor-parallel weights."""
    missing = [a for a in _LORA_ATTRS if not hasattr(layer, a)]
    if missing:
        return (f"PEFT {PEFT_VERSION}'s {type(layer).__name__} has no {', '.join(missing)}: "
                "fastlora cannot read its adapters")
    if any(is_dtensor(p) for p in layer.parameters()) and tp_style(layer) is None:
        plan = getattr(base_layer_of(layer), "_hf_tp_plan", None)
        return f"{TP_REASON} (plan {plan!r} on a {type(layer).__name__})"
    return None


def lora_weights(layer: nn.Module) -> Dict[str, Tuple[torch.Tensor, torch.Tensor, float]]:
    """name -> (A (r, in), B (out, r), scaling) for every adapter the layer holds.

    For an Embedding, ``in`` is the vocabulary and the embedding scale is folded into the scaling.
    """
    out = {}
    if isinstance(layer, LoraEmbedding):
        scale = embed_scale(layer) or 1.0
        for name in layer.lora_embedding_A.keys():
            out[name] = (_tp_local_adapter(layer, "A", layer.lora_embedding_A[name]),
                         layer.lora_embedding_B[name], float(layer.scaling[name]) * scale)
        return out
    for name in layer.lora_A.keys():
        if name not in layer.lora_B:
            continue
        out[name] = (_tp_local_adapter(layer, "A", layer.lora_A[name].weight),
                     _tp_local_adapter(layer, "B", layer.lora_B[name].weight), float(layer.scaling[name]))
    return out


def lora_biases(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """name -> B's bias (out,) for every adapter of a LoRA ``Linear`` whose B has one (PEFT's
    ``lora_bias=True``): its delta is ``scaling * (B @ A @ x + bias)``."""
    if isinstance(layer, LoraEmbedding):
        return {}
    out = {}
    for name, b in layer.lora_B.items():
        bias = getattr(b, "bias", None)
        if isinstance(bias, torch.Tensor):
            out[name] = bias
    return out


def base_bias(layer: nn.Module) -> Optional[torch.Tensor]:
    """The bias of a LoRA layer's base layer (None: it has none)."""
    bias = getattr(base_layer_of(layer), "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def is_dora(layer: nn.Module, adapter: str) -> bool:
    return bool(getattr(layer, "use_dora", {}).get(adapter, False))


def dora_magnitudes(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """name -> DoRA's magnitude vector (out,) for every DoRA adapter of a LoRA ``Linear`` or
    ``Embedding`` (out: the embedding dimension)."""
    vectors = getattr(layer, "lora_magnitude_vector", {})
    names = list(layer.lora_A.keys()) + list(getattr(layer, "lora_embedding_A", {}).keys())
    return {name: vectors[name].weight for name in names if is_dora(layer, name) and name in vectors}


def dora_scale(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, magnitude: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """DoRA's column scale (out,): ``magnitude`` over the row norms of ``weight + scaling * b @ a``,
    computed in ``dtype`` as PEFT's ``DoraLinearLayer`` does."""
    full = weight.to(dtype) + scaling * (b @ a).to(dtype)
    return magnitude / torch.linalg.norm(full, dim=1).to(dtype)


def dora_sources(layer: nn.Module, adapter: str):
    """(A, B, scaling, magnitude) of a PEFT DoRA adapter of ``layer``: what its scale is computed from
    (an embedding's A is (r, vocab), its B (dim, r); its scaling without the embedding's own scale,
    which PEFT applies after the norms)."""
    if isinstance(layer, LoraEmbedding):
        return (layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter], float(layer.scaling[adapter]),
                layer.lora_magnitude_vector[adapter].weight)
    return (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, float(layer.scaling[adapter]),
            layer.lora_magnitude_vector[adapter].weight)


# quantized bases whose weight DoRA's norms read dequantized (``quantized_base_kind``): bitsandbytes'
# 4-bit and torchao's. bitsandbytes' 8-bit weights are left to PEFT (PEFT's own DoRA over them fails
# on the CPU: no oracle to check against).
_DORA_QUANTIZED = ("nf4", "fp4", "4bit", "torchao")


def dora_base_weight(layer: nn.Module) -> torch.Tensor:
    """The base weight as stored (quantized where the base is): its address and version counter
    say when DoRA's norms must be computed again."""
    return base_layer_of(layer).weight


def dora_dense_weight(layer: nn.Module) -> torch.Tensor:
    """The base weight as DoRA's norms read it: (out, in), dequantized over a 4-bit or torchao base
    as PEFT's DoRA layer does (``dequantize_module_weight``); an embedding's table transposed,
    (dim, vocab)."""
    base = base_layer_of(layer)
    if quantized_base_kind(layer) in _DORA_QUANTIZED:
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(base)
    return base.weight.T if isinstance(layer, LoraEmbedding) else base.weight


def adapter_blocker(layer: nn.Module, adapter: str) -> Optional[str]:
    """Why fastlora cannot compute ``adapter`` in ``layer`` (None: it can): PEFT's other variants,
    a B bias under tensor parallelism (each rank would add it), and DoRA where its column norms
    are not those of a plain local weight or of a 4-bit bitsandbytes or torchao base (tensor
    parallelism, GPT-2's transposed ``Conv1D``, other quantized weights). (PEFT's ``LoraConfig``
    refuses DoRA with a B bias itself.)"""
    why = unsupported_reason(layer, adapter)
    if why is not None:
        return why
    sharded = tp_style(layer) is not None
    if adapter in lora_biases(layer) and sharded:
        return "lora_bias under tensor parallelism"
    if is_dora(layer, adapter):
        base = base_layer_of(layer)
        if not isinstance(base, (nn.Linear, nn.Embedding)):
            return f"DoRA over {type(base).__name__}"
        if quantized_base_kind(layer) not in _DORA_QUANTIZED and (not base.weight.is_floating_point()
                                                                 or not is_plain_weight(base.weight)):
            # (DoRA's norms need the dequantized weight: bitsandbytes' 4-bit and torchao's are read)
            return f"DoRA over a quantized {type(base).__name__}"
        if sharded:
            return "DoRA under tensor parallelism"
        if adapter not in getattr(layer, "lora_magnitude_vector", {}):
            return "DoRA without a magnitude vector"
    return None


_SCALING_CHANGES = [0]  # bumped by every ``CountedScaling`` on any change


def scaling_epoch() -> int:
    """A counter of the changes made to the scaling dicts of the LoRA layers fastlora watches
    (``counted_scaling``), anywhere in the process: while it stays the same, none changed."""
    return _SCALING_CHANGES[0]


class CountedScaling(dict):
    """A LoRA layer's ``scaling`` dict (adapter name -> float) that counts its changes in
    ``scaling_epoch``: an engine step then checks every layer's scalings with one integer
    comparison instead of reading each dict (hundreds of them, out of the CPU's caches by then).
    Every way a dict changes in place is counted; copies and pickles are plain dicts."""

    __slots__ = ()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _SCALING_CHANGES[0] += 1

    def __delitem__(self, key):
        super().__delitem__(key)
        _SCALING_CHANGES[0] += 1

    def __ior__(self, other):
        _SCALING_CHANGES[0] += 1
        return super().__ior__(other)

    def _counted(method):  # noqa: N805  (a decorator for the methods below)
        def counted(self, *args, **kwargs):
            _SCALING_CHANGES[0] += 1
            return method(self, *args, **kwargs)
        counted.__name__ = method.__name__
        return counted

    pop, popitem, clear, update, setdefault = map(_counted, (dict.pop, dict.popitem, dict.clear, dict.update,
                                                             dict.setdefault))
    del _counted

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)


def counted_scaling(layer: nn.Module) -> dict:
    """The layer's ``scaling``, made a ``CountedScaling`` with the same items (once). PEFT reads
    and writes it through the attribute, so its own changes are counted; a dict the caller took
    from the layer before the patch is no longer the layer's."""
    scaling = layer.scaling
    if type(scaling) is dict:
        scaling = CountedScaling(scaling)
        layer.scaling = scaling
    return scaling


def plain_scalings(model: nn.Module) -> None:
    """Give every layer of ``model`` a plain dict in place of its ``CountedScaling`` (unpatch)."""
    for m in model.modules():
        scaling = m.__dict__.get("scaling")
        if type(scaling) is CountedScaling:
            m.scaling = dict(scaling)


def watch_lora_layer(layer: nn.Module):
    """A snapshot of what identifies a LoRA ``Linear``'s adapters, for ``lora_layer_unchanged``:
    the ``lora_A`` / ``lora_B`` module dicts and their keys, the scaling dict and a copy of it, each
    adapter's A / B sub-modules and weights with their address. None when the layer is not laid
    out as PEFT's (the caller then compares full signatures). The layer's scaling dict becomes a
    ``CountedScaling`` first (``counted_scaling``), so that its changes are counted from then on."""
    mods_a = getattr(getattr(layer, "lora_A", None), "_modules", None)
    mods_b = getattr(getattr(layer, "lora_B", None), "_modules", None)
    scaling = getattr(layer, "scaling", None)
    if mods_a is None or mods_b is None or not isinstance(scaling, dict):
        return None
    weights = {}
    for name in mods_a:
        if name not in mods_b:
            continue
        ma, mb = mods_a[name], mods_b[name]
        a, b = ma._parameters.get("weight"), mb._parameters.get("weight")
        if a is None or b is None:
            return None
        weights[name] = (ma, a, local(a).data_ptr(), mb, b, local(b).data_ptr())
    scaling = counted_scaling(layer)
    return (mods_a, tuple(mods_a), mods_b, tuple(mods_b), scaling, dict(scaling), weights)


def lora_layer_unchanged(watch, names=None) -> bool:
    """Whether the layer ``watch`` (from ``watch_lora_layer``) still holds the same adapters and
    scalings, and the adapters ``names`` (None: all) the same parameters and storage (values may
    have changed: they are copied at each call)."""
    mods_a, keys_a, mods_b, keys_b, scaling, scaling_then, weights = watch
    if tuple(mods_a) != keys_a or tuple(mods_b) != keys_b or scaling != scaling_then:
        return False
    for name in weights if names is None else names:
        entry = weights.get(name)
        if entry is None:
            continue
        ma, a, pa, mb, b, pb = entry
        if mods_a[name] is not ma or mods_b[name] is not mb:
            return False
        if ma._parameters.get("weight") is not a or mb._parameters.get("weight") is not b:
            return False
        if local(a).data_ptr() != pa or local(b).data_ptr() != pb:
            return False
    return True
