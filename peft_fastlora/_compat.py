"""Every access to private parts of PEFT, transformers and torch, and every difference between
their versions, in one place. The rest of the package asks these helpers.

Each helper checks what it relies on (a feature probe) and, where that no longer holds, either
says so in a clear error naming the version, or answers so that fastlora leaves the feature to
PEFT / transformers (with the reason in the patch report).

Sections: wrapping a model in PEFT; PEFT's LoRA layers; transformers' decode step, attention
registry and static cache; torch's CUDA-graph memory pools and generator states; PEFT's forward
hooks after an error.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from typing import Dict, NamedTuple, Optional, Tuple

import peft
import torch
import transformers
from peft.tuners.lora import layer as _lora_layer
from torch import nn
from transformers.pytorch_utils import Conv1D

LoraLayer = _lora_layer.LoraLayer
LoraLinear = _lora_layer.Linear
LoraEmbedding = _lora_layer.Embedding
TRANSFORMERS_VERSION = transformers.__version__
PEFT_VERSION = peft.__version__
_LORA_ATTRS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "scaling", "use_dora",
               "merged_adapters", "disable_adapters")


# ---- PEFT: wrapping a model ----------------------------------------------------------------------
def get_peft_model_quietly(model: nn.Module, config, adapter_name: str):
    """PEFT's ``get_peft_model``, without the ``FutureWarning`` that newer transformers gives when
    PEFT (0.21) reads the deprecated ``is_gradient_checkpointing`` while it wraps the model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        return peft.get_peft_model(model, config, adapter_name=adapter_name)


# ---- PEFT: LoRA layers ---------------------------------------------------------------------------
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


# ---- torch / transformers: tensor parallelism -----------------------------------------------------
# transformers' TP shards a layer's weight as a DTensor and replaces the layer's forward (its
# collectives inside); PEFT (>= 0.21.2) shards each adapter the way its base layer is sharded.
# fastlora serves LoRA Linears over column- and row-sharded layers from each rank's shards, fuses
# siblings within a rank and captures the collectives in its decode graphs; other plans and
# per-request continuous batching stay on PEFT's and transformers' own paths (the report says).
TP_REASON = "tensor parallel: not yet on fastlora's path"  # other plans, continuous batching


_DTENSOR = None  # the DTensor class, imported once (checked on every LoRA forward)


def is_dtensor(t) -> bool:
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch without distributed tensors: nothing is one
            DTensor = ()
        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


# which dim of the sharded adapter weight each plan splits (B's rows, A's columns), and of the base
# weight (the embedding's weight is (vocab, dim))
_TP_SHARD_DIM = {"colwise": 0, "rowwise": 1, "colwise_gather": 0, "vocab": 1}
_TP_BASE_DIM = {"colwise": 0, "rowwise": 1, "colwise_gather": 0, "vocab": 0}


def declared_tp_plans(model: nn.Module) -> Dict[int, str]:
    """id(module) -> the style the model's ``tp_plan`` declares for it (patterns with ``*`` for a
    layer index, names relative to the transformers model). transformers 5.24 also marks each
    sharded module (``_hf_tp_plan``); 5.17 does not, and only the plan tells a gathered LM head
    from a plain column-sharded layer."""
    import re

    inner = unwrap_peft(model)
    plan = getattr(inner, "tp_plan", None) or {}
    if not isinstance(plan, dict) or not plan:
        return {}
    rules = [(re.compile(re.escape(p).replace(r"\*", r"[^.]+") + r"$"), style) for p, style in plan.items()]
    out = {}
    for name, m in inner.named_modules():
        for rule, style in rules:
            if rule.match(name):
                out[id(m)] = style
                break
    return out


def tp_style(layer: nn.Module, declared: Optional[str] = None) -> Optional[str]:
    """How transformers' TP shards this LoRA layer's base, where fastlora can serve its adapters
    from this rank's shards; None otherwise (not sharded, or a layout fastlora does not serve):

    - "colwise" / "rowwise": an ``nn.Linear`` sharded by output rows / input columns;
    - "colwise_gather": an ``nn.Linear`` sharded by output rows whose output is gathered
      (``colwise_gather_output``: the LM head);
    - "vocab": an ``nn.Embedding`` sharded by vocabulary rows (each rank looks up its ids, the
      ranks' lookups are summed).

    Adapters come sharded by PEFT to match the base layer (B by rows, or A by columns, as DTensors
    or plain local tensors: PEFT >= 0.21.2), or whole on every rank (older PEFT, whose own forward
    then fails on the sharded base); ``lora_weights`` then takes this rank's slice. ``declared``:
    the model's plan for the layer (``declared_tp_plans``) where its base does not carry one."""
    base = base_layer_of(layer)
    if not is_dtensor(getattr(base, "weight", None)):
        return None
    dims = [getattr(p, "dim", None) for p in base.weight.placements]
    declared = getattr(base, "_hf_tp_plan", None) or declared
    if type(layer) is LoraEmbedding and type(base) is nn.Embedding:
        plain = base.max_norm is None and not base.sparse and embed_scale(layer) is None
        plan, sharded = ("vocab", "lora_embedding_A") if dims == [0] and plain else (None, None)
    elif type(layer) is LoraLinear and type(base) is nn.Linear:
        plan = {0: "colwise", 1: "rowwise"}.get(dims[0]) if len(dims) == 1 else None
        if plan == "colwise" and declared == "colwise_gather_output":
            plan = "colwise_gather"
        elif declared is not None and declared != plan:
            plan = None
        sharded = "lora_B" if plan in ("colwise", "colwise_gather") else "lora_A"
    else:
        return None
    if plan is None or tp_shard_range(base.weight) is None:
        return None
    d = _TP_SHARD_DIM[plan]
    full, mine = base.weight.shape[_TP_BASE_DIM[plan]], local(base.weight).shape[_TP_BASE_DIM[plan]]
    for which in (("lora_embedding_A", "lora_embedding_B") if plan == "vocab" else ("lora_A", "lora_B")):
        for name, entry in getattr(layer, which).items():
            w = entry if isinstance(entry, torch.Tensor) else entry.weight
            if is_dtensor(w) and which != sharded:
                return None
            if which == sharded and not is_dtensor(w) and w.shape[d] not in (full, mine):
                return None
    return plan


def tp_shard_range(weight) -> Optional[Tuple[int, int]]:
    """(start, length) of this rank's shard along a ``Shard(d)`` DTensor's sharded dim (torch's
    chunking: ceil(n / ranks) each, the last ones shorter); None if the local shard disagrees."""
    (placement,) = weight.placements
    d = placement.dim
    n, ranks = weight.shape[d], weight.device_mesh.size()
    chunk = -(-n // ranks)
    start = min(weight.device_mesh.get_local_rank() * chunk, n)
    length = weight.to_local().shape[d]
    return (start, length) if length == min(chunk, n - start) else None


def _tp_local_adapter(layer: nn.Module, which: str, w: torch.Tensor) -> torch.Tensor:
    """This rank's part of an adapter weight: a DTensor's shard, a local shard as PEFT left it, or
    the slice of a whole weight matching the base layer's shard (B's rows for colwise plans, A's
    columns for rowwise and the embedding's vocabulary)."""
    if is_dtensor(w):
        return w.to_local()
    base_w = getattr(base_layer_of(layer), "weight", None)
    if not is_dtensor(base_w):
        return w
    plan = tp_style(layer)
    if (plan, which) not in (("colwise", "B"), ("colwise_gather", "B"), ("rowwise", "A"), ("vocab", "A")):
        return w
    start, length = tp_shard_range(base_w)
    d = _TP_SHARD_DIM[plan]
    return w if w.shape[d] == length and base_w.shape[_TP_BASE_DIM[plan]] != length else w.narrow(d, start, length)


def tp_group(layer: nn.Module):
    """The process group of a tensor-parallel layer's shards (transformers' choice of group)."""
    mesh = base_layer_of(layer).weight.device_mesh
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def tp_rowwise_partial(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """This rank's partial sum of a rowwise layer's output: its input columns times its weight
    shard, no bias (transformers' local inference path adds the bias once, after the reduce)."""
    return torch.nn.functional.linear(x, local(base.weight))


def tp_rowwise_finish(base: nn.Module, partial: torch.Tensor, group) -> torch.Tensor:
    """The rowwise layer's output from the ranks' partial sums: transformers' local inference path
    (all-reduce, then the replicated bias), the same on transformers 5.17 and 5.24."""
    torch.distributed.all_reduce(partial, group=group)
    bias = base._parameters.get("bias")
    return partial if bias is None else partial + local(bias)


def tp_rowwise_finish_columns(base: nn.Module, partial: torch.Tensor, n: int, group) -> torch.Tensor:
    """``tp_rowwise_finish`` of a partial whose first ``n`` columns are the layer's output (more
    columns follow, reduced with them in the same all-reduce); returns the whole tensor."""
    torch.distributed.all_reduce(partial, group=group)
    bias = base._parameters.get("bias")
    if bias is not None:
        partial[:, :n] += local(bias)
    return partial


def full_shape_in_out(base: nn.Module) -> Tuple[int, int]:
    """(in, out) of the whole layer, sharded by TP or not (a registered adapter is saved whole)."""
    if isinstance(base, nn.Linear) and is_dtensor(base.weight):
        out_features, in_features = base.weight.shape
        return in_features, out_features
    if isinstance(base, nn.Embedding):
        return base.weight.shape[0], base.weight.shape[1]
    return linear_in_out(base)


def full_weight(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a TP-sharded weight (a collective: every rank must call it)."""
    return t.full_tensor() if is_dtensor(t) else t


def tp_local_stored(layer: nn.Module, plan: Optional[str], a: torch.Tensor, b: torch.Tensor):
    """This rank's part of a whole adapter (A, B) registered for a layer TP shards with ``plan``
    (``tp_style``): B's rows for column-sharded layers, A's columns for row-sharded ones and the
    vocabulary-sharded embedding; contiguous copies (pinned where the whole was)."""
    if plan is None:
        return a, b
    start, length = tp_shard_range(base_layer_of(layer).weight)
    if plan in ("colwise", "colwise_gather"):
        b = b.narrow(0, start, length)
    else:
        a = a.narrow(1, start, length)
    return tuple(t.contiguous().pin_memory() if t.is_pinned() and not t.is_contiguous() else t.contiguous()
                 for t in (a, b))


def tp_gather_partial(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """This rank's output columns of a ``colwise_gather_output`` layer (its rows of the weight and
    of the bias), before the gather."""
    bias = base._parameters.get("bias")
    return torch.nn.functional.linear(x, local(base.weight), None if bias is None else local(bias))


def tp_gather_finish(base: nn.Module, partial: torch.Tensor, group) -> torch.Tensor:
    """The full output of a ``colwise_gather_output`` layer from the ranks' columns (torch's
    chunking: equal chunks, the last ones shorter, padded for the all-gather)."""
    start, length = tp_shard_range(base.weight)
    full = base.weight.shape[0]
    ranks = torch.distributed.get_world_size(group)
    chunk = -(-full // ranks)
    if length < chunk:
        partial = torch.nn.functional.pad(partial, (0, chunk - length))
    parts = [torch.empty_like(partial) for _ in range(ranks)]
    torch.distributed.all_gather(parts, partial.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :full]


def tp_vocab_ids(base: nn.Module, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(this rank's local ids, which of them it holds, its vocabulary length) for an embedding
    sharded by vocabulary rows; ids it does not hold become the length (past its shard)."""
    start, length = tp_shard_range(base.weight)
    loc = ids - start
    inside = (loc >= 0) & (loc < length)
    return torch.where(inside, loc, torch.full_like(loc, length)), inside, length


def tp_vocab_partial(base: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """This rank's part of a vocabulary-sharded embedding's output: its rows for the ids it holds,
    zeros for the others (the ranks' parts are then summed)."""
    loc, inside, length = tp_vocab_ids(base, ids)
    rows = torch.nn.functional.embedding(loc.clamp_max(length - 1), local(base.weight))
    return rows * inside.unsqueeze(-1).to(rows.dtype)


def tp_sum(partial: torch.Tensor, group) -> torch.Tensor:
    torch.distributed.all_reduce(partial, group=group)
    return partial


def repoint_local(param: torch.Tensor, storage: torch.Tensor) -> None:
    """Make a parameter (or a DTensor parameter's local shard, in place: transformers' TP forward
    reads it there) use ``storage`` (same shape and dtype)."""
    target = param._local_tensor if is_dtensor(param) else param
    target.data = storage


def tp_colwise_mesh(weight):
    """The device mesh of a weight column-sharded by TP (Shard(0) over one mesh dim), else None."""
    if not is_dtensor(weight) or not hasattr(weight, "_local_tensor"):
        return None
    dims = [getattr(p, "dim", None) for p in weight.placements]
    return weight.device_mesh if dims == [0] else None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if is_dtensor(t) else t


def multi_device_reason(model: nn.Module) -> Optional[str]:
    """Why a model split over several devices (accelerate's ``device_map``) cannot take the decode
    graphs and base-model kernels (None: its parameters are on one device)."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        return f"the model spans {', '.join(devices)} (accelerate's device_map)"
    return None


def on_device(device: Optional[torch.device]):
    """Make ``device`` the current CUDA device inside the block (Triton launches on the current
    device, not on its tensors'); a no-op for other devices."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def on_stream(stream):
    """Make ``stream`` the current CUDA stream inside the block; a no-op for None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def tp_size(model: nn.Module) -> int:
    """How many ranks transformers' tensor parallelism split this model over (1: not split)."""
    size = getattr(model, "_tp_size", None)
    if size:
        return int(size)
    mesh = getattr(model, "_device_mesh", None)
    return int(mesh.size()) if mesh is not None else 1


def tp_graph_blocker(model: nn.Module) -> Optional[str]:
    """Why decode graphs cannot serve this tensor-parallel model (None: they can, or it is not
    sharded): the cache layout assumes k/v heads split evenly over the ranks."""
    size = tp_size(model)
    if size == 1:
        return None
    cfg = model.config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if kv_heads % size:
        return f"tensor parallel: {kv_heads} key/value heads do not split over {size} ranks"
    return None


def tensor_parallel_reason(model: nn.Module) -> Optional[str]:
    """TP_REASON when the model is sharded by transformers' tensor parallelism, else None."""
    if getattr(model, "_device_mesh", None) is not None or any(is_dtensor(p) for p in model.parameters()):
        return TP_REASON
    return None


def is_lora_layer(module: nn.Module) -> bool:
    return isinstance(module, LoraLayer)


def is_tuner_layer(module: nn.Module) -> bool:
    """A layer of any PEFT tuner (LoRA, LoHa, IA3, ...)."""
    return isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer)


def is_peft_model(model: nn.Module) -> bool:
    return isinstance(model, (peft.PeftModel, peft.tuners.tuners_utils.BaseTuner))


def base_layer_of(module: nn.Module) -> nn.Module:
    """The innermost base layer of a PEFT tuner layer (the module itself otherwise)."""
    return module.get_base_layer() if isinstance(module, LoraLayer) else module


def has_forward_hooks(module: nn.Module) -> bool:
    """Forward hooks on this module that a fused or folded GEMM, which bypasses its forward, would
    skip: torch's, and accelerate's except the one ``device_map`` without offloading puts on every
    layer, which only moves the inputs to the device the weights are on (fastlora's sites take their
    fast path only for inputs already there)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and not _only_moves_inputs_to_weights(module, hook)


def _only_moves_inputs_to_weights(module: nn.Module, hook) -> bool:
    try:
        from accelerate.hooks import AlignDevicesHook
    except ImportError:
        return False
    if type(hook) is not AlignDevicesHook or hook.offload or hook.io_same_device or hook.execution_device is None:
        return False
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return False
    try:
        return torch.device(hook.execution_device) == weight.device
    except (TypeError, RuntimeError):
        return False


def is_conv1d(module: nn.Module) -> bool:
    return isinstance(module, Conv1D)


def linear_in_out(base: nn.Module) -> Tuple[int, int]:
    """(in, out) of this rank's weight (a tensor-parallel layer's shard)."""
    if isinstance(base, nn.Linear):
        out_features, in_features = local(base.weight).shape
        return in_features, out_features
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
            out[name] = (_tp_local_adapter(layer, "A", layer.lora_embedding_A[name]),
                         layer.lora_embedding_B[name], float(layer.scaling[name]) * scale)
        return out
    for name in layer.lora_A.keys():
        if name not in layer.lora_B:
            continue
        out[name] = (_tp_local_adapter(layer, "A", layer.lora_A[name].weight),
                     _tp_local_adapter(layer, "B", layer.lora_B[name].weight), float(layer.scaling[name]))
    return out


def adapter_count(layer: nn.Module) -> int:
    """How many adapters a LoRA layer holds (Linear and Embedding kinds together)."""
    return len(layer.lora_A) + len(layer.lora_embedding_A)


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


def watch_lora_layer(layer: nn.Module):
    """A snapshot of what identifies a LoRA ``Linear``'s adapters, for ``lora_layer_unchanged``:
    the ``lora_A`` / ``lora_B`` module dicts and their keys, the scaling dict and a copy of it, each
    adapter's A / B sub-modules and weights with their address. None when the layer is not laid
    out as PEFT's (the caller then compares full signatures)."""
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
    return (mods_a, tuple(mods_a), mods_b, tuple(mods_b), scaling, dict(scaling), weights)


_REGISTRATIONS = [0]
_REGISTRATION_HOOKS: list = []


def registration_epoch() -> int:
    """A counter of module and parameter registrations anywhere in the process (PyTorch's global
    registration hooks, installed at the first call): a module or parameter of a model can be
    replaced only by registering another, so while it stays the same nothing was replaced."""
    if not _REGISTRATION_HOOKS:
        from torch.nn.modules import module as torch_module

        def bump(module, name, value):  # returns None: the registered value is kept
            _REGISTRATIONS[0] += 1

        _REGISTRATION_HOOKS.append(torch_module.register_module_parameter_registration_hook(bump))
        _REGISTRATION_HOOKS.append(torch_module.register_module_module_registration_hook(bump))
    return _REGISTRATIONS[0]


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


# ---- transformers: decode-step kwargs (used by the CUDA-graph runner) -----------------------
_FORWARD_PARAMS: dict = {}  # forward function -> its parameter names (signatures do not change)


def forward_accepts(model: nn.Module, name: str) -> bool:
    # asked at every decode step (the runner finds the step's cache by its kwarg), and
    # inspect.signature costs more host time than the rest of the step's bookkeeping
    fn = getattr(model.forward, "__func__", model.forward)
    params = _FORWARD_PARAMS.get(fn)
    if params is None:
        try:
            params = frozenset(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            params = frozenset()
        _FORWARD_PARAMS[fn] = params
    return name in params


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


# ---- transformers: functions a hub kernel may replace ----------------------------------------------
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


# ---- transformers: attention implementations -------------------------------------------------
def attn_implementation(model: nn.Module) -> Optional[str]:
    """The model's ``config._attn_implementation`` (None for a model without a transformers config)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) if cfg is not None else None


def set_attn_implementation(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # older transformers: the config attribute is the switch
        model.config._attn_implementation = name


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


# ---- torch: the flash-attention varlen kernel bundled with PyTorch ---------------------------
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


@contextlib.contextmanager
def compiled_call_override(model: nn.Module, step):
    """Within the block, HF ``generate`` runs its decode steps through ``step``.

    ``GenerationMixin`` calls ``self.get_compiled_call(compile_config)`` for the forward of each
    decode step when ``self._valid_auto_compile_criteria(...)`` holds (a static cache is in use);
    both are overridden on this instance only and removed on exit.
    """
    for name in ("get_compiled_call", "_valid_auto_compile_criteria"):
        if not callable(getattr(type(model), name, None)):
            raise RuntimeError(
                f"fastlora: transformers {TRANSFORMERS_VERSION} has no GenerationMixin.{name}; "
                "decode graphs cannot hook into generate (patch with cuda_graphs=False)")
    model.get_compiled_call = lambda compile_config=None: step
    model._valid_auto_compile_criteria = lambda model_kwargs, generation_config: True
    try:
        yield
    finally:
        model.__dict__.pop("get_compiled_call", None)
        model.__dict__.pop("_valid_auto_compile_criteria", None)


@contextlib.contextmanager
def mask_builder_override(model: nn.Module, builder):
    """Within the block, ``generate`` builds each step's 4-D mask with ``builder`` (it looks up
    ``self.create_masks_for_generate`` first, then transformers' function; a class with its own
    is left alone). ``builder`` takes transformers' keyword arguments."""
    from transformers.generation import utils as gen_utils

    if (getattr(type(model), "create_masks_for_generate", None) is not None
            or not callable(getattr(gen_utils, "create_masks_for_generate", None))):
        yield
        return
    model.create_masks_for_generate = builder
    try:
        yield
    finally:
        model.__dict__.pop("create_masks_for_generate", None)


def transformers_mask_builder():
    from transformers.generation import utils as gen_utils

    return gen_utils.create_masks_for_generate


class StepMaskSpec(NamedTuple):
    """How transformers builds a config's one-token decode masks (``step_mask_spec``)."""

    keys: Optional[Tuple[str, ...]]  # layer types the masks come keyed by; None: one mask for all
    window: Optional[int]  # the sliding window of its sliding layers (None: no sliding layer)
    additive: bool  # eager's float masks (0 where attended, the dtype's min elsewhere), not booleans


def step_mask_spec(config) -> Optional[StepMaskSpec]:
    """For a config whose layers all get transformers' causal or sliding-window causal mask, made
    by ``sdpa_mask`` or ``eager_mask`` (no chunked attention, no other layer types), how it is
    laid out; None for any other config."""
    from transformers import masking_utils as mu

    cfg = config.get_text_config()
    try:
        interface = mu.ALL_MASK_ATTENTION_FUNCTIONS[cfg._attn_implementation]
    except (KeyError, AttributeError):
        return None
    if interface is not mu.sdpa_mask and interface is not mu.eager_mask:
        return None
    if getattr(cfg, "attention_chunk_size", None) is not None or getattr(cfg, "is_causal", True) is False:
        return None
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        makers = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask}
        patterns = set(layer_types)
        if not patterns <= set(makers) or any(
                mu.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(p) is not makers[p] for p in patterns):
            return None
        if "sliding_attention" not in patterns:
            window = None
        elif not isinstance(window, int):
            return None
        keys = tuple(sorted(patterns))
    else:
        keys = None
        if window is not None and not isinstance(window, int):
            return None
    return StepMaskSpec(keys, window, interface is mu.eager_mask)


def deferred_stop_check_class():
    """transformers' ``DeferredStopCheck`` (reads "all rows finished" one step late), or None
    where this version has none or its sampling loop does not pick it by that global name."""
    from transformers.generation import utils as gen_utils

    cls = getattr(gen_utils, "DeferredStopCheck", None)
    loop = getattr(gen_utils.GenerationMixin, "_sample", None)
    if cls is None or loop is None or getattr(loop, "__wrapped__", None) is not None:
        return None
    code = getattr(loop, "__code__", None)
    if code is None or "DeferredStopCheck" not in code.co_names:
        return None
    try:
        params = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return None
    if params[:6] != ["self", "input_ids", "max_length", "cache", "cache_is_returned", "streamer"]:
        return None
    return cls


def sample_loop_with_stop_check(stop_check_cls):
    """A copy of ``GenerationMixin._sample`` (greedy and sampling decode loop) that uses
    ``stop_check_cls`` where transformers' own reads ``DeferredStopCheck``; the module is not
    changed. Its globals are copied per call, so later changes to the module are seen."""
    from transformers.generation import utils as gen_utils

    loop = gen_utils.GenerationMixin._sample
    scope = dict(loop.__globals__)
    scope["DeferredStopCheck"] = stop_check_cls
    copy = types.FunctionType(loop.__code__, scope, loop.__name__, loop.__defaults__, loop.__closure__)
    copy.__kwdefaults__ = loop.__kwdefaults__
    copy.__qualname__, copy.__doc__ = loop.__qualname__, loop.__doc__
    return copy


_GREEDY_LOOP_PARTS = ("_prefill", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation",
                      "_has_unfinished_sequences", "_optimize_model_for_decode", "_valid_auto_compile_criteria",
                      "get_compiled_call")


def greedy_loop_missing(model) -> Optional[str]:
    """Why ``decode.greedy_loop`` cannot stand in for this transformers' greedy loop (None: it can):
    the loop's own steps (prefill, inputs, kwargs update, stop test) and the stop-check classes."""
    from transformers.generation import utils as gen_utils

    missing = [name for name in _GREEDY_LOOP_PARTS if not callable(getattr(model, name, None))]
    if getattr(gen_utils, "StopCheck", None) is None:
        missing.append("StopCheck")
    if not isinstance(getattr(gen_utils, "ALL_CACHE_NAMES", None), (list, tuple)):
        missing.append("ALL_CACHE_NAMES")
    if missing:
        return f"transformers {TRANSFORMERS_VERSION} has no {', '.join(missing)} for fastlora's greedy loop"
    return None


def generation_output_cache(outputs):
    """The cache a step's outputs carry (transformers' loop looks it up by these names), or None."""
    from transformers.generation import utils as gen_utils

    return next((outputs[name] for name in gen_utils.ALL_CACHE_NAMES if name in outputs), None)


def per_step_stop_check():
    """transformers' stop check that reads "all rows finished" after every step (no streamer)."""
    from transformers.generation import utils as gen_utils

    return gen_utils.StopCheck(None)


def generation_mode_name(generation_config) -> str:
    """The decoding method transformers picks for this (prepared) config: e.g. "_sample", or a
    Hub repository for the modes it moved there."""
    from transformers.generation import utils as gen_utils

    return gen_utils.GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode(), "?")


def static_cache_layout(model: nn.Module) -> list:
    """Per decoder layer: (kv heads, key head dim, value head dim) of its cache, from the config;
    under tensor parallelism, this rank's heads (k/v are column-sharded by whole heads)."""
    cfg = model.config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return [(kv_heads // tp_size(model), head_dim, head_dim)] * cfg.num_hidden_layers


def sliding_window(model: nn.Module) -> Optional[int]:
    """The smallest attention window of the model's layers (None: every layer attends to all)."""
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and not any("sliding" in str(t) or "chunk" in str(t) for t in types):
        return None  # e.g. Qwen2 with use_sliding_window=False keeps a window it does not use
    return int(window) if isinstance(window, int) and window > 0 else None


def full_attention_config(model: nn.Module):
    """The text config with every layer full-attention: what a static cache is built from. A call
    whose sequence fits the window gives the same masks and attention with full layers (no token
    ever leaves the window), so fastlora's graphs serve sliding-window models up to their window."""
    import copy

    cfg = copy.deepcopy(model.config.get_text_config(decoder=True))
    if getattr(cfg, "sliding_window", None) is not None:
        cfg.sliding_window = None
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
    return cfg


def static_cache_blocker(model: nn.Module) -> Optional[str]:
    """Why decode graphs cannot run over a ``StaticCache`` of this model (None: they can).

    Builds the cache object (from ``full_attention_config``) without allocating it (its layers
    allocate lazily) and checks that every layer is a plain full-attention static layer that
    tracks its length on the device.
    """
    from transformers import StaticCache

    try:
        cache = StaticCache(config=full_attention_config(model), max_cache_len=8)
    except Exception as e:  # noqa: BLE001 - any failure means: no static cache for this model
        return f"transformers cannot build a StaticCache for it ({type(e).__name__}: {e})"
    if len(cache.layers) != len(static_cache_layout(model)):
        return "its cache layers do not match its decoder layers"
    for layer in cache.layers:
        if not is_plain_static_layer(layer):
            return (f"its static cache has {type(layer).__name__} layers (sliding windows or other "
                    "non-full attention)")
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            return f"cache layer {type(layer).__name__} tracks its length on the host"
    return None


def is_plain_static_layer(layer) -> bool:
    """transformers' own full-attention ``StaticLayer`` (not a subclass with another update)."""
    from transformers.cache_utils import StaticLayer

    return (isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False)
            and type(layer).update is StaticLayer.update)


def static_cache_over(model: nn.Module, max_cache_len: int, views) -> object:
    """A ``StaticCache`` whose layers use the given (keys, values) tensors, (rows, heads, len, dim)
    each, as their storage (views of buffers owned by the caller).

    ``StaticLayer.lazy_initialization`` sets the layer's device, dtype, sizes and length tensor from
    probe states and allocates zeros of ``max_cache_len``; it runs here with a length of 1, then the
    caller's views replace the two tiny tensors.
    """
    from transformers import StaticCache

    cache = StaticCache(config=full_attention_config(model), max_cache_len=max_cache_len)
    if len(cache.layers) != len(views):
        raise RuntimeError(f"fastlora: StaticCache has {len(cache.layers)} layers, expected {len(views)}")
    for layer, (k, v) in zip(cache.layers, views):
        probe_k = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
        probe_v = v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])
        layer.max_cache_len = 1
        try:
            layer.lazy_initialization(probe_k, probe_v)
        finally:
            layer.max_cache_len = max_cache_len
        if not (getattr(layer, "is_initialized", False) and tuple(layer.keys.shape) == tuple(probe_k.shape)
                and tuple(layer.values.shape) == tuple(probe_v.shape)):
            raise RuntimeError(
                f"fastlora: transformers {TRANSFORMERS_VERSION}'s {type(layer).__name__}.lazy_initialization "
                "no longer allocates (rows, heads, max_cache_len, dim) keys and values; static caches "
                "cannot be built over shared buffers")
        layer.keys, layer.values = k, v
    return cache


# ---- torch: CUDA graph memory pools and recovery from a failed capture ---------------------------
def new_graph_pool():
    """(owner, pool id) for a private memory pool that graphs can share.

    With ``torch.cuda.MemPool`` the owner holds a reference to the pool, so freeing any number of
    graphs never brings the pool's use count to zero while the runner still captures into it
    (PyTorch asserts ``use_count > 0`` when a pool id whose graphs were all freed is used again).
    Without it, a plain graph pool handle (owner None): the runner never reuses such a handle after
    its last graph is freed.
    """
    pool_cls = getattr(torch.cuda, "MemPool", None)
    if pool_cls is not None:
        try:
            owner = pool_cls()
            return owner, owner.id
        except Exception:  # noqa: BLE001 - fall back to a plain handle
            pass
    return None, torch.cuda.graph_pool_handle()


def new_cuda_graph(keep: bool):
    """``torch.cuda.CUDAGraph``; with ``keep``, one whose captured graph stays editable until its
    ``instantiate()`` (torch 2.8 and later; older torch: None)."""
    if not keep:
        return torch.cuda.CUDAGraph()
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return None
    return graph if hasattr(graph, "raw_cuda_graph") and hasattr(graph, "instantiate") else None


def graph_pool_bytes(pool_id) -> Optional[int]:
    """Bytes the CUDA caching allocator has reserved for this pool (None when torch cannot say)."""
    try:
        segments = torch.cuda.memory_snapshot(pool_id)
    except Exception:  # noqa: BLE001 - older torch: no per-pool snapshot
        return None
    if isinstance(segments, dict):
        segments = segments.get("segments", [])
    return int(sum(s.get("total_size", 0) for s in segments))


def end_allocate_to_pool(device_index: int, pool_id) -> None:
    """Stop routing this device's allocations to ``pool_id`` (after a capture that failed before its
    ``capture_end`` did it). A no-op when nothing is routed there."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device_index, pool_id)
    except Exception:  # noqa: BLE001 - "not currently recording to mempool": nothing to undo
        pass


def reset_rng_capture_state(device_index: int) -> None:
    """Give the device's default CUDA generator a fresh copy of its state (same seed and offset).

    A capture that fails between ``capture_begin`` and ``capture_end`` leaves the generator's state
    flagged as capturing, and every later random op in the process then fails ("Offset increment
    outside graph capture"); the copy carries seed and offset but not that flag.
    """
    gen = torch.cuda.default_generators[device_index]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except Exception:  # noqa: BLE001 - older torch without graph-safe states: nothing to reset
        pass


# ---- PEFT's forward hooks after an error ---------------------------------------------------------
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
    import contextlib

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


# ---- transformers: continuous batching ----------------------------------------------------------
# The engine (``generate_batch`` / ``init_continuous_batching``, transformers >= 5.x) is used as
# shipped. fastlora reads three things of it: the requests of each step, in the order their tokens
# sit in the forward's one row, with their token counts (``inputs_and_outputs.requests_in_batch``,
# ``num_q_tokens``, set by ``prepare_batch_tensors``); a request's status; and the config fields
# it must turn off. Checked on 5.17 and 5.24.
CB_CHILD_MARK = "__child#"  # request ids of forked sequences: f"{parent}__child#{i}"
_CB_OFF = {  # config field -> (value fastlora needs, why)
    "allow_block_sharing": (False, "prefix sharing would serve one adapter's KV cache to another"),
    "use_async_batching": (False, "each step's requests are read just before its forward"),
    "varlen_compile_config": (None, "torch.compile of the forward is not supported with LoRA batches"),
    "decode_compile_config": (None, "torch.compile of the forward is not supported with LoRA batches"),
    "default_compile_level": (0, "torch.compile of the forward is not supported with LoRA batches"),
}


def continuous_batching_blocker(model: nn.Module) -> Optional[str]:
    """Why transformers' continuous batching cannot take per-request adapters here (None: it can)."""
    if not callable(getattr(type(model), "init_continuous_batching", None)):
        return f"transformers {TRANSFORMERS_VERSION} has no continuous batching on this model"
    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import continuous_api, input_outputs, requests
    except ImportError as e:
        return f"transformers {TRANSFORMERS_VERSION}: {e}"
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    missing = [f for f in (*_CB_OFF, "use_cuda_graph") if f not in fields]
    if missing:
        return f"transformers {TRANSFORMERS_VERSION}'s ContinuousBatchingConfig has no {', '.join(missing)}"
    if not hasattr(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors"):
        return f"transformers {TRANSFORMERS_VERSION}: unknown continuous-batching inputs"
    for name in ("_create_batch_processor", "add_request", "add_requests", "cancel_request", "stop"):
        if not callable(getattr(continuous_api.ContinuousBatchingManager, name, None)):
            return f"transformers {TRANSFORMERS_VERSION}'s ContinuousBatchingManager has no {name}"
    if not hasattr(requests, "RequestStatus"):
        return f"transformers {TRANSFORMERS_VERSION}: no RequestStatus"
    return None


def cb_engine_attention_blocker() -> Optional[str]:
    """Why this transformers' engine cannot run ``paged|fastlora_varlen`` (None: it can): the
    function calls the engine's ``PagedAttentionCache.update`` with its read and write indices
    (5.17's form; 5.24 passes the kwargs instead)."""
    import inspect

    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        params = inspect.signature(PagedAttentionCache.update).parameters
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return f"transformers {TRANSFORMERS_VERSION}: {e}"
    if not {"read_index", "write_index"} <= set(params):
        return f"transformers {TRANSFORMERS_VERSION}'s paged cache takes another update call"
    return None


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 when it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def cb_config_for_lora(config, generation_config, graphs_blocker: Optional[str] = None,
                       max_requests: Optional[int] = None) -> Tuple[object, list]:
    """A copy of the continuous-batching config (the caller's, the one set on the generation
    config, or the default) with what per-request adapters need; and what was changed, why.
    ``graphs_blocker``: why the engine's CUDA graphs cannot carry this model's LoRA batches
    (None: the engine keeps its own choice). ``max_requests``: the most requests one step may
    hold (the slots, when the model has fewer than adapters)."""
    import dataclasses

    from transformers import ContinuousBatchingConfig

    if config is None:
        config = getattr(generation_config, "continuous_batching_config", None)
    if not isinstance(config, ContinuousBatchingConfig):
        config = ContinuousBatchingConfig()
    off = dict(_CB_OFF)
    if graphs_blocker is not None:
        off["use_cuda_graph"] = (False, graphs_blocker)
    changes, values = [], {}
    for name, (value, why) in off.items():
        current = getattr(config, name)
        if current != value:
            values[name] = value
            if current is not None:  # None: the engine would decide; no need to report
                changes.append(f"{name}={value!r} ({why})")
    current = getattr(config, "max_requests_per_batch", None)
    if max_requests is not None and (current is None or current > max_requests):
        values["max_requests_per_batch"] = max_requests
        changes.append(f"max_requests_per_batch={max_requests} (each step's adapters must fit the slots)")
    if getattr(config, "use_default_compile_configs", None) is not None:
        values["use_default_compile_configs"] = None  # deprecated alias: it would set the level again
    return dataclasses.replace(config, **values), changes


def cb_step(processor) -> Tuple[list, list, int]:
    """The step about to run: its requests' states (``.request_id``) and query lengths, in the
    order of their tokens in the forward's one row, and the forward's token count (padding
    included)."""
    ios = processor.inputs_and_outputs
    reqs = getattr(ios, "requests_in_batch", None)
    if reqs is None or not hasattr(ios, "num_q_tokens"):
        raise RuntimeError(f"fastlora: transformers {TRANSFORMERS_VERSION}'s continuous-batching inputs "
                           "do not list the step's requests (async batching must be off)")
    return [fs.state for fs in reqs], [int(fs.query_length) for fs in reqs], int(ios.num_q_tokens)


def cb_request_ids(processor) -> list:
    """Ids of the engine's requests that will be stepped again (active, then waiting)."""
    sched = processor.scheduler
    return list(sched.active_requests) + list(sched.waiting_requests)


def cb_fail_requests(processor, errors: Dict[str, Exception]) -> None:
    """Fail these requests (active or waiting) between steps, each delivered with its error as the
    engine delivers its own; the engine's other requests keep running. The engine's own paths: its
    per-request error delivery, then its cancellation, which frees the request's cache (and any
    copy offloaded to the CPU)."""
    sched = processor.scheduler
    for rid, error in errors.items():
        state = sched.active_requests.get(rid) or sched.waiting_requests.get(rid)
        if state is None:
            continue
        processor._handle_request_error(error, state)
        sched.set_request_cancellation(rid)
    offload = getattr(processor, "offloading_manager", None)
    for state in sched.clear_cancelled_requests():
        if offload is not None:
            offload.free_request_cpu_cache(state)


def cb_request_done(request_state) -> bool:
    """Whether a request has finished or failed (it will not be stepped again)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    return request_state.status in (RequestStatus.FINISHED, RequestStatus.FAILED)


def cb_new_request_id(manager) -> str:
    """The id the manager would give a request added without one (its own counter and format)."""
    lock, counter = getattr(manager, "_request_lock", None), getattr(manager, "_request_counter", None)
    if lock is None or not isinstance(counter, int):
        raise RuntimeError(f"fastlora: transformers {TRANSFORMERS_VERSION}'s manager has no request "
                           "counter; pass request_id= to add_request")
    with lock:
        request_id = f"req_{manager._request_counter}"
        manager._request_counter += 1
    return request_id


def cb_drop_result_handler(manager, request_id: str) -> None:
    """Forget a result handler registered with ``register_result_handler`` for a request that will
    deliver nothing more (cancelled, or never added): the manager drops one only on a finished
    output, so a cancelled request's would stay forever."""
    router = getattr(manager, "output_router", None)
    handlers, lock = getattr(router, "result_handlers", None), getattr(router, "_lock", None)
    if isinstance(handlers, dict) and lock is not None:
        with lock:
            handlers.pop(request_id, None)


# The engine's CUDA graphs (``model_runner``: ``compute_batch`` captures or replays a graph per
# padded step shape, ``_get_forward_fn`` says whether this step is graphed; the graphs live in
# ``inputs_and_outputs.graphs``). Checked on 5.17 and 5.24.
def cb_graphs_blocker_of_engine(processor) -> Optional[str]:
    """Why fastlora cannot follow this engine's graphs (None: it can)."""
    runner, ios = getattr(processor, "model_runner", None), getattr(processor, "inputs_and_outputs", None)
    for obj, attr in ((runner, "_get_forward_fn"), (runner, "use_cuda_graph_varlen"), (runner, "pad_inputs"),
                      (runner, "cache"), (ios, "graphs"), (ios, "use_block_table")):
        if not hasattr(obj, attr):
            return f"transformers {TRANSFORMERS_VERSION}'s continuous-batching engine has no {attr}"
    return None


def cb_engine_uses_graphs(processor) -> bool:
    """Whether the engine captures any of its steps in CUDA graphs."""
    runner = processor.model_runner
    return bool(getattr(runner, "use_cuda_graph_varlen", False) or getattr(runner, "use_cuda_graph_decode", False))


def cb_capacity(processor) -> Tuple[int, int]:
    """(most tokens, most requests) of one engine step."""
    runner = processor.model_runner
    return int(runner.cache.max_batch_tokens), int(runner.cb_config.max_requests_per_batch)


def cb_graphed_step(processor) -> bool:
    """Whether the engine's step about to run is captured or replayed in a CUDA graph."""
    runner, ios = processor.model_runner, processor.inputs_and_outputs
    return bool(runner._get_forward_fn(use_block_table=ios.use_block_table)[1])


def cb_stream(processor):
    """The stream the engine computes (and replays its graphs) on; None off CUDA."""
    return getattr(processor.inputs_and_outputs, "compute_stream", None)


def cb_drop_graphs(processor) -> None:
    """Drop the engine's captured graphs (each is recaptured at its next use)."""
    ios = processor.inputs_and_outputs
    ios.graphs = type(ios.graphs)()  # the old buffer resets its graphs when collected


def cb_disable_graphs(processor) -> None:
    """The engine's steps eager from now on (still padded: harmless)."""
    runner = processor.model_runner
    runner.use_cuda_graph_varlen = runner.use_cuda_graph_decode = False


@contextlib.contextmanager
def cb_graphs_suspended(processor):
    """The engine runs its graphed step's forward eagerly inside (emulated graphs)."""
    runner = processor.model_runner
    saved = runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode
    runner.use_cuda_graph_varlen = runner.use_cuda_graph_decode = False
    try:
        yield
    finally:
        runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode = saved


def cb_emulate_graphs(processor) -> None:
    """Off CUDA (tests): the engine pads its steps and marks them graphed as it would with graphs;
    ``cb_graphs_suspended`` then runs each one eagerly."""
    runner = processor.model_runner
    runner.pad_inputs = True
    runner.use_cuda_graph_varlen = runner.use_cuda_graph_decode = True


# The engine's token selection and step failures (``model_runner._sample`` writes the step's tokens
# into ``output_ids[0]`` in the order of the requests that get one; ``handle_batch_error`` fails a
# step's requests and frees their cache). Checked on 5.17 and 5.25.
def cb_logit_requests(processor) -> list:
    """The states of the step's requests that get a token, in the order of the logits' rows."""
    return [fs.state for fs in processor.inputs_and_outputs.requests_in_batch if fs.has_new_token]


def cb_wrap_sample(processor, wrapper) -> None:
    """The engine's selection of this processor's tokens goes through
    ``wrapper(original, scores, output_ids)``; ``cb_unwrap_sample`` takes it off."""
    runner = processor.model_runner
    original = runner._sample
    runner._sample = lambda scores, output_ids: wrapper(original, scores, output_ids)


def cb_unwrap_sample(processor) -> None:
    processor.model_runner.__dict__.pop("_sample", None)


def cb_fail_step(processor, error: Exception) -> None:
    """Fail the requests of the step that just raised (each delivered with the error), free their
    cache; the engine's other requests go on at the next step."""
    processor.handle_batch_error(error)


def cb_generated_len(request_state) -> int:
    """How many tokens the request has generated."""
    return int(request_state.generated_len())


def cb_generated_tokens(request_state) -> list:
    return list(request_state.generated_tokens)


def cb_cache_tokens(processor) -> int:
    """The most tokens (prompt and output) one request can hold in the engine's cache."""
    cache = processor.cache
    most = getattr(cache, "max_tokens_read", None)  # 5.24+: the largest allocator's pages
    if isinstance(most, int) and most > 0:
        return most
    return int(cache.num_blocks) * int(cache.block_size)


def cb_vocab_size(model: nn.Module) -> int:
    """Columns of the model's logits."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    return int(model.config.get_text_config().vocab_size)


def cb_fatal_error(manager) -> Optional[BaseException]:
    """The error that ended the manager's thread (None when it ended normally or runs)."""
    status = getattr(manager, "background_thread_status", None)
    return getattr(status, "fatal_error", None)


def input_vocab_size(model: nn.Module) -> int:
    """How many token ids the model's input embedding takes."""
    embed = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if embed is not None and hasattr(embed, "num_embeddings"):
        return int(embed.num_embeddings)
    return int(model.config.get_text_config().vocab_size)


def position_limit(model: nn.Module) -> Optional[int]:
    """The model's ``max_position_embeddings`` (None when its config has none)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None
