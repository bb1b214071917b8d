"""Adapter weights stacked per layer, so one kernel launch serves every adapter of a batch.

``AdapterRegistry`` maps adapter names to slots for the whole model (a row's slot is the same in
every layer). ``SitePool`` holds, for one LoRA *site* (a single LoRA layer, or a fused q/k/v or
gate/up group), the stacks the backend reads:

- ``lora_a``: (num_slots, c * R, in), module j of slot s in rows ``j*R : j*R + rank``;
- ``lora_b``: (num_slots, sum of out, R), module j in rows ``offsets[j]:offsets[j+1]``;
- ``ranks`` / ``scalings``: (num_slots, c), 0 rank for a module an adapter does not target.

The stacks are copies of PEFT's weights. ``SitePool.stale()`` tells whether PEFT's weights changed
since the copy (new or deleted adapters, training steps, ``load_adapter``, ``model.to``), by tensor
identity, storage address and version counter, so a forward never reads a stale copy.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ._compat import lora_weights, unsupported_reason


class AdapterRegistry:
    """Adapter name <-> slot, shared by every site of one model."""

    def __init__(self, names: Sequence[str]):
        self.names: List[str] = sorted(names)
        self.slot = {n: i for i, n in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.names)

    def slots_for(self, adapter_names: Sequence[str]) -> List[int]:
        unknown = sorted({n for n in adapter_names if n != "__base__" and n not in self.slot})
        if unknown:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(unknown)}")
        return [-1 if n == "__base__" else self.slot[n] for n in adapter_names]


class SitePool:
    """Stacked LoRA weights of one site (c stacked modules).

    Args:
        layers: the PEFT LoRA layer of each stacked module, or None for a module without LoRA
            (k_proj when the adapters target only q and v).
        out_features: output width of each stacked module.
        in_features: input width, shared by all modules.
        embedding: the site is a LoRA ``Embedding`` (A is (rank, vocab)).
    """

    def __init__(self, layers: Sequence[Optional[torch.nn.Module]], out_features: Sequence[int],
                 in_features: int, embedding: bool = False):
        self.layers = list(layers)
        self.out_features = list(out_features)
        self.in_features = in_features
        self.embedding = embedding
        self.offsets = [0]
        for n in self.out_features:
            self.offsets.append(self.offsets[-1] + n)
        self.lora_a: Optional[torch.Tensor] = None
        self.lora_b: Optional[torch.Tensor] = None
        self.ranks: Optional[torch.Tensor] = None
        self.scalings: Optional[torch.Tensor] = None
        self.max_rank = 0
        self.unsupported: dict[int, str] = {}  # slot -> why PEFT's own path must serve it here
        self._signature = None
        self._watched = None
        self._registry_names = None

    @property
    def stack_num(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b) if t is not None)

    def _current_signature(self, registry: AdapterRegistry):
        sig = [tuple(registry.names)]
        for layer in self.layers:
            if layer is None:
                sig.append(None)
                continue
            entries = []
            for name, (a, b, scaling) in lora_weights(layer).items():
                entries.append((name, id(a), a.data_ptr(), a._version, id(b), b.data_ptr(),
                                b._version, scaling))
            sig.append(tuple(entries))
        return tuple(sig)

    def _watch(self):
        """What ``stale`` checks on every forward, pre-resolved: per layer, the ``lora_A`` /
        ``lora_B`` module dicts and their keys, the scaling dict and a copy of it, and each adapter's
        A / B sub-modules and weights with their address and version. Covers what the signature
        covers (names, identity, address, version, scaling) with plain dict and attribute reads.
        None for embedding sites, which keep the signature."""
        if self.embedding:
            return None
        watch = []
        for layer in self.layers:
            if layer is None:
                continue
            mods_a, mods_b = layer.lora_A._modules, layer.lora_B._modules
            weights = []
            for name in mods_a:
                if name not in mods_b:
                    continue
                ma, mb = mods_a[name], mods_b[name]
                a, b = ma._parameters.get("weight"), mb._parameters.get("weight")
                if a is None or b is None:
                    return None  # not PEFT's usual layout: keep the signature
                weights.append((name, ma, a, a.data_ptr(), a._version, mb, b, b.data_ptr(), b._version))
            watch.append((mods_a, tuple(mods_a), mods_b, tuple(mods_b), layer.scaling, dict(layer.scaling),
                          weights))
        return watch

    def _watch_clean(self) -> bool:
        for mods_a, keys_a, mods_b, keys_b, scaling, scaling_then, weights in self._watched:
            if tuple(mods_a) != keys_a or tuple(mods_b) != keys_b or scaling != scaling_then:
                return False
            for name, ma, a, pa, va, mb, b, pb, vb in weights:
                if mods_a[name] is not ma or mods_b[name] is not mb:
                    return False
                if ma._parameters.get("weight") is not a or mb._parameters.get("weight") is not b:
                    return False
                if a._version != va or b._version != vb or a.data_ptr() != pa or b.data_ptr() != pb:
                    return False
        return True

    def stale(self, registry: AdapterRegistry, dtype: torch.dtype) -> bool:
        if self.lora_a is None or self.lora_a.dtype != dtype:
            return True
        if self._watched is not None:
            return self._registry_names != registry.names or not self._watch_clean()
        return self._signature != self._current_signature(registry)

    @torch.no_grad()
    def rebuild(self, registry: AdapterRegistry, dtype: torch.dtype, device: torch.device):
        """Copy every adapter's weights into fresh stacks."""
        c, n_slots = self.stack_num, len(registry)
        per = [lora_weights(layer) if layer is not None else {} for layer in self.layers]
        ranks = [[0] * c for _ in range(n_slots)]
        scal = [[0.0] * c for _ in range(n_slots)]
        self.unsupported = {}
        for j, layer in enumerate(self.layers):
            for name, (a, _b, scaling) in per[j].items():
                s = registry.slot[name]
                reason = unsupported_reason(layer, name)
                if reason:
                    self.unsupported[s] = reason
                ranks[s][j] = a.shape[0]
                scal[s][j] = scaling
        r = max([1] + [x for row in ranks for x in row])
        # for an embedding, "in" is the vocabulary and A is stored (rank, vocab) as PEFT does
        a_shape = (n_slots, r, self.in_features) if self.embedding else (n_slots, c * r, self.in_features)
        lora_a = torch.zeros(a_shape, dtype=dtype, device=device)
        lora_b = torch.zeros(n_slots, self.offsets[-1], r, dtype=dtype, device=device)
        for j in range(c):
            for name, (a, b, _s) in per[j].items():
                s, k = registry.slot[name], a.shape[0]
                lora_a[s, j * r : j * r + k] = a.to(device=device, dtype=dtype)
                lora_b[s, self.offsets[j] : self.offsets[j + 1], :k] = b.to(device=device, dtype=dtype)
        self.lora_a, self.lora_b, self.max_rank = lora_a, lora_b, r
        self.ranks = torch.tensor(ranks, dtype=torch.int32, device=device).reshape(n_slots, c)
        self.scalings = torch.tensor(scal, dtype=torch.float32, device=device).reshape(n_slots, c)
        self._signature = self._current_signature(registry)
        self._watched = self._watch()
        self._registry_names = list(registry.names)

    def slot_ranks_host(self) -> List[int]:
        """Largest rank of each slot over the stacked modules (host list)."""
        return [max(row) for row in self.ranks.tolist()] if self.ranks is not None else []
