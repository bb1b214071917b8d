"""Adapters registered by name (``fastlora.register_adapter``), held in CPU memory.

A saved PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors`` or
``adapter_model.bin``) or a state dict with its ``LoraConfig`` becomes a ``StoredAdapter``: each
targeted module's A, B and scaling, in the model's dtype, in pinned memory where the model is on
CUDA. No PEFT module is built for it; the pools copy it into a GPU slot when a call uses it
(``SitePool.load``). Everything is validated before anything is kept: the config (LoRA, with a
bias on B or DoRA on linear layers; no other variants, ``modules_to_save``, rank or alpha
patterns), every key (the format PEFT saves: ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``,
``<module>.lora_B.bias`` with ``lora_bias``, ``<module>.lora_magnitude_vector`` with DoRA, and
``lora_embedding_A`` / ``lora_embedding_B`` for an embedding), that each targeted module is a LoRA
layer fastlora serves, and every shape against that layer's base.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import torch
from safetensors.torch import load_file
from torch import nn
from peft import LoraConfig

from ..compat.peft import LoraEmbedding, base_layer_of, config_variants, embed_scale, is_param_wrapper
from ..compat.tensor_parallel import full_shape_in_out, full_weight, tp_style

CONFIG_FILE = "adapter_config.json"
# ``from_folders``' PEFT adapter of rank 1 and zero weights that makes the LoRA layers: served (it
# changes nothing) but not one of the user's adapters, so reports leave it out
SCAFFOLD_ADAPTER = "fastlora_layers"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "A", ".lora_embedding_B": "B",
             ".lora_B.bias": "bias", ".lora_magnitude_vector": "magnitude"}
# LoraConfig fields whose non-default values fastlora's kernels do not compute
_REFUSED = {"modules_to_save": "modules_to_save",
            "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern",
            "trainable_token_indices": "trainable_token_indices",
            "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)", "use_qalora": "QALoRA",
            "layer_replication": "layer_replication"}


@dataclass
class StoredAdapter:
    """One registered adapter: module name (as in the PeftModel) -> (A (r, in), B (out, r), scaling)."""

    name: str
    source: str
    modules: Dict[str, Tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    # the one host buffer every A and B is a view of (a load copies it to the GPU whole), or None
    buffer: Optional[torch.Tensor] = None
    # module -> {"bias": B's bias (out,)} with lora_bias, {"magnitude": DoRA's (out,)} with DoRA
    extras: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for a, b, _ in self.modules.values() for t in (a, b))
                + sum(t.numel() * t.element_size() for ex in self.extras.values() for t in ex.values()))


def read_folder(path: str):
    """(LoraConfig, state dict, weight file) of a saved PEFT adapter folder."""

    if not os.path.isdir(path):
        raise FileNotFoundError(f"fastlora.register_adapter: {path!r} is not a folder (a saved PEFT adapter)")
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"fastlora.register_adapter: {path!r} has no {CONFIG_FILE}")
    with open(config_file) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"fastlora.register_adapter: {config_file}: not valid JSON ({e})") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"fastlora.register_adapter: {config_file}: peft_type {raw.get('peft_type')!r}; "
                         "fastlora serves LoRA adapters only")
    try:
        config = LoraConfig.from_pretrained(path)
    except Exception as e:  # PEFT's own validation of the fields
        raise ValueError(f"fastlora.register_adapter: {config_file}: {e}") from None
    for name in WEIGHT_FILES:
        weight_file = os.path.join(path, name)
        if os.path.isfile(weight_file):
            break
    else:
        raise FileNotFoundError(f"fastlora.register_adapter: {path!r} has none of {', '.join(WEIGHT_FILES)}")
    try:
        if weight_file.endswith(".safetensors"):
            state_dict = load_file(weight_file)
        else:
            state_dict = torch.load(weight_file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"fastlora.register_adapter: {weight_file}: cannot be read ({e})") from None
    return config, state_dict, weight_file


def _refused(config) -> Optional[str]:
    if str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "LORA"))).upper() != "LORA":
        return f"peft_type {config.peft_type!r} (LoRA only)"
    for attr, label in _REFUSED.items():
        if getattr(config, attr, None):
            return label
    variants = config_variants(config)
    return f"the LoRA variant {variants[0]}" if variants else None


def _check_saved_base(key: str, tensor: torch.Tensor, layer: nn.Module, source: str) -> None:
    """PEFT saves a targeted embedding's base weights with the adapter (``save_embedding_layers``);
    loading them would change the base model under every adapter, so they must be the model's own."""
    weight = full_weight(base_layer_of(layer).weight.detach())
    if tensor.shape != weight.shape or not torch.equal(tensor.to("cpu", weight.dtype), weight.cpu()):
        raise ValueError(f"fastlora.register_adapter: {source}: {key!r} differs from the model's own weights "
                         f"(an adapter saved with its own embedding layer would change the base model for "
                         f"every adapter)")


def build_stored(name: str, config, state_dict: Mapping[str, torch.Tensor], source: str,
                 layers: Mapping[str, nn.Module], dtype: torch.dtype, pin: bool) -> StoredAdapter:
    """Validate ``state_dict`` against the LoRA layers fastlora serves (module name -> layer) and
    return the adapter, copied to CPU in ``dtype``; raises ``ValueError`` naming ``source``."""
    why = _refused(config)
    if why is not None:
        raise ValueError(f"fastlora.register_adapter: {source}: {why} is not supported")
    wanted = {"bias": bool(getattr(config, "lora_bias", False)), "magnitude": bool(getattr(config, "use_dora", False))}
    pieces: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        if key.endswith(".base_layer.weight") and key[: -len(".base_layer.weight")] in layers:
            _check_saved_base(key, tensor, layers[key[: -len(".base_layer.weight")]], source)
            continue
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None or (_SUFFIXES[suffix] in wanted and not wanted[_SUFFIXES[suffix]]):
            raise ValueError(f"fastlora.register_adapter: {source}: unexpected key {key!r} (expected PEFT's "
                             f"saved format: <module>.lora_A.weight / <module>.lora_B.weight, with "
                             f"<module>.lora_B.bias for lora_bias, <module>.lora_magnitude_vector for DoRA)")
        module = key[: -len(suffix)]
        if module not in layers:
            raise ValueError(f"fastlora.register_adapter: {source}: {key!r} targets {module!r}, which is not a "
                             f"LoRA layer fastlora serves in this model (its PEFT adapters must target every "
                             f"module a registered adapter targets)")
        embedding = isinstance(layers[module], LoraEmbedding)
        if embedding and _SUFFIXES[suffix] in wanted:
            kind = "DoRA" if _SUFFIXES[suffix] == "magnitude" else "lora_bias"
            raise ValueError(f"fastlora.register_adapter: {source}: {key!r}: {kind} on an embedding is not supported")
        if _SUFFIXES[suffix] in wanted and tp_style(layers[module]) is not None:
            kind = "DoRA" if _SUFFIXES[suffix] == "magnitude" else "lora_bias"
            raise ValueError(f"fastlora.register_adapter: {source}: {key!r}: {kind} under tensor parallelism "
                             "is not supported")
        if embedding != suffix.startswith(".lora_embedding") and _SUFFIXES[suffix] not in wanted:
            raise ValueError(f"fastlora.register_adapter: {source}: {key!r} does not fit {module!r} "
                             f"({'an embedding' if embedding else 'a linear layer'})")
        pieces.setdefault(module, {})[_SUFFIXES[suffix]] = tensor
    if not pieces:
        raise ValueError(f"fastlora.register_adapter: {source}: no LoRA weights")
    modules, extras = {}, {}
    for module, ab in sorted(pieces.items()):
        missing = {"A", "B"} - set(ab)
        if missing:
            raise ValueError(f"fastlora.register_adapter: {source}: {module!r} has no lora_{missing.pop()} weight")
        for kind, key in (("bias", "lora_B.bias"), ("magnitude", "lora_magnitude_vector")):
            if wanted[kind] and kind not in ab:
                raise ValueError(f"fastlora.register_adapter: {source}: {module!r} has no {key} "
                                 f"(its config has {'use_dora' if kind == 'magnitude' else 'lora_bias'})")
        layer = layers[module]
        a, b = ab["A"], ab["B"]
        experts = layer.num_experts if is_param_wrapper(layer) else 1  # routed experts: A (E*r, in), B (out, E*r)
        if experts > 1 and set(ab) - {"A", "B"}:
            raise ValueError(f"fastlora.register_adapter: {source}: {module!r}: a bias or DoRA on expert weights "
                             "is not supported")
        if experts > 1:
            fan_in, fan_out = layer.in_features, layer.out_features
        else:
            fan_in, fan_out = full_shape_in_out(base_layer_of(layer))  # the whole layer's, under TP too
        r = a.shape[0] // experts if a.dim() == 2 and a.shape[0] % experts == 0 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r * experts) or r < 1:
            rows = "r" if experts == 1 else f"{experts} x r"
            raise ValueError(
                f"fastlora.register_adapter: {source}: {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"its base layer takes A ({rows}, {fan_in}) and B ({fan_out}, {rows})")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"fastlora.register_adapter: {source}: {module!r} holds {a.dtype} / {b.dtype} weights")
        scaling = config.lora_alpha / (math.sqrt(r) if getattr(config, "use_rslora", False) else r)
        if isinstance(layer, LoraEmbedding):
            scaling *= embed_scale(layer) or 1.0
        for kind in ("bias", "magnitude"):
            if kind in ab:
                t = ab[kind]
                if t.shape != (fan_out,) or not t.is_floating_point():
                    raise ValueError(f"fastlora.register_adapter: {source}: {module!r} has a {kind} of "
                                     f"{tuple(t.shape)} {t.dtype}; its base layer takes ({fan_out},)")
                # the bias in the stacks' dtype; DoRA's magnitude in float32, as PEFT keeps it
                extras.setdefault(module, {})[kind] = t.detach().to(
                    "cpu", dtype if kind == "bias" else torch.float32).contiguous()
        a, b = (t.detach().to("cpu", dtype).contiguous() for t in (a, b))
        modules[module] = (a, b, float(scaling))
    modules = _in_one_buffer(modules, pin)
    return StoredAdapter(name, source, modules, _buffer_of(modules), extras)


def _buffer_of(modules) -> Optional[torch.Tensor]:
    """The adapter's storage as one 1-D tensor, where all its tensors are views of it and it holds
    little else (a state dict's views of a larger file are left alone)."""
    tensors = [t for a, b, _ in modules.values() for t in (a, b)]
    storage = tensors[0].untyped_storage()
    numel = storage.nbytes() // tensors[0].element_size()
    if (any(t.untyped_storage().data_ptr() != storage.data_ptr() or t.dtype != tensors[0].dtype for t in tensors)
            or numel > 1.1 * sum(t.numel() for t in tensors)):
        return None
    return tensors[0].as_strided((numel,), (1,), 0)


def _in_one_buffer(modules, pin: bool):
    """The adapter's tensors as views of one buffer (pinned where ``pin``), so that a load moves it
    to the GPU in one copy (``host_copy``); kept as they are where they already are such views."""
    tensors = [t for a, b, _ in modules.values() for t in (a, b)]
    if len({t.untyped_storage().data_ptr() for t in tensors}) == 1 and (not pin or all(t.is_pinned() for t in tensors)):
        return modules
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=pin)
    out, at = {}, 0
    for module, (a, b, scaling) in modules.items():
        views = []
        for t in (a, b):
            views.append(flat[at: at + t.numel()].view(t.shape).copy_(t))
            at += t.numel()
        out[module] = (views[0], views[1], scaling)
    return out
