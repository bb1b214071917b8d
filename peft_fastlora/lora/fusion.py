"""Sibling projections (q/k/v, gate/up) fused into one base GEMM, built at patch time.

Groups are found by structure: a parent module whose children named ``q_proj``, ``k_proj``,
``v_proj`` (or ``gate_proj``, ``up_proj``) are plain ``nn.Linear`` layers, or PEFT LoRA layers
wrapping one, with the same input width, dtype and device. The fused weight is one new tensor
and each original parameter becomes a view of it (same Parameter object, new storage), so there
is no second copy of the base weights and ``state_dict()`` still shows the original names.

Under transformers' tensor parallelism the siblings are column-sharded alike: each rank fuses its
own shards (its q, k and v output rows), and each DTensor's local shard becomes the view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import nn

from .._compat import (TP_REASON, base_layer_of, has_forward_hooks, is_dtensor, is_lora_layer, local, repoint_local,
                       tp_colwise_mesh)

FUSIBLE_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
}


@dataclass
class FusedGroup:
    kind: str  # "qkv" or "gate_up"
    parent_name: str
    member_names: Tuple[str, ...]
    members: List[nn.Module]  # what the parent calls: a LoRA layer or a plain nn.Linear
    bases: List[nn.Linear]
    weight: Optional[torch.Tensor] = None  # (sum out, in), the only copy of the base weights
    bias: Optional[torch.Tensor] = None
    offsets: List[int] = field(default_factory=list)
    _member_ptrs: List[int] = field(default_factory=list)  # where each member's weight starts in ``weight``

    @property
    def out_features(self) -> List[int]:
        return [local(b.weight).shape[0] for b in self.bases]  # this rank's rows under TP

    @property
    def in_features(self) -> int:
        return local(self.bases[0].weight).shape[1]

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
    def fuse(self):
        self.offsets = [0]
        for n in self.out_features:
            self.offsets.append(self.offsets[-1] + n)
        # cat allocates the fused copy; the parameters are repointed right after, so the old
        # storages are freed and peak memory grows by one group at a time
        self.weight = torch.cat([local(b.weight).detach() for b in self.bases], dim=0)
        for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:]):
            repoint_local(b.weight, self.weight[lo:hi])
        self._member_ptrs = [self.weight[lo:hi].data_ptr() for lo, hi in zip(self.offsets[:-1], self.offsets[1:])]
        if any(b.bias is not None for b in self.bases):
            parts = [local(b.bias).detach() if b.bias is not None
                     else torch.zeros(hi - lo, dtype=self.weight.dtype, device=self.weight.device)
                     for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:])]
            self.bias = torch.cat(parts)
            for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:]):
                if b.bias is not None:
                    repoint_local(b.bias, self.bias[lo:hi])
        else:
            self.bias = None

    @torch.no_grad()
    @torch.inference_mode(False)
    def unfuse(self):
        """Give every parameter its own storage again; the fused tensor is dropped."""
        for b in self.bases:
            repoint_local(b.weight, local(b.weight).detach().clone())
            if b.bias is not None:
                repoint_local(b.bias, local(b.bias).detach().clone())
        self.weight = self.bias = None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


def fusion_blocker(bases: List[nn.Module]) -> Optional[str]:
    """Why these base layers cannot share one GEMM, or None."""
    for b in bases:
        if type(b) is not nn.Linear:
            return f"base layer is {type(b).__name__}, not nn.Linear (quantized or custom)"
        if has_forward_hooks(b):
            return "base layer has forward hooks (offloading or similar)"
    if any(is_dtensor(b.weight) for b in bases):
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


def find_groups(root: nn.Module) -> Tuple[List[FusedGroup], List[Tuple[str, str]]]:
    """Fusible groups with at least one LoRA member, and (parent name, reason) of groups that
    have LoRA members but cannot be fused."""
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
            if why:
                blocked.append((f"{parent_name}.{kind}" if parent_name else kind, why))
                continue
            groups.append(FusedGroup(kind, parent_name, names, members, bases))
    return groups, blocked
