"""PEFT: its LoRA layers' facts (classes, base layers, adapter names, merged / disabled / dropout
states, module registrations), wrapping a model, and its per-call forward hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Dict, List, Optional, Tuple

import peft
import torch
from peft.tuners.lora import layer as _lora_layer
from torch import nn

from .modules import is_dtensor


LoraLayer = _lora_layer.LoraLayer


LoraLinear = _lora_layer.Linear
_PARAM_WRAPPER = getattr(_lora_layer, "ParamWrapper", ())  # PEFT before target_parameters: none


LoraEmbedding = _lora_layer.Embedding


PEFT_VERSION = peft.__version__


def get_peft_model_quietly(model: nn.Module, config, adapter_name: str):
    """PEFT's ``get_peft_model``, without the ``FutureWarning`` that newer transformers gives when
    PEFT (0.21) reads the deprecated ``is_gradient_checkpointing`` while it wraps the model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return peft.get_peft_model(model, config, adapter_name=adapter_name)


def is_lora_layer(module: nn.Module) -> bool:
    return isinstance(module, LoraLayer)


def is_tuner_layer(module: nn.Module) -> bool:
    """A layer of any PEFT tuner (LoRA, LoHa, IA3, ...)."""
    return isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer)


def is_peft_model(model: nn.Module) -> bool:
    return isinstance(model, (peft.PeftModel, peft.tuners.tuners_utils.BaseTuner))


def active_adapter_names(model: nn.Module) -> List[str]:
    """The adapters a forward without ``adapter_names`` applies. A ``PeftModel`` names them in a
    property; a transformers model in a method of its PEFT integration (``load_adapter``), which
    raises where that integration loaded none: then, as for a model with neither, none."""
    active = getattr(model, "active_adapters", None)
    if callable(active):
        try:
            active = active()
        except ValueError:  # transformers: "No adapter loaded"
            return []
    if isinstance(active, str):
        return [active]
    return list(active or ())


def base_layer_of(module: nn.Module) -> nn.Module:
    """The innermost base layer of a PEFT tuner layer (the module itself otherwise)."""
    return module.get_base_layer() if isinstance(module, LoraLayer) else module


def embed_scale(layer: nn.Module) -> Optional[float]:
    """Scale some embeddings (Gemma's) apply in forward; PEFT applies it to the LoRA delta too."""
    getter = getattr(layer, "_get_embed_scale", None)
    scale = getter() if getter is not None else None
    return None if scale is None else float(scale)


def adapter_dicts(layer: nn.Module) -> tuple:
    """The module dicts that hold a LoRA layer's adapters (``lora_A``, ``lora_embedding_A``): their
    sizes summed count its adapters, read again without ``nn.Module`` attribute lookups."""
    return layer.lora_A._modules, layer.lora_embedding_A._modules


def adapter_names_of(layer: nn.Module):
    return set(layer.lora_A.keys()) | set(layer.lora_embedding_A.keys())


def adapter_parameters(layer: nn.Module) -> Dict[str, list]:
    """Each adapter's own parameters in a LoRA layer (A, B, B's bias, DoRA's magnitude, the
    embedding's A and B: PEFT's ``adapter_layer_names`` containers), by adapter name."""
    out: Dict[str, list] = {}
    for container_name in getattr(layer, "adapter_layer_names", ()):
        container = getattr(layer, container_name, None)
        if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
            continue
        for name, entry in container.items():
            params = list(entry.parameters()) if isinstance(entry, nn.Module) else [entry]
            out.setdefault(name, []).extend(p for p in params if p is not None)
    return out


def quantized_base_kind(layer: nn.Module) -> Optional[str]:
    """"nf4", "fp4" or "int8" where ``layer`` is PEFT's LoRA layer over a bitsandbytes base (its
    ``lora.bnb`` classes), "torchao" over a torchao-quantized one (``lora.torchao``): the base
    matmul is the quantization library's own; else None."""
    cls = type(layer)
    if cls.__module__ == "peft.tuners.lora.torchao" and cls.__name__ == "TorchaoLoraLinear":
        return "torchao"
    if cls.__module__ != "peft.tuners.lora.bnb":
        return None
    if cls.__name__ == "Linear8bitLt":
        return "int8"
    if cls.__name__ == "Linear4bit":
        return str(getattr(base_layer_of(layer).weight, "quant_type", None) or "4bit")
    return None


def is_param_wrapper(module: nn.Module) -> bool:
    """PEFT's LoRA over one parameter of a module (``target_parameters``): experts stored as 3-D
    parameters take one such wrapper per targeted parameter, nested."""
    return isinstance(module, _PARAM_WRAPPER)


def param_wrapper_chain(outer: nn.Module) -> Tuple[nn.Module, Dict[str, nn.Module]]:
    """The module under a chain of ``ParamWrapper``s, and the wrapper of each parameter named."""
    wrappers: Dict[str, nn.Module] = {}
    module = outer
    while is_param_wrapper(module):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def expert_factors(wrapper: nn.Module, adapter: str) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """An adapter's factors on an expert parameter as PEFT holds them (``split_expert_factors``
    gives each expert's), and its scaling."""
    return wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight, float(wrapper.scaling[adapter])


def split_expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PEFT's A (experts * r, in), expert-major, and B (out, r * experts), expert-minor (as its
    layers and saved files hold them), as per-expert views A (experts, r, in), B (experts, out, r)."""
    return a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)


def expert_layout_blocker(experts: nn.Module, wrappers: Dict[str, nn.Module]) -> Optional[str]:
    """Why fastlora cannot serve LoRA on these experts (None: it can). It serves transformers'
    fused 3-D experts stored (experts, out, in), gate and up concatenated, no biases, the default
    gate (``act_fn(gate) * up``), with LoRA on ``gate_up_proj`` and/or ``down_proj``."""
    kind = type(experts).__name__
    other = sorted(set(wrappers) - {"gate_up_proj", "down_proj"})
    if other:
        return f"LoRA on {kind}.{', '.join(other)} (fastlora serves gate_up_proj and down_proj)"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3 and hasattr(experts, "act_fn")):
        return f"{kind} does not keep its experts as 3-D gate_up_proj and down_proj parameters"
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}
    odd = [f"{k}={getattr(experts, k)}" for k, want in layout.items() if getattr(experts, k, want) != want]
    if odd:
        return f"{kind} with {', '.join(odd)}"
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        return f"{kind} has its own gate function"
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return f"{kind}'s gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not pair"
    if is_dtensor(gate_up) or is_dtensor(down):
        return f"{kind}'s experts sharded by tensor parallelism"
    if type(gate_up) is not nn.Parameter or type(down) is not nn.Parameter:
        return f"{kind}'s expert weights are not plain tensors"
    for name, w in wrappers.items():
        if getattr(w, "_did_swap_in_out_features", None) is not True:
            return f"PEFT's {name} wrapper does not read {kind}'s weights as (experts, out, in)"
    return None


def unsupported_reason(layer: nn.Module, adapter: str) -> Optional[str]:
    """Why fastlora cannot compute this adapter in this layer (PEFT's own path then serves it):
    a LoRA variant other than DoRA (``compat.adapters.adapter_blocker`` judges DoRA)."""
    if getattr(layer, "use_dora", {}).get(adapter, False):
        return None
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None:
        return f"LoRA variant {type(variant).__name__}"
    return None


def config_variants(config) -> List[str]:
    """The LoRA variants other than DoRA that ``config`` asks for, as PEFT's ``LoraConfig`` tags them
    (a field marked ``is_lora_variant`` that is set, or an ``init_lora_weights`` value listed under
    ``lora_variants``): a new PEFT release's variants are found without a list kept here."""
    found = []
    for f in dataclasses.fields(config) if dataclasses.is_dataclass(config) else ():
        value = getattr(config, f.name, None)
        if f.name == "use_dora" or value is None or value is False:
            continue
        if f.metadata.get("is_lora_variant"):
            found.append(f.name)
        elif isinstance(value, str) and value in f.metadata.get("lora_variants", ()):
            found.append(f"{f.name}={value!r}")
    return found


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


_REGISTRATIONS = [0]


_REGISTRATION_HOOKS: list = []


def registration_epoch() -> int:
    """A counter of module and parameter registrations anywhere in the process (PyTorch's global
    registration hooks, installed at the first call): a module or parameter of a model can be
    replaced only by registering another, so while it stays the same nothing was replaced.
    Registrations into index containers (``nn.ModuleList``, ``nn.Sequential``) are not counted:
    slicing one builds a new container at every forward (transformers' decoder loop), and the
    adapters' modules live in ``ModuleDict``s and LoRA layers."""
    if not _REGISTRATION_HOOKS:
        from torch.nn.modules import module as torch_module

        def bump(module, name, value):  # returns None: the registered value is kept
            if not isinstance(module, (nn.ModuleList, nn.Sequential)):
                _REGISTRATIONS[0] += 1

        _REGISTRATION_HOOKS.append(torch_module.register_module_parameter_registration_hook(bump))
        _REGISTRATION_HOOKS.append(torch_module.register_module_module_registration_hook(bump))
    return _REGISTRATIONS[0]


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers (or plain torch) model inside a PeftModel / LoraModel, else the model."""
    inner = model
    if isinstance(inner, peft.PeftModel):
        inner = inner.base_model
    if isinstance(inner, peft.tuners.tuners_utils.BaseTuner):
        inner = inner.model
    return inner


_HOOK_GUARD = "_enable_peft_forward_hooks"


def guard_peft_forward_hooks(peft_model: nn.Module, serve=None) -> bool:
    """Make PEFT remove its per-call ``adapter_names`` hooks when the call raises, and let
    fastlora take the call instead where it serves every layer that would get them.

    PEFT registers forward pre-hooks on every LoRA layer for a call with ``adapter_names`` and
    removes them only when the call returns (its context manager has no ``finally``:
    huggingface/peft#3475), so after any error inside the call (an unknown adapter, too many
    adapters for fastlora's batch) the stale hooks break every later call. This wraps the context
    manager on this model instance: on an exception, hooks added during the call are removed.

    ``serve(kwargs)``: a context manager that takes the call's adapter names in PEFT's place, or
    None to let PEFT do it. PEFT walks every module of the model to check the names and to hook
    every LoRA layer, at each call: its cost grows with the adapters loaded.
    Returns False when the model has no such context manager (nothing to guard).
    """

    original = getattr(peft_model, _HOOK_GUARD, None)
    if original is None or _HOOK_GUARD in peft_model.__dict__:
        return False
    layers = [m for m in peft_model.modules() if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]

    @contextlib.contextmanager
    def guarded(*args, **kwargs):
        scope = serve(kwargs) if serve is not None else None
        if scope is not None:
            with scope:
                yield
            return
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


def has_auxiliary_wrappers(model: nn.Module) -> bool:
    """PEFT's ``modules_to_save`` / trainable-token wrappers (they take ``adapter_names`` too)."""
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # a PEFT without them
        return False
    return any(isinstance(m, AuxiliaryTrainingWrapper) for m in model.modules())


def unguard_peft_forward_hooks(peft_model: nn.Module) -> None:
    peft_model.__dict__.pop(_HOOK_GUARD, None)
