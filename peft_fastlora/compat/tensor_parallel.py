"""torch and transformers' tensor parallelism: which plan a layer has, this rank's shards of weights
and adapters, and the collectives a LoRA site makes in the layer's place.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .modules import is_dtensor, linear_in_out, local
from .peft import LoraEmbedding, LoraLinear, base_layer_of, embed_scale, unwrap_peft


# transformers' TP shards a layer's weight as a DTensor and replaces the layer's forward (its
# collectives inside); PEFT (>= 0.21.2) shards each adapter the way its base layer is sharded.
# fastlora serves LoRA Linears over column- and row-sharded layers from each rank's shards, fuses
# siblings within a rank and captures the collectives in its decode graphs; other plans and
# per-request continuous batching stay on PEFT's and transformers' own paths (the report says).
TP_REASON = "tensor parallel: not yet on fastlora's path"  # other plans, continuous batching


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
