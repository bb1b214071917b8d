"""Adapter weights stacked per layer, so one kernel launch serves every adapter of a batch.

``AdapterRegistry`` (``lora.slots``) maps adapter names to the stacks' GPU slots for the whole
model. ``SitePool`` holds, for one LoRA *site* (a single LoRA layer, or a fused q/k/v or gate/up
group), the stacks the backend reads:

- ``packed``: each adapter at its own rank and only for the modules it targets
  (``backend.packed``): ``lora_a`` a (rows, in) arena (in: the vocabulary for an embedding),
  ``lora_b`` a flat one, and tables of where each (slot, module) block starts. Module j has its own
  region of both arenas, sized for the largest blocks that can be resident at once (all adapters,
  or the ``num_slots`` largest), and a ``RowArena`` places blocks in it as adapters take slots;
- ``ranks`` / ``scalings``: (num_slots, c), 0 rank for a module an adapter does not target.

Where the model state allows it (``fold``: the site's ``FusedGroup``), the A arena is stored as
rows under the site's base weight (``FusedGroup.attach_tail``), and decode takes the shrink from
the base GEMM (``folded``); with fewer slots than adapters, a smaller staging tail may be stored
there instead (``staging``: ``lora.staging.FoldStaging``).

The stacks are copies of PEFT's weights, kept current in two ways:

- *structure*: ``SitePool.stale()`` tells whether the stacks no longer fit PEFT's layers (adapters
  added or deleted, a parameter replaced or re-pointed by ``load_adapter``, ``model.to`` or
  ``param.data = ...``, a scaling changed), by names, tensor identity, storage address and
  scaling; the stacks are then rebuilt (new tensors: graphs holding the old ones are dropped).
  Per call, the adapters the call uses are checked through ``lora.watch`` (the same facts in flat
  lists), the layer-by-layer check only for an adapter found changed;
- *slots*: with fewer slots than adapters, ``SitePool.load`` puts an adapter in a slot (its
  views, ranks and scalings), in place;
- *values*: ``SitePool.copies`` lists, per slot, (stack view, PEFT parameter) pairs; the model
  state copies the values of the adapters a ``generate`` call uses into their views at its start
  (``torch._foreach_copy_``), whatever changed them: an optimizer step, ``param.data.add_()``,
  ``copy_`` from a checkpoint. In place, so the stacks keep their addresses and captured graphs
  stay valid. A continuous-batching step copies only the adapters whose parameters' version
  counters moved (``ValueRefresher``); its manager's start copies them all, so an edit through
  ``.data`` (which bumps no counter) reaches the engine at the next manager or ``generate_batch``.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..compat.adapters import (adapter_blocker, dora_magnitudes, lora_biases, lora_layer_unchanged, lora_weights,
                               watch_lora_layer)
from ..compat.modules import foreach_copy, is_dtensor, versions_of
from ..backend.packed import PackedWeights, block_align
from ..ops.glu_lora import b_columns
from ..tuning import Tuning
from .arena import RowArena
from .dora import DoraTables, sync_tables
from .slots import AdapterRegistry
from .staging import FoldStaging, staging_rows

__all__ = ["AdapterRegistry", "SitePool", "ValueRefresher", "copy_values"]
# rows of a gate/up site's ``ops.glu_lora`` scratch: the most a launch takes (``ops.tma_gemm.MAX_ROWS``)
GLU_SCRATCH_ROWS = 128


class GluBuffers(NamedTuple):
    """A gate/up site's buffers for ``ops.glu_lora`` (``GluLora``'s fields of the same names)."""

    scratch: torch.Tensor
    counters: torch.Tensor
    bt: torch.Tensor
    t0_pad: int


GLU_PAD = 64  # how far past B's end and a scratch row's arena columns it may read (``ops.glu_lora.MAX_RANK``)


def _storage_address(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (without making a storage object: slow on the host)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


class HostRun(NamedTuple):
    """A registered adapter's dense host tensor bound for elements ``[offset, offset + numel)`` of a
    flat stack buffer: what a slot load copies, without a device view made for it (the host's time
    per module is what a load costs). ``group``: the host storage's address and the device, the
    unit of one staged copy."""

    dst: torch.Tensor  # flat (1-D) stack buffer on the device
    offset: int
    src: torch.Tensor  # contiguous, of ``dst``'s dtype
    group: tuple
    src_offset: int  # ``src.storage_offset()``
    numel: int


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
                 in_features: int, embedding: bool = False, tuning: Optional[Tuning] = None):
        self.tuning = tuning if tuning is not None else Tuning()
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
        self.copies: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}  # slot -> (view, param)
        self._fixed: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}  # slot -> registered adapter's pairs
        self._runs: Dict[int, List[HostRun]] = {}  # slot -> registered adapter's runs (dense ones)
        # per adapter: its modules' (index, A, B, registered?, where A and B lie in their host storage
        # for a registered adapter copied as runs, else None), ranks and scalings, and why PEFT must
        # serve it
        self._sources: Dict[str, List[Tuple[int, torch.Tensor, torch.Tensor, bool, Optional[tuple]]]] = {}
        self._flat_a: Optional[torch.Tensor] = None  # lora_a as one row of elements
        self._ranks_of: Dict[str, List[int]] = {}
        self._scalings_of: Dict[str, List[float]] = {}
        self._unsupported_of: Dict[str, str] = {}
        self._bias_of: Dict[str, Dict[int, torch.Tensor]] = {}  # adapter -> module index -> B's bias
        # (num_slots, N_total): each slot's B bias (zeros where its adapter has none), or None
        self.bias: Optional[torch.Tensor] = None
        # DoRA adapter -> module index -> (its LoRA layer, the magnitude of a registered adapter, on the
        # device; None: PEFT's, read from the layer)
        self._dora_of: Dict[str, Dict[int, Tuple[torch.nn.Module, Optional[torch.Tensor]]]] = {}
        self._registered: set = set()  # the registered adapters' names (their values never change)
        self.dora_tables: Optional[DoraTables] = None  # DoRA's per-slot scale and shift (``lora.dora``)
        self._slot_ranks: List[List[int]] = []  # host copies of ``ranks`` and ``scalings``
        self._slot_scalings: List[List[float]] = []
        self._view_cache: Dict[Tuple[int, int, int], Tuple[torch.Tensor, torch.Tensor]] = {}  # of these stacks
        # packed (linear sites): the arenas' layout, the tables the kernels read, host copies
        self.packed: Optional[PackedWeights] = None
        self._tables: Optional[torch.Tensor] = None  # the device tables' one buffer
        self._arenas: List[RowArena] = []
        self._a_base: List[int] = []  # module j's first row in lora_a / element in lora_b
        self._b_base: List[int] = []
        self._slot_a_rows: List[List[int]] = []
        self._slot_b_offs: List[List[int]] = []
        self._slot_name: Dict[int, str] = {}  # slot -> adapter whose blocks it holds
        self.block_moves = 0  # blocks compaction has moved, over the pool's life
        self._broken = False  # a load failed part-way: rebuilt before the next call (``invalidate``)
        self._signature = None
        self._watched = None
        self._registry_names = None
        self.fold = None  # the site's FusedGroup, where the A arena may live under its base weight
        self.no_fold = "not eligible"  # why there is no ``fold`` (set by the model state)
        # the A arena (or the staging rows) was built as the tail of the fold's base weight (set by
        # ``rebuild``; a plain attribute: every engine step reads it for each pool)
        self.fold_attached = False
        self.staging: Optional[FoldStaging] = None  # a staged fold's rows under the base weight
        # a gated MLP's gate/up site (set by the model state): its arena rows' slots in the tables,
        # and, folded (not staged), the scratch and counters of ``ops.glu_lora``
        self.column_slots = False
        self.col_slot: Optional[torch.Tensor] = None  # (arena rows,) int32: the slot of each row, -1 free
        self.glu_buffers: Optional[GluBuffers] = None

    @property
    def stack_num(self) -> int:
        return len(self.layers)

    @property
    def num_slots(self) -> int:
        """GPU slots the stacks hold (0 before the first build)."""
        return self.ranks.shape[0] if self.ranks is not None else 0

    def nbytes(self) -> int:
        """The stacks' bytes, and ``ops.glu_lora``'s buffers where the site keeps them (B's columns: a
        second copy of its B)."""
        extra = (self.glu_buffers.scratch, self.glu_buffers.bt) if self.glu_buffers is not None else ()
        dora = self.dora_tables.nbytes() if self.dora_tables is not None else 0
        return dora + sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b, self.bias, *extra)
                          if t is not None)

    def adapter_nbytes(self) -> int:
        """The adapters' own weights for this site, in the stacks' dtype (every adapter fastlora
        serves, resident or not; the stacks hold the resident ones)."""
        if self.lora_a is None:
            return 0
        esize = self.lora_a.element_size()
        return sum((a.numel() + b.numel()) * esize for pairs in self._sources.values() for _, a, b, _, _ in pairs)

    def _current_signature(self, registry: AdapterRegistry):
        sig = [tuple(registry.names)]
        for layer in self.layers:
            if layer is None:
                sig.append(None)
                continue
            entries = []
            for name, (a, b, scaling) in lora_weights(layer).items():
                entries.append((name, id(a), a.data_ptr(), tuple(a.shape), id(b), b.data_ptr(),
                                tuple(b.shape), scaling))
            sig.append(tuple(entries))
        return tuple(sig)

    def _watch(self):
        """What ``stale`` checks on every forward, pre-resolved by ``watch_lora_layer`` (the
        same facts as the signature, read with plain dict and attribute reads); None for embedding
        sites or an unusual layout, which keep the signature."""
        if self.embedding:
            return None
        watch = []
        for layer in self.layers:
            if layer is None:
                continue
            entry = watch_lora_layer(layer)
            if entry is None:
                return None
            watch.append(entry)
        return watch

    def watched_layers(self) -> Optional[list]:
        """The per-layer facts ``stale`` checks (None: this site compares full signatures)."""
        return self._watched if self.lora_a is not None else None

    def _watch_clean(self, names) -> bool:
        return all(lora_layer_unchanged(entry, names) for entry in self._watched)

    def stale(self, registry: AdapterRegistry, dtype: torch.dtype, names=None) -> bool:
        """Whether the stacks no longer fit PEFT's adapters. ``names``: of the adapters' own
        parameters, check only these (None: all); the adapter set and scalings always."""
        if self._broken or self.lora_a is None or self.lora_a.dtype != dtype:
            return True
        if self._watched is not None:
            return self._registry_names != registry.names or not self._watch_clean(names)
        return self._signature != self._current_signature(registry)

    # inference_mode(False): a rebuild may run inside a forward under torch.inference_mode(), and
    # the stacks are updated in place by later calls outside it (PyTorch forbids that on inference
    # tensors)
    @torch.no_grad()
    @torch.inference_mode(False)
    def rebuild(self, registry: AdapterRegistry, dtype: torch.dtype, device: torch.device,
                stored: Optional[Dict[str, Dict[int, Tuple[torch.Tensor, torch.Tensor, float]]]] = None):
        """Fresh stacks with a slot for each of ``registry.num_slots``, the adapters in slots loaded,
        and the (view, parameter) pairs that keep them current. ``stored``: the registered adapters'
        (A, B, scaling) by stacked module index (``lora.store``; immutable, copied when loaded)."""
        c, n_slots = self.stack_num, registry.num_slots
        device = torch.device(device)
        self._broken = False
        self._sources, self._ranks_of, self._scalings_of, self._unsupported_of = {}, {}, {}, {}
        self._bias_of, self._dora_of, self._registered = {}, {}, set(stored or {})

        def add(name, j, a, b, scaling, fixed):
            runs = None
            if fixed and a.dtype == dtype and b.dtype == dtype and a.is_contiguous() and b.is_contiguous():
                runs = tuple((_storage_address(t), device, t.storage_offset(), t.numel()) for t in (a, b))
            self._sources.setdefault(name, []).append((j, a, b, fixed, runs))
            self._ranks_of.setdefault(name, [0] * c)[j] = a.shape[0]
            self._scalings_of.setdefault(name, [0.0] * c)[j] = scaling

        for j, layer in enumerate(self.layers):
            if layer is None:
                continue
            biases, magnitudes = lora_biases(layer), dora_magnitudes(layer)
            for name, (a, b, scaling) in lora_weights(layer).items():
                reason = adapter_blocker(layer, name)
                if reason:
                    self._unsupported_of[name] = reason
                add(name, j, a, b, scaling, False)
                if not reason and name in biases:  # (an adapter PEFT serves needs no table)
                    self._bias_of.setdefault(name, {})[j] = biases[name]
                if not reason and name in magnitudes:
                    self._dora_of.setdefault(name, {})[j] = (layer, None)
        for name, by_module in (stored or {}).items():
            for j, (a, b, scaling, extras) in by_module.items():
                add(name, j, a, b, scaling, True)
                if "bias" in extras:
                    self._bias_of.setdefault(name, {})[j] = extras["bias"]
                if "magnitude" in extras:
                    self._dora_of.setdefault(name, {})[j] = (self.layers[j], extras["magnitude"].to(device))
        # R: the width per module of the shrink output (or of an embedding lookup)
        r = max([1] + [x for row in self._ranks_of.values() for x in row])
        self.max_rank = r
        self.copies, self._fixed, self._runs, self.unsupported, self._view_cache = {}, {}, {}, {}, {}
        self._slot_ranks = [[0] * c for _ in range(n_slots)]
        self._slot_scalings = [[0.0] * c for _ in range(n_slots)]
        self._slot_a_rows = [[0] * c for _ in range(n_slots)]
        self._slot_b_offs = [[0] * c for _ in range(n_slots)]
        self._slot_name = {}
        # for an embedding, "in" is the vocabulary and A blocks are (rank, vocab) as PEFT stores them
        stage = self._allocate_packed(n_slots, dtype, device, per_call_ok=registry.all_resident)
        self.bias = (torch.zeros(n_slots, self.offsets[-1], dtype=dtype, device=device)
                     if self._bias_of and not self.embedding else None)
        self.dora_tables = DoraTables(n_slots, self.offsets, device) if self._dora_of else None
        for slot, name in enumerate(registry.resident):
            if name is not None:
                self._place(slot, name)
        for slot in self._slot_name:
            self._views_of(slot)
        self._tables = torch.empty(self._table_words(), dtype=torch.int32, device=device)
        self.ranks, self.scalings, a_rows, b_offs = self._table_views(self._tables)
        self.col_slot = self._tables[self._table_words() - self._column_words():] if self.column_slots else None
        self.glu_buffers = None
        if (self.column_slots and self.fold_attached and stage is None and c == 2
                and self.out_features[0] == self.out_features[1]):
            # the scratch (its rows 16 bytes aligned, the kernel's reads past R in them), the counters,
            # and B's columns as the arena's rows (up's region from a multiple of GLU_PAD)
            cols = -(-self.lora_a.shape[0] // 8) * 8 + GLU_PAD
            t0 = self._a_base[1]
            t0_pad = -(-t0 // GLU_PAD) * GLU_PAD
            width = -(-(t0_pad + self.lora_a.shape[0] - t0) // 8) * 8
            self.glu_buffers = GluBuffers(torch.empty(GLU_SCRATCH_ROWS, cols, dtype=dtype, device=device),
                                          torch.zeros(2, dtype=torch.int32, device=device),
                                          torch.zeros(self.out_features[0], width, dtype=dtype, device=device), t0_pad)
        self._write_tables()
        # all ranks multiples of 8: so is every block's place (sums of ranks), and B's rows load 16
        # bytes at a time
        layout = dict(align=block_align(x for row in self._ranks_of.values() for x in row),
                      mixed_ranks=len({x for row in self._ranks_of.values() for x in row if x > 0}) > 1)
        layout["bias"], layout["dora"] = self.bias, self.dora
        self.packed = PackedWeights(self.lora_a, self.lora_b, a_rows, b_offs, r, tuple(self.offsets), **layout)
        self.staging = None
        if stage is not None:
            stage_table = torch.zeros(n_slots, c, dtype=torch.int32, device=device)
            self.staging = FoldStaging(stage, PackedWeights(stage, self.lora_b, stage_table, b_offs, r,
                                                            tuple(self.offsets), **layout))
        self._signature = self._current_signature(registry)
        self._watched = self._watch()
        self._registry_names = list(registry.names)
        copy_values([pair for table in (self.copies, self._fixed) for pairs in table.values() for pair in pairs])
        for runs in self._runs.values():
            for run in runs:
                run.dst[run.offset: run.offset + run.numel].copy_(run.src.view(-1))
        self.sync_b_columns()
        sync_tables([self.dora_pending(self._slot_name)] if self.dora_tables is not None else [])

    @property
    def dora(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """DoRA's (scale, shift) tables, (num_slots, N_total) float32 each (``backend.packed``), or None."""
        return self.dora_tables.tables if self.dora_tables is not None else None

    def dora_pending(self, slots: Iterable[int], versions_suffice: bool = False):
        """What ``lora.dora.sync_tables`` takes to bring DoRA's scale and shift of the DoRA adapters in
        ``slots`` up to date (the slot loader, at each call boundary after the value copies, for all
        sites at once); None for a site without DoRA tables. ``versions_suffice``: ``DoraTables.stale``."""
        if self.dora_tables is None:
            return None
        entries = [(slot, j, self._slot_name[slot], source) for slot in slots if slot in self._slot_name
                   for j, source in self._dora_of.get(self._slot_name[slot], {}).items()]

        def registered_views(slot, j):
            rank = self._slot_ranks[slot][j]
            return self.packed_view_a(slot, j, rank), self.packed_view_b(slot, j, rank), self._slot_scalings[slot][j]

        return (self.dora_tables, *self.dora_tables.stale(entries, registered_views, versions_suffice),
                self.lora_a.dtype)

    def sync_b_columns(self) -> None:
        """A gate/up site with ``glu_buffers``: B's columns as the arena's rows, from the packed B and
        its tables as they are now (the model state calls it after each call's loads and copies)."""
        if self.glu_buffers is None:
            return

        p, bt = self.packed, self.glu_buffers.bt
        with torch.cuda.device(bt.device) if bt.is_cuda else contextlib.nullcontext():  # (Triton's launch device)
            b_columns(p.b, self.col_slot, self.ranks, p.a_rows, p.b_offs, self._a_base[1], self.glu_buffers.t0_pad, bt)

    def _allocate_packed(self, n_slots: int, dtype: torch.dtype, device,
                         per_call_ok: bool = True) -> Optional[torch.Tensor]:
        """Arenas with a region per module, each sized for the ``n_slots`` largest blocks any
        adapter has there (all of them when every adapter has a slot): whichever adapters hold
        the slots, their blocks fit. ``per_call_ok``: the A arena may fold per call (every adapter
        in a slot; with fewer slots the arena is sized for the largest adapters, not for those
        loaded, and a call rarely uses enough of it). Returns the staging rows under the base
        weight where the fold is staged, else None."""
        c = self.stack_num
        self._arenas, self._a_base, self._b_base = [], [], []
        rows_total = elems_total = 0
        for j in range(c):
            blocks = sorted((ranks[j] for ranks in self._ranks_of.values() if ranks[j] > 0), reverse=True)
            capacity = sum(blocks[:n_slots])
            self._arenas.append(RowArena(capacity))
            self._a_base.append(rows_total)
            self._b_base.append(elems_total)  # capacity is a multiple of 8: so is every offset
            rows_total += capacity
            elems_total += capacity * self.out_features[j]
        stage_rows = 0 if per_call_ok else staging_rows((sum(ranks) for ranks in self._ranks_of.values()),
                                                        n_slots, self.tuning.fold_stage_margin)
        self.lora_a = (self.fold.attach_tail(rows_total, dtype, device, max_share=self.tuning.fold_max_share,
                                             call_share=self.tuning.fold_call_share, per_call_ok=per_call_ok,
                                             stage_rows=stage_rows)
                       if self.fold is not None else None)
        self.fold_attached = self.lora_a is not None
        stage = None
        if self.fold_attached and self.fold.staged:  # the tail is the staging area; the arena its own
            stage, self.lora_a = self.lora_a, None
        if self.lora_a is None:
            self.lora_a = torch.zeros(max(rows_total, 1), self.in_features, dtype=dtype, device=device)
        pad = GLU_PAD if self.column_slots else 0  # (ops.glu_lora reads past a block's end)
        self.lora_b = torch.zeros(max(elems_total, 8) + pad, dtype=dtype, device=device)[: max(elems_total, 8)]
        self._flat_a = self.lora_a.view(-1) if self.lora_a.is_contiguous() else None
        return stage

    def region_start(self, j: int) -> int:
        """Module j's first row in the A arena (its region: ``lora.arena``)."""
        return self._a_base[j]

    def folded(self) -> bool:
        """The A arena (or, staged, the staging rows) is the tail of the base weight it was attached
        to, and that weight is still the layers' (``x @ [W; A].T`` then gives the base output and
        the shrink)."""
        f = self.fold
        if not (self.fold_attached and f.tail is not None and f.is_intact()):
            return False
        rows = (self.staging.rows if self.staging is not None else None) if f.staged else self.lora_a
        return rows is not None and f.tail.data_ptr() == rows.data_ptr() and f.tail.shape == rows.shape

    def folds_per_call(self) -> bool:
        """Folded, but only for calls whose adapters use enough of the arena (``Tuning.fold_min_use``)
        or, staged, whose adapters' blocks fit the staging rows."""
        return self.folded() and self.fold.per_call

    def fold_rows(self) -> int:
        """Rows the folded GEMM carries under the base weight (the arena, or the staging rows)."""
        return self.fold.tail.shape[0] if self.folded() else 0

    def fold_weights(self) -> PackedWeights:
        """The packed weights a folded forward's expand reads (A's columns where the GEMM has them)."""
        return self.staging.packed if self.staging is not None else self.packed

    def can_stage(self, slots) -> bool:
        """Staged: these slots' A blocks fit the staging rows. (Not staged: True.)"""
        return self.staging is None or self.staging.fits(self.rows_used(slots))

    def stage_call(self, slots, cache: dict) -> None:
        """Staged: these slots' A blocks (current values) into the staging rows (``FoldStaging.stage``;
        ``cache`` shared by the pools). Not staged: nothing."""
        if self.staging is not None:
            self.staging.stage(self.lora_a, slots, self._slot_a_rows, self._slot_ranks, cache)

    def adapter_rows(self, name: str) -> int:
        """A rows adapter ``name`` has here (over the stacked modules), in a slot or not."""
        return sum(self._ranks_of.get(name, ()))

    def rows_used(self, slots) -> int:
        """A rows these slots hold here (over the stacked modules): what a call using them reads."""
        return sum(sum(self._slot_ranks[s]) for s in slots if 0 <= s < len(self._slot_ranks))

    def fold_refusal(self) -> Optional[str]:
        """Why decode-sized forwards of this site do not take the folded GEMM (None: they do)."""
        if self.fold is None:
            return self.no_fold
        if self.folded():
            return None
        return self.fold.fold_refusal or "its base weight has new storage since the stacks were built"

    def fold_lost(self) -> bool:
        """Folded when built, but the base weight has moved since (``model.to``, a reload)."""
        return self.fold_attached and not self.folded()

    @property
    def broken(self) -> bool:
        """A load failed part-way since the last rebuild (``invalidate``)."""
        return self._broken

    def invalidate(self) -> None:
        """A load failed part-way (blocks may have moved on the device, the tables there may not
        have followed): the next call rebuilds the stacks from the adapters in slots."""
        self._broken = True

    def _place(self, slot: int, name: str) -> set:
        """Slot ``slot`` holds adapter ``name`` from now on (blocks, ranks, reasons; its weights
        are copied in by the caller). Returns the other slots whose packed blocks moved to make
        room: their weights are moved on the device here, their views are stale."""
        moved = set()
        self._slot_name[slot] = name
        for arena in self._arenas:
            arena.free(slot)
        for j, a, _, _, _ in self._sources.get(name, ()):
            moves = self._arenas[j].alloc(slot, a.shape[0])
            if moves:
                self._move_blocks(j, moves)
                moved |= set(moves)
        self._slot_ranks[slot] = list(self._ranks_of.get(name, [0] * self.stack_num))
        self._slot_scalings[slot] = list(self._scalings_of.get(name, [0.0] * self.stack_num))
        reason = self._unsupported_of.get(name)
        if reason:
            self.unsupported[slot] = reason
        else:
            self.unsupported.pop(slot, None)
        if self.bias is not None:  # the modules this adapter has no bias for add none
            self.bias[slot].zero_()
        if self.dora_tables is not None:  # plain LoRA until ``dora_pending`` finds a DoRA adapter here
            self.dora_tables.reset(slot)
        return moved

    @torch.no_grad()
    def _move_blocks(self, j: int, moves) -> None:
        """Compaction slid blocks of module j down: move their A rows and B blocks on the device,
        in address order (a block never lands on one not yet moved; where it overlaps its own old
        place, through a copy). A block whose slot is being loaded in the same call moves
        garbage: its weights are copied to its new place afterwards."""
        width = self.out_features[j]
        self.block_moves += len(moves)
        for old, new, rows in moves.values():
            a0, b0 = self._a_base[j], self._b_base[j]
            for src, dst in ((self.lora_a[a0 + old: a0 + old + rows], self.lora_a[a0 + new: a0 + new + rows]),
                             (self.lora_b[b0 + old * width: b0 + (old + rows) * width],
                              self.lora_b[b0 + new * width: b0 + (new + rows) * width])):
                dst.copy_(src.clone() if old - new < rows else src)

    def _views_of(self, slot: int) -> None:
        """What copies the adapter in ``slot`` where its blocks are now: (view, weight) pairs, and
        runs for a registered adapter's dense weights; the packed tables' host copies follow."""
        pairs, fixed, runs = [], [], []
        flat_a, width_a = self._flat_a, self.in_features
        for j, a, b, registered, where in self._sources.get(self._slot_name[slot], ()):
            k = a.shape[0]
            start = self._arenas[j].start_of(slot)
            a_row = self._slot_a_rows[slot][j] = self._a_base[j] + start
            b_off = self._slot_b_offs[slot][j] = self._b_base[j] + start * self.out_features[j]
            if where is not None and flat_a is not None:
                (a_group, a_device, a_at, a_n), (b_group, b_device, b_at, b_n) = where
                runs.append(HostRun(flat_a, a_row * width_a, a, (a_group, a_device), a_at, a_n))
                runs.append(HostRun(self.lora_b, b_off, b, (b_group, b_device), b_at, b_n))
                continue
            views = self._view_cache.get((j, start, k))
            if views is None:  # the same (module, place, rank) views serve every adapter that comes
                if len(self._view_cache) >= 4 * len(self._slot_ranks) * self.stack_num:
                    self._view_cache.clear()  # bounded: places and ranks vary with the traffic
                views = self._view_cache[(j, start, k)] = (self.packed_view_a(slot, j, k),
                                                           self.packed_view_b(slot, j, k))
            (fixed if registered else pairs).extend(zip(views, (a, b)))
        name = self._slot_name[slot]
        for j, bias in self._bias_of.get(name, {}).items():
            (fixed if name in self._registered else pairs).append((self.bias[slot, self.offsets[j]: self.offsets[j + 1]], bias))
        self.copies[slot] = pairs  # PEFT's parameters: copied again by the calls that use them
        self._fixed[slot] = fixed
        self._runs[slot] = runs

    def packed_view_a(self, slot: int, j: int, rank: int) -> torch.Tensor:
        """Module j's A of ``slot`` in the packed arena, (rank, in)."""
        row = self._slot_a_rows[slot][j]
        return self.lora_a[row: row + rank]

    def packed_view_b(self, slot: int, j: int, rank: int) -> torch.Tensor:
        """Module j's B of ``slot`` in the packed arena, (out_j, rank)."""
        off, width = self._slot_b_offs[slot][j], self.out_features[j]
        return self.lora_b[off: off + width * rank].view(width, rank)

    @torch.no_grad()
    @torch.inference_mode(False)
    def load(self, placed: Sequence[Tuple[int, str]]) -> Tuple[list, list, list, Tuple[torch.Tensor, torch.Tensor]]:
        """Put each adapter ``name`` in its slot (replacing what the slot held): ranks and scalings
        change with it (the stacks keep their addresses, so graphs that read them stay valid; a
        module the adapter does not target gets rank 0 and is not read). Returns what the caller
        copies, for all pools at once: the (view, weight) pairs of PEFT's parameters, those of the
        registered adapters' (host) tensors, the registered adapters' runs, and (device tables,
        their new host contents)."""
        pairs, fixed, runs, moved = [], [], [], set()
        for slot, name in placed:
            moved |= self._place(slot, name)
        for slot in moved:  # moved on the device: new views and places, same weights
            self._views_of(slot)
        for slot, _ in placed:
            self._views_of(slot)
            pairs += self.copies[slot]
            fixed += self._fixed[slot]
            runs += self._runs[slot]
        return pairs, fixed, runs, (self._tables, self._host_tables())

    # the (num_slots, c) tables the kernels read live in one int32 buffer, written in place by one
    # copy per load: ranks, scalings (float32 bits), A rows, B offsets (int64, 8-byte aligned)
    # (a gate/up site's (``column_slots``) then the slot of each A arena row, int32)
    def _table_words(self) -> int:
        n = len(self._slot_ranks) * self.stack_num
        return 3 * n + (3 * n) % 2 + 2 * n + self._column_words()

    def _column_words(self) -> int:
        return sum(arena.capacity for arena in self._arenas) if self.column_slots else 0

    def _table_views(self, buf: torch.Tensor):
        n_slots, c = len(self._slot_ranks), self.stack_num
        n = n_slots * c
        b0 = 3 * n + (3 * n) % 2
        return (buf[:n].view(n_slots, c), buf[n:2 * n].view(torch.float32).view(n_slots, c),
                buf[2 * n:3 * n].view(n_slots, c), buf[b0:b0 + 2 * n].view(torch.int64).view(n_slots, c))

    def _host_tables(self) -> torch.Tensor:
        """The tables' contents on the host, in the layout of ``_table_views`` (packed with
        ``array``: a few tensor ops fewer per pool and load, whose cost is the host's time)."""
        words = bytearray()
        for code, rows in (("i", self._slot_ranks), ("f", self._slot_scalings), ("i", self._slot_a_rows)):
            words += array(code, [x for row in rows for x in row]).tobytes()
        if len(words) % 8:  # the int64 offsets start at an 8-byte boundary
            words += bytes(4)
        words += array("q", [x for row in self._slot_b_offs for x in row]).tobytes()
        if self.column_slots:
            cols = array("i", [-1]) * self._column_words()
            for slot, (rows, ranks) in enumerate(zip(self._slot_a_rows, self._slot_ranks)):
                for row, rank in zip(rows, ranks):
                    if rank:
                        cols[row: row + rank] = array("i", [slot]) * rank
            words += cols.tobytes()
        assert len(words) == 4 * self._table_words()
        return torch.frombuffer(words, dtype=torch.int32)

    def _write_tables(self) -> None:
        """The host copies of the tables into the device buffer, in place (graphs keep reading it).
        On CUDA from pinned memory (PyTorch's pinned allocator recycles the block once the copy is
        done): the host never waits for the GPU here."""
        host = self._host_tables()
        if self._tables.is_cuda:
            self._tables.copy_(host.pin_memory(), non_blocking=True)
        else:
            self._tables.copy_(host)

    def slot_ranks_host(self) -> List[int]:
        """Largest rank of each slot over the stacked modules (host list)."""
        return [max(row) for row in self._slot_ranks] if self.ranks is not None else []


def _grouped(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> Dict[tuple, Tuple[list, list]]:
    """Pairs grouped so that ``torch._foreach_copy_`` can take its multi-tensor path on CUDA (same
    device and dtypes, same shapes and strides within a group); other pairs form their own groups
    and are copied one by one by the same call."""
    groups: Dict[tuple, Tuple[list, list]] = {}
    for dst, src in pairs:
        same_layout = dst.shape == src.shape and dst.stride() == src.stride()
        dsts, srcs = groups.setdefault((dst.device, dst.dtype, src.dtype, same_layout), ([], []))
        dsts.append(dst)
        srcs.append(src)
    return groups


@torch.no_grad()
def copy_values(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each parameter into its stack view (cast to the stack's dtype)."""
    for dsts, srcs in _grouped(pairs).values():
        foreach_copy(dsts, srcs)


class ValueRefresher:
    """The (stack view, parameter) pairs of every site, per slot, grouped once, so that refreshing
    the adapters of a call is a few ``torch._foreach_copy_`` calls whatever the number of sites.

    ``refresh(slots)`` copies every pair of those slots (a ``generate`` call: whatever changed the
    values, ``.data`` edits too). ``refresh(slots, changed_only=True)`` copies the slots whose
    parameters' version counters moved since their last copy (a continuous-batching step: tens of
    adapters at every step, most of them unchanged): in-place ops on a parameter (an optimizer
    step, ``copy_``, ``load_state_dict``) bump its counter, edits through ``.data`` do not.
    ``witness``: the tensor to read a parameter's counter from (``shared_versions``: one buffer's
    for all of an adapter's parameters re-homed onto it)."""

    def __init__(self, pools: Iterable[SitePool], witness: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self.by_slot: Dict[int, Dict[tuple, Tuple[list, list]]] = {}
        pairs_by_slot: Dict[int, list] = {}
        for pool in pools:
            for slot, pairs in pool.copies.items():
                pairs_by_slot.setdefault(slot, []).extend(pairs)
        # slot -> the tensors whose version counters tell whether its parameters moved (None: no
        # trusted versions)
        self._sources: Dict[int, Optional[list]] = {}
        for slot, pairs in pairs_by_slot.items():
            self.by_slot[slot] = _grouped(pairs)
            sources = [src for _, src in pairs]
            witnesses = {id(w): w for w in map(witness, sources)}
            self._sources[slot] = None if any(is_dtensor(t) for t in sources) else list(witnesses.values())
        self._copied: Dict[int, tuple] = {}  # slot -> its parameters' versions at its last copy
        self._merged: Dict[tuple, list] = {}  # slot set -> its groups' (dsts, srcs), recent ones

    @torch.no_grad()
    def refresh(self, slots: Iterable[int], changed_only: bool = False) -> None:
        key = tuple(sorted(set(slots)))
        versions = {slot: None if self._sources.get(slot) is None else versions_of(self._sources[slot])
                    for slot in key}
        if changed_only:
            key = tuple(s for s in key if versions[s] is None or versions[s] != self._copied.get(s))
            if not key:
                return
        merged = self._merged.get(key)
        if merged is None:
            # the same sets recur (a server's steps): their merged lists are kept, a few of them
            merged = {}
            for slot in key:
                for group, (dsts, srcs) in self.by_slot.get(slot, {}).items():
                    m = merged.setdefault(group, ([], []))
                    m[0].extend(dsts)
                    m[1].extend(srcs)
            merged = list(merged.values())
            if len(self._merged) >= 8:
                self._merged.pop(next(iter(self._merged)))
            self._merged[key] = merged
        for dsts, srcs in merged:
            foreach_copy(dsts, srcs)
        for slot in key:
            if versions[slot] is None:
                self._copied.pop(slot, None)
            else:
                self._copied[slot] = versions[slot]
