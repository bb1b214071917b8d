"""Sibling projections (q/k/v, gate/up) fused into one base GEMM, built at patch time.

Groups are found by structure: a parent module whose children named ``q_proj``, ``k_proj``,
``v_proj`` (or ``gate_proj``, ``up_proj``) are plain ``nn.Linear`` layers, or PEFT LoRA layers
wrapping one, with the same input width, dtype and device. The fused weight is one new tensor
and each original parameter becomes a view of it (same Parameter object, new storage), so there
is no second copy of the base weights and ``state_dict()`` still shows the original names.

Under transformers' tensor parallelism the siblings are column-sharded alike: each rank fuses its
own shards (its q, k and v output rows), and each DTensor's local shard becomes the view.

*Folding.* The fused tensor may hold more rows under the base weight (``tail``): a site's pool
stores its packed LoRA A arena there (``SitePool.fold``), so that one GEMM, ``x @ [W; A].T``, gives
the base output and the shrink of every adapter at once, and decode runs only the expand after it.
A single ``nn.Linear`` (o_proj, down_proj) takes the same form as a group of one. With fewer GPU
slots than adapters the tail may instead be a staging area (``staged``) a folding call copies its
adapters' A blocks to (``SitePool.stage_call``).

*Separate bases.* Quantized siblings (bitsandbytes 4-bit or 8-bit, torchao: QLoRA) keep their
library's matmul. Where every member is such a LoRA layer of one kind, the group is a
``SeparateGroup``: the LoRA of all of them is one stacked call (one shrink, one expand) instead of
one per member, and their base outputs are laid side by side. bitsandbytes' 8-bit siblings, whose
weights are quantized row by row, share one 8-bit matmul over their rows joined
(``compat.bitsandbytes``); the others are computed one by one. Nothing is folded. Without an
outlier threshold, on a GPU, the joined product is dequantized by ``ops.int8_dequant`` straight to
the input's dtype (bitsandbytes' values, without its separate cast from fp16); a decode-sized
LoRA forward adds its deltas, computed beside the matmul (``lora.beside``), in that same pass. A
single 8-bit layer takes the same form as a group of one.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..compat.bitsandbytes import JoinedInt8, int8_join_blocker
from ..compat.modules import (has_forward_hooks, is_dtensor, is_plain_weight, linear_in_out, local,
                              quantized_weight_name)
from ..compat.peft import base_layer_of, is_lora_layer, quantized_base_kind
from ..compat.tensor_parallel import TP_REASON, repoint_local, tp_colwise_mesh
from ..kernel_support import kernel_runs_on
from ..ops.int8_dequant import int8_dequant

FUSIBLE_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
}
# The GEMM computes every row of a folded arena at every step, whichever adapters the batch uses.
# An arena of at most ``Tuning.fold_max_share`` of the base weight's rows is folded for every call;
# one of at most ``fold_call_share`` is stored under the base weight too, and folded for the calls
# whose adapters use at least ``fold_min_use`` of its rows (a graph per choice:
# ``CallContext.fold``), where every adapter has a slot (fewer slots: the arena is sized for the
# largest adapters, not the loaded ones); larger ones keep the fused kernel. The shares follow the
# measured cost per row of the folded tail and of the fused kernel: past them the GEMM's unused rows
# cost more than it saves. With fewer slots than adapters a larger arena is not stored under the
# base weight: a *staging* tail is, sized for what a call of ``num_slots`` average adapters uses
# (times ``fold_stage_margin``, and at most ``fold_call_share`` of the base rows); a call that folds
# copies its adapters' A blocks there first (``SitePool.stage_call``), one that does not fit takes
# the fused kernel.


def release_cached(device: torch.device) -> None:
    """Give the CUDA allocator's unused blocks back to the driver once a (re-)fuse has dropped the
    previous copy of a group's weights. Left cached, that copy's segment is split by the smaller
    buffers allocated next (the next group's, the adapters' stacks), and what they leave free in it
    stays stranded: neither returned to the driver nor large enough for a KV cache, which the
    continuous-batching engine sizes from what the driver reports free. Not while a graph captures."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.empty_cache()


@dataclass
class FusedGroup:
    kind: str  # "qkv", "gate_up", or "linear" (one layer, fused only to fold a pool's arena)
    parent_name: str
    member_names: Tuple[str, ...]
    members: List[nn.Module]  # what the parent calls: a LoRA layer or a plain nn.Linear
    bases: List[nn.Linear]
    weight: Optional[torch.Tensor] = None  # (sum out, in), the only copy of the base weights
    bias: Optional[torch.Tensor] = None
    offsets: List[int] = field(default_factory=list)
    _member_ptrs: List[int] = field(default_factory=list)  # where each member's weight starts in ``weight``
    ext: Optional[torch.Tensor] = None  # (sum out + tail rows, in): ``weight`` then ``tail``
    ext_bias: Optional[torch.Tensor] = None  # ``bias`` then zeros, when there is a bias
    tail: Optional[torch.Tensor] = None  # the rows under the base weight (a pool's A arena), or None
    fold_refusal: Optional[str] = None  # why the last ``attach_tail`` did not fold
    per_call: bool = False  # the tail is folded only for calls that use enough of it (fold_min_use)
    staged: bool = False  # the tail is a staging area a call's A blocks are copied to, not the arena
    gemm: Optional[Callable] = None  # F.linear's stand-in for the fused GEMMs (base_ops.stream_linears), or None
    separate: Optional[str] = None  # a ``SeparateGroup``'s quantization ("nf4", ...); None: fused

    @property
    def out_features(self) -> List[int]:
        return [local(b.weight).shape[0] for b in self.bases]  # this rank's rows under TP

    @property
    def in_features(self) -> int:
        return local(self.bases[0].weight).shape[1]

    def _set_offsets(self) -> None:
        """Where each member's output columns start in the group's output (and its end)."""
        self.offsets = [0, *itertools.accumulate(self.out_features)]

    def is_intact(self) -> bool:
        """Still views of the fused tensor (``model.to()`` or a reload replaces the storage); checked
        on every forward, so against the addresses ``fuse`` recorded."""
        if self.weight is None:
            return False
        dtype, device = self.weight.dtype, self.weight.device
        for b, ptr in zip(self.bases, self._member_ptrs):
            w = local(b.weight)
            if w.data_ptr() != ptr or w.dtype != dtype or w.device != device:
                return False
        return True

    # inference_mode(False): a re-fuse may run inside a forward under torch.inference_mode(), and
    # parameters must not become inference tensors (a later training step could not use them)
    @torch.no_grad()
    @torch.inference_mode(False)
    def fuse(self, tail_rows: int = 0):
        """One tensor for the members' weights (and biases), ``tail_rows`` zero rows under them."""
        self._set_offsets()
        n = self.offsets[-1]
        first = local(self.bases[0].weight)
        # the new copy first, then the parameters are repointed: the old storages are freed, so
        # peak memory grows by one group at a time
        ext = torch.empty(n + tail_rows, first.shape[1], dtype=first.dtype, device=first.device)
        for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:]):
            ext[lo:hi].copy_(local(b.weight).detach())
        ext[n:].zero_()
        self.ext, self.weight, self.tail = ext, ext[:n], (ext[n:] if tail_rows else None)
        for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:]):
            repoint_local(b.weight, self.weight[lo:hi])
        self._member_ptrs = [self.weight[lo:hi].data_ptr() for lo, hi in zip(self.offsets[:-1], self.offsets[1:])]
        if any(b.bias is not None for b in self.bases):
            self.ext_bias = torch.zeros(n + tail_rows, dtype=ext.dtype, device=ext.device)
            self.bias = self.ext_bias[:n]
            for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:]):
                if b.bias is not None:
                    self.bias[lo:hi].copy_(local(b.bias).detach())
                    repoint_local(b.bias, self.bias[lo:hi])
        else:
            self.bias = self.ext_bias = None
        release_cached(ext.device)

    def attach_tail(self, rows: int, dtype: torch.dtype, device, *, max_share: float, call_share: float,
                    per_call_ok: bool = True, stage_rows: int = 0) -> Optional[torch.Tensor]:
        """Re-fuse with ``rows`` zero rows under the base weight and return them (a pool's A
        arena), or None where folding does not apply: too many rows for the GEMM to carry
        (``call_share`` of the base rows), another dtype or device, or base layers that no longer
        take one GEMM. A tail no longer wanted is dropped. Past ``max_share`` the tail is folded
        per call (``per_call``), where ``per_call_ok`` (the pool holds every adapter); where it
        does not and ``stage_rows`` is given, the tail is a staging area of that many rows (at most
        ``call_share`` of the base rows; ``staged``) and the arena lives elsewhere."""
        first = local(self.bases[0].weight)
        n = sum(self.out_features)
        self.per_call = rows > n * max_share
        self.staged = self.per_call and not per_call_ok and stage_rows > 0
        if self.staged:
            rows = min(rows, stage_rows, int(n * call_share) // 8 * 8)
        limit = max(max_share, call_share) if (per_call_ok or self.staged) else max_share
        self.fold_refusal = self._fold_refusal(rows, n, first, dtype, device, limit, per_call_ok or self.staged)
        if self.fold_refusal is not None:
            self.staged = False
            if self.tail is not None and self.is_intact():
                self.fuse(0)
            return None
        self.fuse(rows)
        return self.tail

    @torch.no_grad()
    @torch.inference_mode(False)
    def unfuse(self):
        """Give every parameter its own storage again; the fused tensor is dropped."""
        device = self.ext.device if self.ext is not None else None
        for b in self.bases:
            repoint_local(b.weight, local(b.weight).detach().clone())
            if b.bias is not None:
                repoint_local(b.bias, local(b.bias).detach().clone())
        self.weight = self.bias = self.ext = self.ext_bias = self.tail = None
        if device is not None:
            release_cached(device)

    def _fold_refusal(self, rows, n, first, dtype, device, limit: float, per_call_ok: bool) -> Optional[str]:
        if rows <= 0:
            return "no adapter targets it"
        if rows > n * limit:
            return (f"its adapters' A rows ({rows}) would add more than {limit:.3g} of its "
                    f"{n} base rows to the GEMM" + ("" if per_call_ok else
                                                   " (folding per call needs every adapter in a GPU slot)"))
        if first.dtype != dtype or first.device != torch.device(device):
            return f"the stacks are {dtype} on {device}, the base weight {first.dtype} on {first.device}"
        return fusion_blocker(self.bases)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return (self.gemm or torch.nn.functional.linear)(x, self.weight, self.bias)

    def linear_with_tail(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """``x @ [W; tail].T`` (+ the bias, zeros under the tail): (s, sum out + tail rows).
        ``bias=False``: a row-sharded layer's partial sums (its bias is added once, after the reduce)."""
        return (self.gemm or torch.nn.functional.linear)(x, self.ext, self.ext_bias if bias else None)


class SeparateGroup(FusedGroup):
    """Quantized siblings that share one LoRA call: each member keeps its library's matmul (nothing
    is folded), the outputs laid side by side; 8-bit ones one matmul over their joined rows
    (``join``)."""

    joined: Optional[JoinedInt8] = None

    def join(self) -> Optional[str]:
        """One matmul for the members where their quantization allows it (bitsandbytes' 8-bit);
        returns why not (None: joined)."""
        self._set_offsets()
        why = (int8_join_blocker(self.bases) if self.separate == "int8"
               else f"{self.separate} weights: one matmul a member")
        if why is None:
            self.joined = JoinedInt8(self.bases)
        return why

    @property
    def out_features(self) -> List[int]:
        return [linear_in_out(b)[1] for b in self.bases]  # (a packed weight's shape is not the layer's)

    @property
    def in_features(self) -> int:
        return linear_in_out(self.bases[0])[0]

    def is_intact(self) -> bool:
        return True

    def fuse(self, tail_rows: int = 0):
        raise RuntimeError(f"{self.parent_name}.{self.kind}: quantized base layers are not fused")

    def unfuse(self):
        if self.joined is not None:
            self.joined.release()
            self.joined = None

    def joined_intact(self) -> bool:
        """Joined, and every member still reads its rows of the joined tensors."""
        return self.joined is not None and self.joined.intact()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.joined_intact():
            return int8_matmul(self.joined, x)
        return torch.cat([b(x) for b in self.bases], dim=-1)


def int8_matmul(joined: JoinedInt8, x: torch.Tensor) -> torch.Tensor:
    """``joined``'s 8-bit matmul of ``x``; without an outlier threshold, on a GPU, its product
    dequantized by ``int8_dequantize`` (one launch where bitsandbytes has two)."""
    if joined.threshold != 0.0 or not (x.is_cuda and kernel_runs_on(x)):
        return joined.matmul(x)
    product, row_scales = joined.product(x.reshape(-1, x.shape[-1]))
    return int8_dequantize(joined, product, row_scales, x.dtype).view(*x.shape[:-1], product.shape[1])


def int8_dequantize(joined: JoinedInt8, product: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype,
                    addend: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``joined``'s int32 ``product`` (``JoinedInt8.product``) dequantized into ``dtype``, plus
    ``addend`` where given: on a GPU in one launch of ``ops.int8_dequant`` (bitsandbytes' CUDA
    roundings), elsewhere by bitsandbytes' own dequantization and an add."""
    if product.is_cuda and kernel_runs_on(product):
        return int8_dequant(product, row_scales, joined.scales, dtype, addend)
    out = joined.dequantize(product, row_scales, dtype)
    return out if addend is None else out.add_(addend)


def fusion_blocker(bases: List[nn.Module]) -> Optional[str]:
    """Why these base layers cannot share one GEMM, or None."""
    for b in bases:
        if type(b) is not nn.Linear:
            return f"base layer is {type(b).__name__}, not nn.Linear (quantized or custom)"
        if not is_plain_weight(b.weight):
            return f"a quantized weight ({quantized_weight_name(b.weight)})"
        if has_forward_hooks(b):
            return "base layer has forward hooks (offloading or similar)"
    if len(bases) > 1 and any(is_dtensor(b.weight) for b in bases):  # one layer: its own shard, whatever it is
        meshes = [tp_colwise_mesh(b.weight) for b in bases]
        biases = [b.bias for b in bases if b.bias is not None]
        if (any(m is None for m in meshes) or any(m != meshes[0] for m in meshes)
                or any(tp_colwise_mesh(t) is None for t in biases)):
            return f"{TP_REASON} (siblings not all column-sharded alike)"
    first = local(bases[0].weight)
    for b in bases[1:]:
        w = local(b.weight)
        if w.shape[1] != first.shape[1]:
            return "different input widths"
        if w.dtype != first.dtype or w.device != first.device:
            return "different dtypes or devices"
    if first.device.type == "meta":
        return "weights on the meta device"
    return None


class IntactWatch:
    """``FusedGroup.is_intact`` for every fused group of a model in one flat comparison, for the
    check each call (each engine step) makes: valid for the groups as they were fused when it was
    made (``holds``). A member's weight moved off the fused tensor has another address: the fused
    tensor stays alive in its group, so no new storage can take the address it had. Where a group
    is not fused or its weights are tensor-parallel shards, ``intact`` says False and each group
    is asked."""

    def __init__(self, groups: Sequence["FusedGroup"]):
        self._groups = _fused_groups(groups)
        self._fused = [g.weight for g in self._groups]  # ``fuse`` makes a new one
        self._flat = all(g.weight is not None and not any(is_dtensor(b.weight) for b in g.bases)
                         for g in self._groups)
        bases = [b for g in self._groups for b in g.bases] if self._flat else []
        self._param_dicts = [b._parameters for b in bases]
        self._weights = [d.get("weight") for d in self._param_dicts]
        self._names = ["weight"] * len(bases)
        self._ptrs = [ptr for g in self._groups for ptr in g._member_ptrs] if self._flat else []

    @property
    def flat(self) -> bool:
        """Every group fused and unsharded: ``intact`` can answer (else it says False)."""
        return self._flat

    def holds(self, groups: Sequence["FusedGroup"]) -> bool:
        fused = _fused_groups(groups)
        return (len(fused) == len(self._groups) and all(map(operator.is_, fused, self._groups))
                and all(map(operator.is_, (g.weight for g in fused), self._fused)))

    def intact(self) -> bool:
        return self._flat and (all(map(operator.is_, map(dict.get, self._param_dicts, self._names), self._weights))
                               and list(map(torch.Tensor.data_ptr, self._weights)) == self._ptrs)


def _fused_groups(groups) -> list:
    return [g for g in groups if type(g) is FusedGroup]  # (a ``SeparateGroup`` is always intact)


def separate_kind(members: List[nn.Module], bases: List[nn.Module]) -> Optional[str]:
    """The quantization ("nf4", "int8", "torchao", ...) where these siblings may share one LoRA call
    over their own matmuls: every member a LoRA layer over a quantized base of that one kind, with
    the same input width and device, no forward hooks, no tensor parallelism; else None."""
    kinds = {quantized_base_kind(m) if is_lora_layer(m) else None for m in members}
    if len(kinds) != 1 or None in kinds:
        return None
    if any(has_forward_hooks(b) or is_dtensor(b.weight) for b in bases):
        return None
    if len({linear_in_out(b)[0] for b in bases}) != 1 or len({b.weight.device for b in bases}) != 1:
        return None
    if bases[0].weight.device.type == "meta":
        return None
    return kinds.pop()


def find_groups(root: nn.Module) -> Tuple[List[FusedGroup], List[Tuple[str, str]]]:
    """Fusible groups with at least one LoRA member (quantized siblings as ``separate`` groups),
    and (parent name, reason) of groups that have LoRA members but cannot be served together."""
    groups, blocked = [], []
    for parent_name, parent in root.named_modules():
        for kind, names in FUSIBLE_GROUPS.items():
            members = [getattr(parent, n, None) for n in names]
            if any(m is None for m in members) or not any(is_lora_layer(m) for m in members):
                continue
            if any(not is_lora_layer(m) and not isinstance(m, nn.Module) for m in members):
                continue
            bases = [base_layer_of(m) for m in members]
            why = fusion_blocker(bases)
            separate = separate_kind(members, bases) if why else None
            if why and not separate:
                blocked.append((f"{parent_name}.{kind}" if parent_name else kind, why))
                continue
            group = SeparateGroup if separate else FusedGroup
            groups.append(group(kind, parent_name, names, members, bases, separate=separate))
    return groups, blocked
