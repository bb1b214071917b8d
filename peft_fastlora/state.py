"""``FastLoRAState``: everything fastlora keeps on a patched model, built and torn down here.

It owns the LoRA sites and their pools (``lora/``), the backend, the generate hook and graph
runner (``decode/``) and the base-model kernels (``base_ops/``). What a call tells the layers is
one ``CallContext`` value (``call_context``), entered at the call's boundary (``call``,
``segments``, ``forward_context``, the forward pre-hook) and passed down by the layers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from . import kernel_support
from .compat.adapters import adapter_blocker, lora_layer_blocker, plain_scalings
from .compat.bitsandbytes import outlier_threshold
from .compat.modules import is_conv1d, linear_in_out, local, on_device
from .compat.peft import (LoraEmbedding, LoraLinear, adapter_dicts, adapter_names_of, adapter_parameters,
                          base_layer_of, guard_peft_forward_hooks, has_auxiliary_wrappers, is_lora_layer,
                          is_peft_model, is_tuner_layer, quantized_base_kind, registration_epoch,
                          unguard_peft_forward_hooks, unwrap_peft)
from .compat.tensor_parallel import declared_tp_plans, tp_local_stored, tp_style
from .backend import get_backend, resolve_backend_name
from .base_ops import BaseOps, activation_kind, has_gated_forward, install_base_ops, stream_wanted
from .batch import TokenSegments
from .call_context import CallContext, CallScope, ForwardBoundary
from .continuous.engine import ContinuousBatchingHook
from .decode import plan as decode_plan
from .decode.generate import GenerateHook
from .decode.plan import DecodePlan
from .decode.runner import DecodeGraphRunner
from .lora.fusion import FusedGroup, IntactWatch, SeparateGroup, find_groups, fusion_blocker
from .lora.mutations import AdapterMutationLock
from .lora.experts import ExpertsSite, find_expert_sites
from .lora.pool import AdapterRegistry, SitePool
from .lora.batch_infos import BatchInfos
from .lora.beside import SideStreams
from .lora.slot_loader import SlotLoader
from .lora.slots import check_adapter_names
from .lora.store import SCAFFOLD_ADAPTER
from .lora.watch import AdapterWatch, FoldWatch, StructureWatch
from .lora.sites import EmbeddingSite, FusedSite, LinearSite, Site
from .options import PatchOptions
from .lora.plan import LoRAPlan
from .report import PatchReport

logger = logging.getLogger("peft_fastlora")


class FastLoRAState:
    """Everything fastlora keeps on a patched model.

    The layers take the current ``CallContext`` (``context()``) once per forward: it changes only
    at a call's boundary (``call``, entered by the patched ``generate``; ``segments``, by a
    continuous-batching step; the model's forward pre-hook for a forward outside both) and inside
    ``forward_context`` (entered by the graph runner around a capture or an emulated replay).
    """

    def __init__(self, model: nn.Module, options: PatchOptions):
        self.model = model
        self.inner = unwrap_peft(model)
        self.options = options
        # the adapter side: registry, registered adapters, slots, values, the per-call fold choice
        self.slots = SlotLoader(options.tuning, lambda: self.sites, self.slots_moved)
        self.batch_infos = BatchInfos(lambda: self.backend, lambda: self.device, self.slots)
        self.device: Optional[torch.device] = None
        self.backend = None
        self.lora_plan = LoRAPlan(backend="none", device="none")  # lora.plan: what the LoRA build decided
        self.report: Optional[PatchReport] = None  # rendered from the plans (``_render_report``)
        self.sites: List[Site] = []
        self.expert_sites: List[ExpertsSite] = []  # MoE layers whose expert parameters have LoRA
        self.groups = []
        self.side_streams = SideStreams()  # an 8-bit site's LoRA delta computed beside its matmul
        self.base_ops: Optional[BaseOps] = None
        self.generate_hook = None  # decode.generate.GenerateHook
        self.mutation_lock = None  # lora.mutations.AdapterMutationLock
        self.generation = 0  # bumped whenever a stack or fused weight is rebuilt (graphs hold them)
        self.graph_runner = None
        self.decode_plan = DecodePlan("not built")  # decode.plan: graphs, stop check, token selection
        # one call at a time: a continuous-batching step (engine thread) and a generate call
        # (caller's thread) share the stacks and the batch-info buffers, so they take turns
        self.call_lock = threading.RLock()
        self._warned: set = set()
        self._hook = None
        self._watches: dict = {}  # adapter name -> lora.watch.AdapterWatch (the per-call check)
        self._peft_config_keys = self._config_keys()
        self._adapter_count = None  # LoRA adapters summed over the sites' layers, at the last check
        self._counted = (None, [])  # (registration epoch, generation), the dicts those adapters are in
        self._structure: Optional[StructureWatch] = None  # the engine steps' flat structure check
        self._intact: Optional[IntactWatch] = None  # each call's flat check of the fused groups
        self._folds: Optional[FoldWatch] = None  # and of the pools' folds
        self.takes_adapter_names = False  # see serve_adapter_names
        self.calls = CallScope()  # each thread's CallContext
        self.continuous = None  # continuous.engine.ContinuousBatchingHook
        self._peft_names: List[str] = []  # the adapters PEFT's layers hold, at the last build
        self._layer_names: dict = {}  # id(LoRA layer) -> its module name in the model

    def _config_keys(self):
        # the config objects too: an adapter deleted and added again under its name is a new one
        cfg = getattr(self.model, "peft_config", None)
        return tuple(sorted((k, id(v)) for k, v in cfg.items())) if isinstance(cfg, dict) else None

    @property
    def has_lora(self) -> bool:
        return bool(self.sites or self.expert_sites)

    @property
    def registry(self) -> AdapterRegistry:
        """Adapter names and GPU slots (``SlotLoader.registry``)."""
        return self.slots.registry

    @property
    def stored(self) -> dict:
        """Adapters registered by name (``fastlora.register_adapter``), kept across rebuilds: name
        -> ``lora.store.StoredAdapter`` (``SlotLoader.stored``)."""
        return self.slots.stored

    @property
    def last_fold(self) -> bool:
        """The fold choice of the last call that decided one (``SlotLoader.last_fold``)."""
        return self.slots.last_fold

    def context(self) -> CallContext:
        """This thread's ``CallContext`` (what the current call tells the layers)."""
        return self.calls.current()

    @contextlib.contextmanager
    def forward_context(self, graph_batch_info):
        """Forwards run inside are a graphed decode step (a capture, or an emulated replay): the
        layers read ``graph_batch_info`` (the backend's static buffers, refreshed in place by the
        runner) and skip the per-forward checks."""
        with self.calls.entered(self.context().replace(graph_batch_info=graph_batch_info)):
            yield

    @contextlib.contextmanager
    def exclusive(self):
        """Inside, no call or engine step runs, and no GPU work of an async engine step launched
        before still reads what the caller changes (adapters added, deleted or registered)."""
        with self.call_lock:
            self.wait_for_engine()
            yield

    def wait_for_engine(self) -> None:
        """Return once the GPU work of the engine steps launched so far is done (async batching)."""
        if self.continuous is not None:
            self.continuous.in_flight.wait()

    @contextlib.contextmanager
    def call(self, adapter_names: Optional[Sequence[str]], fold: bool = True, step: bool = False):
        """One ``generate`` call (or one continuous-batching step): PEFT's adapters are checked and
        the values of the ones the call uses copied into the stacks once, here; the forwards inside
        skip both. Calls from different threads run one after the other. ``fold=False``: the
        per-call sites keep the fused kernel, nothing is staged. ``step``: a continuous-batching
        step, which copies only the values whose version counters moved (the manager's start
        copies them all: ``values_unknown``)."""
        check_adapter_names(adapter_names)
        current = self.context()
        if current.checked:
            yield
            return
        with self.call_lock:
            self.sync(adapter_names, storage=not step)
            folds = self.refresh_values(adapter_names, fold=fold, changed_values_only=step)
            with self.calls.entered(current.replace(checked=True, fold=folds, boundary=None)), \
                    on_device(self.device):
                yield

    def values_unknown(self) -> None:
        """The next call or engine step copies every adapter value it uses (a manager starting:
        its steps then copy only what their version counters show changed)."""
        with self.call_lock:
            self.slots.values_unknown()
            for watch in self._watches.values():
                watch.forget_checks()

    def serve_adapter_names(self, kwargs):
        """In place of PEFT's per-call hooks (``guard_peft_forward_hooks``): a context in
        which the LoRA layers read the call's ``adapter_names`` from the ``CallContext``, or None
        where PEFT must hook them itself (beam search, aLoRA, training mode, layers or wrappers
        fastlora does not serve). Unknown names raise PEFT's error."""
        names = kwargs.get("adapter_names")
        check_adapter_names(names)
        if (names is None or not self.takes_adapter_names or kwargs.get("alora_offsets") is not None
                or int(kwargs.get("num_beams", 1) or 1) > 1 or self.model.training):
            return None
        if not isinstance(names, (list, tuple)):
            if not hasattr(names, "tolist"):
                return None  # PEFT's own check takes it
            names = [str(n) for n in names.tolist()]  # a (flat: checked above) NumPy array of names
        config = getattr(self.model, "peft_config", None) or {}
        unknown = {n for n in names if n != "__base__"} - set(self.registry.names) - set(config) - set(self.stored)
        if unknown:  # PEFT's message
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}")
        return self.calls.entered(self.context().replace(names=tuple(names)))

    def folds_per_call(self) -> bool:
        """Some site folds only for calls that use enough of its arena (graphs then differ by call)."""
        return any(site.pool.folds_per_call() for site in self.sites)

    @contextlib.contextmanager
    def segments(self, segments: TokenSegments):
        """Forwards run inside (in this thread) hold ``segments`` in their one row: each LoRA layer
        applies each sequence's adapter. One call boundary, as for a ``generate`` call."""
        with self.call(sorted(set(segments.names)), fold=False, step=True):
            with self.calls.entered(self.context().replace(segments=segments)):
                yield

    # -- building ---------------------------------------------------------------------------
    def build(self) -> PatchReport:
        self._build_lora()
        self._hook = self.inner.register_forward_pre_hook(lambda module, args: self.begin_forward())
        self.generate_hook = GenerateHook(self)
        self.mutation_lock = AdapterMutationLock(self)
        self.continuous = ContinuousBatchingHook(self)
        guard_peft_forward_hooks(self.model, serve=self.serve_adapter_names)
        self.base_ops = install_base_ops(self.inner, self.options, self.device)
        self._set_group_gemms()
        self._update_graph_runner()
        report = self._render_report()
        self._log_disabled(report)
        return report

    def _set_group_gemms(self):
        """The LoRA sites' fused groups (siblings, folded ``[W; A]``) take the base ops' GEMM.
        Continuous-batching forwards keep cuBLAS: the streaming GEMM was measured in ``generate``'s
        decode steps only."""
        gemm = self.base_ops.gemm
        stream = self.base_ops.stream
        if stream is not None:
            stream.skip = lambda: self.context().segments is not None
        self.base_ops.gated.clear("lora")
        glu_tokens = self.options.tuning.glu_expand_min_tokens
        if getattr(self.backend, "name", None) != "triton":
            glu_tokens = None
        for g in self.groups:
            g.gemm = gemm
        for site in self.sites:
            if site.pool.fold is not None:
                site.pool.fold.gemm = gemm
            mlp = getattr(site, "parent", None)
            if site.kind != "gate_up" or mlp is None or not has_gated_forward(mlp):
                continue
            # both deltas inside the activation's launch: at 65-128 rows of a folded site the base
            # GEMM and the shrink too (ops.glu_lora); at prefill after them (ops.glu_expand)
            paths = tuple(path for path, on in (("glu_lora", stream is not None and site.pool.column_slots),
                                                ("glu_expand", glu_tokens is not None)) if on)
            if paths:
                self.base_ops.gated.set("lora", mlp, site.gated(self, mlp, stream, activation_kind(mlp.act_fn),
                                                                glu_tokens), paths)

    def _render_report(self) -> PatchReport:
        """The report, rendered from what the build decided: the LoRA plan, the base ops, the
        continuous-batching hook and the decode plan (each says why anything is off)."""
        fields = self.lora_plan.report_fields()
        if self.base_ops is not None:
            fields.update(self.base_ops.report_fields())
        if self.continuous is not None:
            fields["continuous_batching"] = self.continuous.report_field()
        fields.update(self.decode_plan.report_fields())
        self.report = PatchReport(**fields)
        return self.report

    def _build_lora(self) -> None:
        """Registry, backend, sites and fused groups (everything an adapter change rebuilds)."""
        model = self.model
        lora_layers = [(n, m) for n, m in model.named_modules() if is_lora_layer(m)]
        names = set()
        for _, m in lora_layers:
            names |= adapter_names_of(m)
        if not names:
            # qualified names: a LoHa or IA3 layer class is just called "Linear"
            tuners = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                             if is_tuner_layer(m) and not is_lora_layer(m)})
            if tuners:
                cfg = getattr(model, "peft_config", None)
                kinds = [getattr(c, "peft_type", None) for c in cfg.values()] if isinstance(cfg, dict) else []
                types_ = sorted({str(getattr(k, "value", k)) for k in kinds if k is not None})
                raise TypeError(
                    f"fastlora accelerates LoRA adapters only; this model has "
                    f"{', '.join(types_) or 'other'} adapters ({', '.join(tuners)})")
            if lora_layers or is_peft_model(model):
                raise ValueError("fastlora.patch: the PEFT model holds no LoRA adapters")
            self._build_base_only()
            return
        self._peft_names = sorted(names)
        # before any stack records the parameters' storage: re-homing them moves it
        by_adapter: Dict[str, list] = {}
        for _, m in lora_layers:
            for name, params in adapter_parameters(m).items():
                by_adapter.setdefault(name, []).extend(params)
        self.slots.shared_versions.share(by_adapter.values())
        first = next(p for _, m in lora_layers for p in m.parameters())
        self.device = first.device
        backend_name = resolve_backend_name(self.options.backend, self.device)
        name_of = {id(m): n for n, m in model.named_modules()}
        self._layer_names = {id(m): n for n, m in lora_layers}
        names |= self._servable_stored(names)
        self.slots.registry = AdapterRegistry(names, num_slots=self.options.max_loras_per_batch)
        self._ensure_backend(backend_name)
        left_on_peft, adapter_fallbacks, fusion_blocked, quantized_joined = [], [], [], []
        served = set()
        tuning = self.options.tuning
        fold_off = self._fold_blocker()
        glu_wanted = stream_wanted(self.inner, self.options, self.device)
        if self.options.fuse:
            groups, blocked = find_groups(model)
            fusion_blocked = [(f"{name_of.get(id(model), '')}{g}", why) for g, why in blocked]
            for g in groups:
                if any(m.__dict__.get("forward") is not None for m in g.members):
                    fusion_blocked.append((g.parent_name, "a member already has its own forward"))
                    continue
                if g.separate:
                    unjoined = g.join()
                    joined = unjoined is None
                    quantized_joined.append((f"{g.parent_name}.{g.kind}" if g.parent_name else g.kind, unjoined))
                else:
                    g.fuse()
                self.groups.append(g)
                pool = SitePool([m if is_lora_layer(m) else None for m in g.members], g.out_features,
                                g.in_features, tuning=tuning)
                if g.separate:
                    pool.no_fold = (f"its {g.separate} base layers share one bitsandbytes matmul, not fastlora's GEMM"
                                    if joined else f"its {g.separate} base layers keep their own matmuls")
                elif fold_off is None:  # (under TP: each rank's shards, column-sharded alike)
                    pool.fold = g
                    # its tables keep each arena row's slot, and it keeps B's columns: a gated MLP may
                    # take ops.glu_lora (only where it is on: its buffers and their upkeep cost)
                    pool.column_slots = g.kind == "gate_up" and glu_wanted
                site_name = f"{g.parent_name}.{g.kind}" if g.parent_name else g.kind
                parent = model.get_submodule(g.parent_name) if g.parent_name else model
                site = FusedSite(site_name, g, pool, parent)
                if g.separate:
                    site.kind = f"{g.kind}_{g.separate}"  # counted apart in the report, as linear_nf4 is
                self.sites.append(site)
                served |= {id(m) for m in g.members}
        self.expert_sites, expert_wrappers, refused = find_expert_sites(lora_layers, self.registry.num_slots,
                                                                         list(self.stored.values()))
        left_on_peft += refused
        served |= expert_wrappers
        declared = declared_tp_plans(model)
        for name, m in lora_layers:
            if id(m) in served:
                continue
            base = base_layer_of(m)
            blocker = lora_layer_blocker(m)
            quant = quantized_base_kind(m)  # a bitsandbytes or torchao base: its own matmul, fastlora's LoRA
            if blocker is not None:
                left_on_peft.append((name, blocker))
            elif (type(m) is LoraLinear and (isinstance(base, nn.Linear) or is_conv1d(base))) or quant is not None:
                i, o = linear_in_out(base)
                site = LinearSite(name, [m], SitePool([m], [o], i, tuning=tuning),
                                  tp=tp_style(m, declared.get(id(m))))
                if quant:
                    site.kind = f"linear_{quant}"
                blocker = ("a gathered LM head under tensor parallelism" if site.tp == "colwise_gather"
                           else fusion_blocker([base]))
                if fold_off is None and blocker is None:
                    site.pool.fold = FusedGroup("linear", name, (name,), [m], [base])
                site.pool.no_fold = blocker or "not eligible"
                if quant == "int8" and site.tp is None and outlier_threshold(base) == 0.0:
                    # held as a join of one, so that fastlora dequantizes its product (with the
                    # deltas at decode: ``sites._int8_beside_forward``); ``unpatch`` gives it its own storage back
                    single = SeparateGroup("linear", name, (name,), [m], [base], separate="int8")
                    if single.join() is None:
                        self.groups.append(single)
                        site.int8 = single
                self.sites.append(site)
            elif type(m) is LoraEmbedding and isinstance(base, nn.Embedding):
                vocab = local(base.weight).shape[0]  # this rank's rows under TP
                pool = SitePool([m], [base.embedding_dim], vocab, embedding=True, tuning=tuning)
                site = EmbeddingSite(name, [m], pool,
                                     tp=tp_style(m))
                site.pool.no_fold = "an embedding: a lookup, not a GEMM"
                self.sites.append(site)
            else:
                left_on_peft.append(
                    (name, f"{type(m).__module__}.{type(m).__name__} over {type(base).__name__} "
                           "is not handled by fastlora"))
        for site in self.sites:
            self._rebuild_pool(site, self._site_dtype(site))
            site.install(self)
            for layer in site.lora_layers:
                for adapter in sorted(adapter_names_of(layer)):
                    why = adapter_blocker(layer, adapter)
                    if why:
                        adapter_fallbacks.append((name_of.get(id(layer), "?"), adapter, why))
        for site in self.expert_sites:
            site.install(self)
        self.side_streams.prepare({g.bases[0].weight.device for g in self.groups
                                   if isinstance(g, SeparateGroup) and g.joined is not None})
        self._drop_unservable_stored()
        folded = sum(s.pool.folded() and not s.pool.folds_per_call() for s in self.sites)
        per_call = sum(s.pool.folds_per_call() for s in self.sites)
        staged = sum(s.pool.folds_per_call() and s.pool.staging is not None for s in self.sites)
        shrink_folded = fold_off or (f"{folded} of {len(self.sites)} sites" + (
            f" (and {per_call} more in calls whose adapters use at least {self.options.tuning.fold_min_use:.0%} of their A rows"
            + (f"; {staged} of them staged: such a call's A blocks are copied under the base weight first"
               if staged else "") + ")" if per_call else ""))
        # every module PEFT would hand adapter_names to is a site: fastlora takes the names itself
        self.takes_adapter_names = (self.has_lora and not left_on_peft
                                     and not has_auxiliary_wrappers(model))
        self.lora_plan = LoRAPlan(
            backend=backend_name, device=str(self.device), adapters=self._users_adapters(),
            sites=[(s.name, s.kind, len(s.lora_layers)) for s in self.sites + self.expert_sites],
            left_on_peft=left_on_peft,
            adapter_fallbacks=adapter_fallbacks, fusion_blocked=fusion_blocked,
            triton_missing=kernel_support.triton_missing() or "",
            stack_bytes=sum(s.pool.nbytes() for s in self.sites) + sum(s.nbytes() for s in self.expert_sites),
            adapter_bytes=sum(s.pool.adapter_nbytes() for s in self.sites),
            gpu_slots=self.registry.describe(hidden=(SCAFFOLD_ADAPTER,)), registered=len(self.stored),
            store_bytes=sum(a.nbytes() for a in self.stored.values()), shrink_folded=shrink_folded,
            fold_refused=[] if fold_off is not None else
            [(s.name, s.pool.fold_refusal()) for s in self.sites if not s.pool.folded()],
            quantized_joined=quantized_joined)

    def _build_base_only(self) -> None:
        """A model without PEFT: no LoRA sites, only the base-model decode speedups."""
        param = next(self.model.parameters(), None)
        if param is None:
            raise ValueError("fastlora.patch: the model has no parameters")
        self.device = param.device
        self.slots.registry = AdapterRegistry(())
        self.backend = None
        self.lora_plan = LoRAPlan(backend="none (no LoRA adapters: base model only)", device=str(self.device))

    def _update_graph_runner(self):
        """Decide the decode plan, then create, keep or release the graph runner as it says."""
        self.decode_plan = decode_plan.decide(self)
        if self.decode_plan.graphs_off is not None:
            if self.graph_runner is not None:
                self.graph_runner.release()
                self.graph_runner = None
        elif self.graph_runner is None:
            self.graph_runner = DecodeGraphRunner(self, self.inner, emulate=self.decode_plan.emulate)

    @property
    def graph_blocker(self) -> Optional[str]:
        """Why decode graphs are off (None: on)."""
        return self.decode_plan.graphs_off

    def _log_disabled(self, report: PatchReport):
        """Warn once per patch about features that are off on a GPU for a reason other than the
        user's choice (on the CPU they are off by design: logged at INFO)."""
        level = logging.WARNING if self.device is not None and self.device.type == "cuda" else logging.INFO
        for feature, value in (("decode graphs", report.cuda_graphs),
                               ("decode attention", report.decode_attention)):
            if value.startswith("off (") and "=False" not in value:
                logger.log(level, "fastlora: %s %s", feature, value)
        for option, cls, why in report.base_ops_skipped:
            logger.log(level, "fastlora: %s left as it is for %s: %s", option, cls, why)

    def _ensure_backend(self, backend_name: str):
        """A backend taking as many distinct adapters per batch as asked (default: every adapter, at least 16)."""
        max_loras = self.options.max_loras_per_batch or max(16, len(self.registry))
        if (self.backend is None or getattr(self.backend, "name", None) != backend_name
                or self.backend.max_loras_per_batch != max_loras):
            self.backend = get_backend(backend_name)(max_loras, self.device)

    def served_layers(self) -> dict:
        """Module name -> LoRA layer, for every layer a site serves."""
        return {self._layer_names[id(layer)]: layer for site in self.sites + self.expert_sites
                for layer in site.lora_layers if id(layer) in self._layer_names}

    def _servable_stored(self, peft_names) -> set:
        """The registered adapters to serve: a name PEFT now holds too is PEFT's (the registered one
        is dropped, with a warning)."""
        for name in sorted(set(self.stored) & set(peft_names)):
            del self.stored[name]
            self.warn_once(f"registered adapter {name!r} dropped: PEFT now holds an adapter of that name")
        return set(self.stored)

    def _drop_unservable_stored(self):
        """A registered adapter whose modules lost their LoRA layer (PEFT's adapters deleted) cannot be
        served: it is dropped, with a warning, and the stacks rebuilt without it."""
        served = set(self.served_layers())
        gone = [a.name for a in self.stored.values() if not set(a.modules) <= served]
        if not gone:
            return
        for name in gone:
            del self.stored[name]
            self.warn_once(f"registered adapter {name!r} dropped: the model no longer has a LoRA layer "
                           f"fastlora serves for every module it targets")
        self.slots.registry = AdapterRegistry(set(self._peft_names) | set(self.stored),
                                              num_slots=self.options.max_loras_per_batch)
        self._ensure_backend(self.backend.name)
        for site in self.sites:
            self._rebuild_pool(site, self._site_dtype(site))

    def _stored_for(self, site: Site) -> dict:
        """The registered adapters' weights for this site's stacked modules (adapter -> index -> (A, B,
        s, extras): extras holds B's bias and DoRA's magnitude where the adapter has them)."""
        out: dict = {}
        if not self.stored:
            return out
        live = {id(a) for a in self.stored.values()}
        for key in [k for k in self.slots.slices if k[0] not in live]:  # unregistered: forgotten
            del self.slots.slices[key]
        for j, layer in enumerate(site.pool.layers):
            module = self._layer_names.get(id(layer)) if layer is not None else None
            plan = getattr(site, "tp", None) if len(site.pool.layers) == 1 else tp_style(layer)
            for adapter in self.stored.values():
                if module in adapter.modules:
                    a, b, scaling = adapter.modules[module]
                    if plan is not None:  # this rank's part, sliced once per adapter and module
                        key = (id(adapter), module)
                        if key not in self.slots.slices:
                            self.slots.slices[key] = tp_local_stored(layer, plan, a, b)
                        a, b = self.slots.slices[key]
                    out.setdefault(adapter.name, {})[j] = (a, b, scaling, adapter.extras.get(module, {}))
        return out

    def _fold_blocker(self) -> Optional[str]:
        """None where sites may store their A arena under the base weight, else why not."""
        option = self.options.fold_shrink
        if option is False:
            return "off (fold_shrink=False)"
        if option == "auto" and self.device.type != "cuda":
            return "off (not on CUDA)"
        return None

    def _site_dtype(self, site: Site) -> torch.dtype:
        weight = base_layer_of(site.members[0]).weight
        if weight.is_floating_point():
            return weight.dtype
        # a quantized base: the model's compute dtype (the first forward rebuilds for its input's)
        return self.inner.get_input_embeddings().weight.dtype

    def _rebuild_pool(self, site: Site, dtype):
        site.pool.rebuild(self.registry, dtype, site.device, stored=self._stored_for(site))
        self._watches = {}
        self.generation += 1
        self.slots.moved()

    def _teardown_lora(self):
        for site in self.sites:
            site.uninstall()
            fold = site.pool.fold
            if fold is not None and fold.kind == "linear" and fold.weight is not None:
                fold.unfuse()  # a single layer fused only to fold its pool: its own storage again
        for g in self.groups:
            g.unfuse()
        for site in self.expert_sites:
            site.uninstall()
        self.sites, self.groups, self.expert_sites = [], [], []
        self.slots.moved()
        self._watches = {}
        self.generation += 1

    def teardown(self):
        self.wait_for_engine()
        if self.base_ops is not None:
            self.base_ops.remove(self.inner)
            self.base_ops = None
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None
        for attr in ("generate_hook", "mutation_lock", "continuous"):  # the instance-method wrappers
            hook = getattr(self, attr)
            if hook is not None:
                hook.remove()
                setattr(self, attr, None)
        unguard_peft_forward_hooks(self.model)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._teardown_lora()
        plain_scalings(self.model)
        self.slots.shared_versions.release()

    def warn_once(self, message: str) -> None:
        """A warning logged once per model and message."""
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("fastlora: %s", message)

    # -- per forward ----------------------------------------------------------------------------
    def begin_forward(self):
        """Once per model forward: drop stale stashes; outside a ``generate`` call, follow PEFT's
        adapters (structure now, values when the first layer knows the batch's adapters)."""
        for site in self.sites:
            if isinstance(site, FusedSite):
                site.clear_stash()
        context = self.context()
        if context.graphed or context.checked:
            return
        self.sync(())  # the adapters' own parameters: once the first layer knows the batch's
        self.calls.begin_forward(ForwardBoundary(self._begin_forward_call), context.names)

    def _begin_forward_call(self, adapter_names: Sequence[str]) -> bool:
        """A forward outside any call, at its first LoRA layer: what ``call`` does at its boundary."""
        self._check_adapters(adapter_names)
        return self.refresh_values(adapter_names)

    def sync(self, adapter_names: Optional[Sequence[str]] = None, storage: bool = True):
        """Rebuild what no longer fits PEFT's adapters (see ``pool.SitePool.stale``).

        ``adapter_names``: check the parameters of these adapters only (None: all). The others are
        checked when a call uses them, so the cost follows the adapters a call uses, not the
        number loaded. ``storage=False`` (an engine step): an adapter's storage addresses are
        compared only where a module or parameter was registered since its last check, or a
        manager started since (``values_unknown``), and the layers' adapter sets and scalings
        flat (``_structure_unchanged``)."""
        if self._config_keys() != self._peft_config_keys or self._adapter_set_changed():
            self.rescan()
            return
        if not self._groups_intact():
            for g in self.groups:
                if not g.is_intact():
                    g.fuse()  # model.to() or a reload gave the members new storage
                    self.generation += 1
        if not self._folds_intact():
            for site in self.sites:
                if site.pool.fold_lost():  # its A arena under a base weight the layers no longer use
                    self._rebuild_pool(site, site.pool.lora_a.dtype)
        if any([site.follow_weights() for site in self.expert_sites]):  # model.to(): new stacks
            self.generation += 1
        if adapter_names is None:
            self._sync_pools(None)
            return
        if storage or not self._structure_unchanged():
            self._sync_pools(())  # every layer's adapters and scalings; the adapters' own facts below
        self._check_adapters(adapter_names, storage)

    def _groups_intact(self) -> bool:
        """Whether every fused group's members still view its fused tensor (``IntactWatch``: flat,
        C-speed; False, so that each group is checked, where it cannot tell)."""
        if self._intact is None or not self._intact.holds(self.groups):
            self._intact = IntactWatch(self.groups)
        return self._intact.intact()

    def _folds_intact(self) -> bool:
        """Whether no site's fold is lost (``FoldWatch``: flat, C-speed; False, so that each pool is
        asked, where it cannot tell)."""
        if self._folds is None or not self._folds.holds(self.sites):
            self._folds = FoldWatch(self.sites)
        return self._folds.intact()

    def _structure_unchanged(self) -> bool:
        """At an engine step: whether every stacked layer still has the adapters and scalings its
        stacks were built with (``lora.watch.StructureWatch``: flat, C-speed). False (the full
        check runs) the first time after a rebuild, or where a site has no flat facts."""
        key = (self.generation, tuple(self.registry.names))
        if self._structure is not None and self._structure.unchanged(key, registration_epoch()):
            return True
        watched = [site.pool.watched_layers() for site in self.sites]
        self._structure = None if any(w is None for w in watched) else StructureWatch(
            key, [site.pool for site in self.sites], [w for layers in watched for w in layers])
        return False

    def _check_adapters(self, adapter_names: Sequence[str], storage: bool = True):
        """Rebuild the stacks of these adapters if their modules, parameters or storage changed
        (``lora.watch``: flat, C-speed checks; the layer-by-layer one only for a suspect)."""
        epoch = registration_epoch()
        suspect = [n for n in set(adapter_names)
                   if n in self.registry.index and n not in self.stored and not self._unchanged(n, epoch, storage)]
        if suspect:
            self._sync_pools(suspect)  # finds the pools that no longer fit and rebuilds them

    def _unchanged(self, name: str, epoch: int, storage: bool = True) -> bool:
        watch = self._watches.get(name)
        if watch is None:
            layers = [w for site in self.sites for w in (site.pool.watched_layers() or ())]
            if any(site.pool.watched_layers() is None for site in self.sites):
                return False  # a site without the flat facts: its full check serves it
            watch = self._watches[name] = AdapterWatch(name, layers)
        return watch.unchanged(epoch, storage)

    def _sync_pools(self, adapter_names: Optional[Sequence[str]]):
        names = None if adapter_names is None else set(adapter_names)
        for site in self.sites:
            dtype = site.pool.lora_a.dtype if site.pool.lora_a is not None else self._site_dtype(site)
            if site.pool.stale(self.registry, dtype, names):
                self._rebuild_pool(site, dtype)

    def _users_adapters(self) -> list:
        """The adapters served, for reports: without ``from_folders``' layer-making adapter of zeros."""
        return [n for n in self.registry.names if n != SCAFFOLD_ADAPTER]

    def refresh_values(self, adapter_names: Optional[Sequence[str]], fold: bool = True,
                       changed_values_only: bool = False) -> bool:
        """The call's adapters into the stacks and its fold choice (``SlotLoader.place``)."""
        folds = self.slots.place(adapter_names, self.generation, fold=fold, changed_values_only=changed_values_only)
        if self.expert_sites and adapter_names is not None and len(adapter_names):
            slot = self.registry.slot
            placed = {n: slot[n] for n in set(adapter_names) if n in slot}
            for site in self.expert_sites:
                site.refresh(placed, self.stored)
        return folds

    def _adapter_set_changed(self) -> bool:
        # adapters per layer, counted (cheap); the names compared only when the count moved
        sites = self.sites + self.expert_sites
        key = (registration_epoch(), self.generation)  # a replaced module dict was registered
        if self._counted[0] != key:
            self._counted = (key, [d for site in sites for layer in site.lora_layers for d in adapter_dicts(layer)])
        count = sum(map(len, self._counted[1]))
        if count == self._adapter_count:
            return False
        self._adapter_count = count
        names = set()
        for site in sites:
            for layer in site.lora_layers:
                names |= adapter_names_of(layer)
        return sorted(names) != self._peft_names

    def rescan(self):
        """Adapters were added or deleted: rebuild the LoRA sites from scratch (new LoRA layers may
        exist); the model-level parts (hooks, generate, decode kernels, graph runner) stay."""
        self.wait_for_engine()  # the stacks go: an engine step's GPU work may still read them
        self._teardown_lora()
        self._peft_config_keys = self._config_keys()
        self._build_lora()
        if self.base_ops is not None:
            self._set_group_gemms()
        self._update_graph_runner()
        logger.info("%s (after an adapter change)", self._render_report())

    def pool_for(self, site: Site, dtype: torch.dtype) -> SitePool:
        if site.pool.lora_a is None or site.pool.lora_a.dtype != dtype:
            self._rebuild_pool(site, dtype)
        return site.pool

    def slots_moved(self) -> None:
        """Stacks were rebuilt or adapters put in other slots: the cached batch info (read from the
        slots) is built again when next asked for."""
        self.batch_infos.clear()

    def batch_info(self, context: CallContext, adapter_names: Sequence[str], x: torch.Tensor, site: Site):
        """The batch info for this forward, built by the first layer that asks (``BatchInfos``); a
        forward outside any call runs its boundary first."""
        if context.graphed:
            return context.graph_batch_info  # static buffers, refreshed by the graph runner
        rows = x.shape[0]
        tokens_per_row = x.numel() // max(rows, 1)
        if isinstance(site, LinearSite) or isinstance(site, FusedSite):
            tokens_per_row //= max(x.shape[-1], 1)
            if x.dim() == 2 and rows != len(adapter_names):  # the forward's tokens flattened row by row
                rows, tokens_per_row = len(adapter_names), rows // len(adapter_names)
        if context.boundary is not None:  # a forward outside any call: its boundary, once
            context.boundary.run(adapter_names)
        return self.batch_infos.for_rows(adapter_names, rows, tokens_per_row)

    def token_slots(self, context: CallContext, adapter_names: Optional[Sequence[str]], num_tokens: int,
                    device: torch.device) -> Optional[torch.Tensor]:
        """Each token's slot (-1: none) for a layer that sees the forward's tokens flattened, on
        ``device``; None where the forward has no per-row adapters fastlora serves (or its tokens
        do not divide into the rows)."""
        if context.graphed:
            bi = context.graph_batch_info
        elif context.segments is not None and adapter_names is None:
            bi = self.segment_batch_info(context)
        elif adapter_names is not None and len(adapter_names) and num_tokens % len(adapter_names) == 0:
            if context.boundary is not None:  # a forward outside any call: its boundary, once
                context.boundary.run(adapter_names)
            bi = self.batch_infos.for_rows(adapter_names, len(adapter_names), num_tokens // len(adapter_names))
        else:
            return None
        return self.batch_info_on(bi, device).token_slot[:num_tokens]

    def batch_info_on(self, bi, device: torch.device):
        """``bi`` on ``device``: a layer of a model split over devices (accelerate's device_map)
        reads the forward's batch info from its own device; copied once per batch info."""
        return self.batch_infos.on(bi, device)

    def segment_batch_info(self, context: CallContext):
        """The batch info of a continuous-batching forward, built by the first layer that asks
        (in the engine's graphs: the static buffers, filled before the step)."""
        if context.graphed:
            return context.graph_batch_info
        return self.batch_infos.for_segments(context.segments)
