"""The per-call check of the adapters a call uses, flattened per adapter so it runs at C speed.

``SitePool.stale`` checks, layer by layer in Python, that each adapter still has the modules,
parameters and storage its stacks were built from. A continuous-batching step repeats that check
for every adapter it serves, at every step: with tens of adapters on a 32-layer model, tens of
milliseconds of host time per step. ``AdapterWatch`` holds one adapter's facts over every layer in
flat lists and compares them with ``map``:

- identity (the A / B modules in their ``ModuleDict``, the weights in their modules) changes only
  by registering a module or parameter, which PyTorch's global registration hooks report
  (``registration_epoch``): checked only when one happened since the adapter's last check;
- storage (``param.data = ...``, ``model.to``) changes without registration: checked every call;
  at a continuous-batching step only after a registration or a manager's start
  (``unchanged(epoch, storage=False)``), as a step copies only values whose version counters moved.

Values are not checked here: ``pool.ValueRefresher`` copies them (at every ``generate`` call; at an
engine step, where their version counters moved). Structure (the
adapters and scalings of each layer) stays with ``SitePool.stale``, which is cheap without names.
"""

from __future__ import annotations

import itertools
import operator
from typing import List, Optional, Sequence

import torch

from ..compat.adapters import CountedScaling, scaling_epoch
from ..compat.modules import is_dtensor, local
from .fusion import IntactWatch

_data_ptr = torch.Tensor.data_ptr
_broken = operator.attrgetter("broken")  # a pool whose last load failed part-way
_pool = operator.attrgetter("pool")
# what a pool's fold rests on besides its group's storage: replaced only by a rebuild or a re-fuse
_fold_parts = operator.attrgetter("fold_attached", "fold", "lora_a", "staging")
_tail = operator.attrgetter("tail")


class AdapterWatch:
    """One adapter's modules, weights and storage addresses over the layers watched (the entries
    of ``watch_lora_layer``), as they were when the stacks were built."""

    def __init__(self, name: str, layer_watches: Sequence):
        self._dicts: List[dict] = []  # the lora_A / lora_B ModuleDicts' _modules
        self._modules: List = []
        self._params_dicts: List[dict] = []  # each A / B module's _parameters
        self._params: List = []
        self._ptrs: List[int] = []
        for watch in layer_watches:
            mods_a, _keys_a, mods_b, _keys_b, _scaling, _then, weights = watch
            entry = weights.get(name)
            if entry is None:
                continue
            ma, a, pa, mb, b, pb = entry
            self._dicts += [mods_a, mods_b]
            self._modules += [ma, mb]
            self._params_dicts += [ma._parameters, mb._parameters]
            self._params += [a, b]
            self._ptrs += [pa, pb]
        self._names = [name] * len(self._dicts)
        self._weight = ["weight"] * len(self._params_dicts)
        self._sharded = any(is_dtensor(p) for p in self._params)
        self.epoch: Optional[int] = None  # registration epoch of the last identity check passed

    def forget_checks(self) -> None:
        """The next ``unchanged`` checks everything (a continuous-batching manager starting)."""
        self.epoch = None

    def unchanged(self, epoch: int, storage: bool = True) -> bool:
        """Whether the adapter still has what its stacks were built from (identity checked only
        when the registration epoch moved since it last passed; storage too, unless ``storage``)."""
        if epoch == self.epoch and not storage:
            return True
        if epoch != self.epoch:
            if not all(map(operator.is_, map(dict.get, self._dicts, self._names), self._modules)):
                return False
            if not all(map(operator.is_, map(dict.get, self._params_dicts, self._weight), self._params)):
                return False
        tensors = [local(p) for p in self._params] if self._sharded else self._params
        if list(map(_data_ptr, tensors)) != self._ptrs:
            return False
        self.epoch = epoch
        return True


class StructureWatch:
    """Every stacked layer's adapter set and scalings (the ``watch_lora_layer`` entries of the
    pools), compared flat at an engine step instead of layer by layer in Python: the step skips
    ``SitePool.stale`` while these, the stacks (``key``) and the pools' health are as they were.

    An adapter joins a layer's ``ModuleDict`` by registering a module (``registration_epoch``) and
    leaves it without one, so while the epoch stays put the dicts' sizes tell whether their keys
    are the ones seen; the keys themselves are compared after a registration. The scaling dicts
    count their changes (``CountedScaling``): while ``scaling_epoch`` stays put none changed, and
    each is compared with its snapshot only where one is a plain dict."""

    def __init__(self, key, pools: Sequence, layer_watches: Sequence):
        self.key = key
        self._pools = list(pools)
        self._dicts = [w[0] for w in layer_watches] + [w[2] for w in layer_watches]  # lora_A / lora_B ._modules
        self._keys = [w[1] for w in layer_watches] + [w[3] for w in layer_watches]
        self._sizes = list(map(len, self._keys))
        self._scalings = [w[4] for w in layer_watches]
        self._then = [w[5] for w in layer_watches]
        self._counted = all(type(s) is CountedScaling for s in self._scalings)
        self._scaling_epoch = scaling_epoch()  # (a change before this is the full check's, next)
        self._epoch: Optional[int] = None  # the registration epoch the keys were last compared at

    def unchanged(self, key, epoch: int) -> bool:
        if key != self.key or any(map(_broken, self._pools)):
            return False
        if self._counted:
            if scaling_epoch() != self._scaling_epoch:
                return False
        elif self._scalings != self._then:
            return False
        if epoch == self._epoch:
            return list(map(len, self._dicts)) == self._sizes
        if list(map(tuple, self._dicts)) != self._keys:
            return False
        self._epoch = epoch
        return True


class FoldWatch:
    """``SitePool.fold_lost`` for every site of a model in one flat comparison, for the check each
    call (each engine step) makes: valid for the sites and pools it was made with (``holds``).

    A fold holds while its group's members still view the fused tensor (``IntactWatch`` over the
    folds) and the pool's arena, staging rows, fold and the fold's tail are the objects they were
    (each is replaced only by a rebuild or a re-fuse; compared by identity). Where any fold was
    already lost when the watch was made, or a fold's weights are tensor-parallel shards, ``intact``
    says False and each pool is asked."""

    def __init__(self, sites: Sequence):
        self._sites = list(sites)
        self._pools = list(map(_pool, self._sites))
        self._parts = list(itertools.chain.from_iterable(map(_fold_parts, self._pools)))
        self._folds = [p.fold for p in self._pools if p.fold_attached]
        self._tails = list(map(_tail, self._folds))
        self._groups = IntactWatch(self._folds)
        self._sound = not any(p.fold_lost() for p in self._pools) and (not self._folds or self._groups.flat)

    def holds(self, sites: Sequence) -> bool:
        return (len(sites) == len(self._sites) and all(map(operator.is_, sites, self._sites))
                and all(map(operator.is_, map(_pool, sites), self._pools)))

    def intact(self) -> bool:
        """True: no pool's fold is lost. False: ask each pool."""
        return (self._sound
                and all(map(operator.is_, itertools.chain.from_iterable(map(_fold_parts, self._pools)), self._parts))
                and all(map(operator.is_, map(_tail, self._folds), self._tails))
                and (not self._folds or self._groups.intact()))
