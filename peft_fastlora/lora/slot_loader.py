"""A call's adapters into the stacks: ``SlotLoader``.

At each call boundary the model state hands the call's adapter names here. The loader gives them
GPU slots (``AdapterRegistry``; with fewer slots than adapters, the newcomers are loaded into every
site and the least recently used give way), copies the current values of their weights into the
stacks (``ValueRefresher``), decides whether the call folds the sites that fold per call, and stages
their A blocks where it does. Stacks keep their addresses throughout: captured graphs stay valid.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..tuning import Tuning
from .dora import sync_tables
from .host_copy import copy_from_host, prestage
from .pool import ValueRefresher, copy_values
from .shared_versions import SharedVersions
from .slots import AdapterRegistry
from .store import StoredAdapter


class SlotLoader:
    """Slots, values and the fold choice of the adapters a call uses, over the model's sites.

    Args:
        tuning: the thresholds (``fold_min_use``) and copy choices of the model.
        moved: called whenever adapters change slots (the model state's batch info follows them).
    """

    def __init__(self, tuning: Tuning, sites: Callable[[], list], moved: Callable[[], None]):
        self.tuning = tuning
        self._sites = sites  # the model state's current lora.sites.Site list
        self._moved = moved
        self.registry = AdapterRegistry(())
        self.stored: Dict[str, StoredAdapter] = {}  # adapters registered by name (``lora.store``)
        # (id(registered adapter), module) -> this rank's (A, B) under tensor parallelism
        self.slices: Dict[tuple, tuple] = {}
        self.loads = 0  # loads so far (the value refresher's lists follow them)
        self.last_fold = False  # the fold choice of the last call that decided one (reports, tests)
        self._refresher: Optional[ValueRefresher] = None
        self._refresher_key = None
        self._dora_pools: list = []  # the pools with DoRA tables, listed with the refresher
        self.shared_versions = SharedVersions()  # each PEFT adapter's parameters on one version counter
        self._stage_cache: dict = {}  # staged folds' row indices and tables by layout (FoldStaging)
        self._ranks: Optional[List[int]] = None

    @property
    def sites(self) -> list:
        return self._sites()

    def values_unknown(self) -> None:
        """The next call copies every value it uses, whatever the version counters say."""
        self._refresher = None

    def moved(self) -> None:
        """Adapters changed slots or stacks were rebuilt: what is read from the slots is rebuilt."""
        self._ranks = None
        self._moved()

    def place(self, adapter_names: Optional[Sequence[str]], generation: int, fold: bool = True,
              changed_values_only: bool = False) -> bool:
        """Put these adapters in slots, copy their current values into the stacks (in place), decide
        whether the call folds the per-call sites (never where ``fold`` is False), stage their A
        blocks where it does, and return that choice. ``generation``: the model state's count of
        stack rebuilds (the value refresher is rebuilt with them). ``changed_values_only``: copy
        only the adapters whose parameters' version counters moved (``pool.ValueRefresher``)."""
        self.last_fold = False
        # len(), not truth: a NumPy array of names (PEFT takes any sequence) has no truth value
        if adapter_names is None or not len(adapter_names) or not (self.sites or self.registry.names):
            return False
        placed = self.registry.assign(adapter_names)
        if placed:
            try:
                self._load(placed)
            except BaseException:
                self.registry.release(placed)
                self.moved()
                for site in self.sites:  # blocks may have slid with the tables left behind
                    site.pool.invalidate()
                raise
        slots = {self.registry.slot[n] for n in set(adapter_names) if n in self.registry.slot}
        if not slots:
            return False
        folds = self.last_fold = fold and self.decide_fold(slots)
        key = (generation, self.loads)
        if self._refresher is None or self._refresher_key != key:
            self._refresher = ValueRefresher((s.pool for s in self.sites), self.shared_versions.witness)
            self._refresher_key = key
            # (pools are built, and their DoRA tables with them, only where the key moves)
            self._dora_pools = [s.pool for s in self.sites if s.pool.dora_tables is not None]
        self._refresher.refresh(slots, changed_only=changed_values_only)
        # DoRA's column scales from the values just copied (one host sync for every site's check)
        if self._dora_pools:
            sync_tables([p for p in (pool.dora_pending(slots, changed_values_only) for pool in self._dora_pools)
                         if p is not None])
        if folds:  # staged sites: the call's A blocks (current values) under the base weight
            for site in self.sites:
                site.pool.stage_call(slots, self._stage_cache)
        if fold:  # gate/up sites for ops.glu_lora: B's columns from the values and places just set
            for site in self.sites:
                site.pool.sync_b_columns()
        return folds

    def decide_fold(self, slots) -> bool:
        """Fold the per-call sites for a call using these slots: where the rows its adapters hold
        there are at least ``Tuning.fold_min_use`` of those sites' arenas (the GEMM computes them all)."""
        pools = [site.pool for site in self.sites if site.pool.folds_per_call()]
        if not pools or not slots or not all(pool.can_stage(slots) for pool in pools):
            return False
        used = sum(pool.rows_used(slots) for pool in pools)
        return used >= self.tuning.fold_min_use * sum(pool.fold_rows() for pool in pools)

    def fold_prone_adapters(self, k: int) -> List[str]:
        """The ``k`` adapters holding the most A rows in the per-call sites (staged: of those that
        fit the staging rows together): the set of ``k`` most likely to make a call fold them
        (warm-up captures that call's graph)."""
        pools = [site.pool for site in self.sites if site.pool.folds_per_call()]
        names = [n for n in self.registry.names if n in self.registry.index]
        by_rows = sorted(names, key=lambda n: -sum(p.adapter_rows(n) for p in pools))
        if not any(p.staging is not None for p in pools):
            return by_rows[:k]
        # staged sites: the largest that fit the staging rows together
        chosen, used = [], [0] * len(pools)
        for name in by_rows:
            rows = [p.adapter_rows(name) for p in pools]
            if all(u + r <= p.fold_rows() for u, r, p in zip(used, rows, pools)):
                chosen.append(name)
                used = [u + r for u, r in zip(used, rows)]
                if len(chosen) == k:
                    break
        return chosen

    def slot_ranks(self) -> List[int]:
        """Each slot's largest rank over the sites (what the batch info reads)."""
        if self._ranks is None:
            ranks = [0] * self.registry.num_slots
            for site in self.sites:
                for s, r in enumerate(site.pool.slot_ranks_host()):
                    ranks[s] = max(ranks[s], r)
            self._ranks = ranks
        return self._ranks

    def _load(self, placed):
        """Adapters newly given slots: every site loads them there."""
        t = time.perf_counter()
        # a load makes thousands of small objects, and with hundreds of adapters registered a
        # collection they trigger scans all of the registry's objects (measured costing more than
        # the load itself): paused for its length, at most one follows
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._load_now(placed)
        finally:
            if collecting:
                gc.enable()
        self.registry.stats["load_seconds"] += time.perf_counter() - t
        self.registry.stats["block_moves"] = sum(site.pool.block_moves for site in self.sites)
        self.loads += 1
        self.moved()

    def _load_now(self, placed):
        if not self.sites:  # (adapters on routed experts alone: their sites copy at the call boundary)
            return
        # registered adapters' buffers go first: their copies run while the pools place them
        buffers = [self.stored[name].buffer for _, name in placed
                   if name in self.stored and self.stored[name].buffer is not None]
        devices = {site.pool.lora_b.device for site in self.sites if site.pool.lora_b is not None}
        # (not under TP, whose pools hold each rank's slices: other storages)
        one_device = len(devices) == 1 and not self.slices
        prestaged = prestage(buffers, devices.pop(), self.tuning) if buffers and one_device else None
        peft_pairs, host_pairs, runs, tables = [], [], [], []
        for site in self.sites:
            pairs, fixed, site_runs, table = site.pool.load(placed)
            peft_pairs += pairs
            host_pairs += fixed
            runs += site_runs
            tables.append(table)
        copy_values(peft_pairs)
        # every pool's tables from one host buffer (pinned on CUDA): one copy to the GPU, then
        # batched device copies, instead of a pinned block and a copy per pool
        host = torch.cat([h for _, h in tables])
        if any(t.is_cuda for t, _ in tables):
            host = host.pin_memory()
        at = 0
        for device_table, h in tables:
            host_pairs.append((device_table, host[at: at + h.numel()]))
            at += h.numel()
        # pinned and never changed: the host need not wait
        copy_from_host(host_pairs, runs, prestaged, self.tuning)
