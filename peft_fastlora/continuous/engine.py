"""Per-request adapters in transformers' continuous batching, on its engine as shipped.

On a patched model, ``generate_batch(inputs, ..., adapter_names=[...])`` and the manager of
``init_continuous_batching(...)`` (``add_request(..., adapter_name=...)``,
``add_requests(..., adapter_names=[...])``) take one adapter per request. Each engine step packs
prefill chunks and decode tokens of many requests into one row; just before its forward,
fastlora reads the step's requests and token counts (``cb_step``) and hands the LoRA
layers a ``TokenSegments``: every layer applies each request's adapter to that request's tokens.

What changes on the engine, and only on the managers fastlora hands out: the config fields in
``_CB_OFF`` (prefix sharing, compile; CUDA graphs where fastlora cannot follow them), logged once;
the manager's ``add_request`` / ``add_requests`` / ``cancel_request`` / ``stop`` and its batch
processor's step, wrapped on the instance. The engine's async batching stays the engine's choice:
a step's requests are read from the IO pair it was prepared in, the tokens of the step still in
flight count in the per-request sampling (``StepSampler``), and whoever changes adapters waits for
the GPU work of the steps launched (``InFlightSteps``). fastlora's decode-attention kernel is
switched off while a manager runs (the engine accepts only its own attention implementations) and
back on when the last one stops.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence

from ..compat.attention import register_attention_function, release_attention_function
from ..compat.engine import (CB_CHILD_MARK, cb_async, cb_async_device_blocker, cb_cached_manager, cb_capacity,
                             cb_config_for_lora, cb_disable_graphs, cb_engine_attention_blocker, cb_engine_uses_graphs,
                             cb_fail_requests, cb_fail_step, cb_graphs_blocker_of_engine, cb_in_place_cache,
                             cb_manager_model, cb_new_request_id, cb_processor_factory, cb_processor_steps,
                             cb_request_done, cb_request_ids, cb_set_attention, cb_set_processor_factory,
                             cb_set_processor_steps, cb_settle_inputs, cb_step, cb_stream, cb_unset_processor_steps,
                             cb_update_skipping_failed, continuous_batching_blocker)
from ..compat.modules import (attn_implementation, cb_vocab_size, model_dtype, multi_device_reason,
                              on_stream, set_attn_implementation, uncapturable_layers_reason)
from ..compat.peft import active_adapter_names
from ..compat.tensor_parallel import tensor_parallel_reason
from ..base_ops.attention_registry import (decode_attention_enabled, disable_decode_attention,
                                           enable_decode_attention)
from ..base_ops.paged_attention import (IN_PLACE_NAME, PAGED_NAME, forced_varlen_blocker, has_sliding_layers,
                                       in_place_blocker, kernel_blocker, paged_in_place_attention,
                                       paged_varlen_attention, varlen_blocker)
from ..batch import TokenSegments
from ..decode.capture import GraphUnsafe
from ..instance_methods import InstancePatches
from .graphs import EngineGraphs, EngineWarmup
from .in_flight import InFlightSteps
from .pages import StepPages
from .sampling import RequestSampling, SamplingParams
from .step_sampling import StepSampler

BASE = "__base__"
# the phases of the engine thread's loop that the hook times (``manager.fastlora_step_seconds``)
ENGINE_PHASES = ("schedule", "prepare", "forward", "outputs", "update")
logger = logging.getLogger("peft_fastlora")
# a step that raises fails its own requests and the engine goes on; this many failing steps in a
# row mean the engine itself is broken: the error then ends its thread as transformers would
MAX_FAILED_STEPS_IN_A_ROW = 3


class RequestAdapters:
    """Request id -> adapter name for one manager's requests (added from any thread, read by the
    engine's). Entries go when their request finishes, fails or is cancelled, or the manager stops."""

    def __init__(self):
        self._names: Dict[str, str] = {}
        self._cancelled: set = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._names)

    def assign(self, request_id: str, name: str) -> None:
        with self._lock:
            self._names[request_id] = name

    def names_of(self, request_ids: Sequence[str]) -> List[str]:
        """``name_of`` of each request (every engine step reads them all)."""
        return self._each(request_ids, self.name_of)

    def lookup_all(self, request_ids: Sequence[str]) -> List[Optional[str]]:
        """``lookup`` of each request (every engine step reads them all)."""
        return self._each(request_ids, self.lookup)

    def _each(self, request_ids: Sequence[str], one) -> list:
        # the ones on record read under one lock; ``one`` for the rest (forked sequences, unknown ids)
        with self._lock:
            names = list(map(self._names.get, request_ids))
        return [n if n is not None else one(rid) for rid, n in zip(request_ids, names)]

    def lookup(self, request_id: str) -> Optional[str]:
        """The request's adapter, or None when it has none on record."""
        try:
            return self.name_of(request_id)
        except RuntimeError:
            return None

    def name_of(self, request_id: str) -> str:
        with self._lock:
            name = self._names.get(request_id)
            if name is None and CB_CHILD_MARK in request_id:  # a forked sequence
                name = self._names.get(request_id.split(CB_CHILD_MARK)[0])
                if name is not None:
                    self._names[request_id] = name
        if name is None:
            raise RuntimeError(
                f"fastlora: request {request_id!r} has no adapter on record (was it queued without "
                "the manager's add_request?)")
        return name

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def forget(self, request_ids: Sequence[str], running: Sequence[str] = ()) -> None:
        """Drop these requests, and the cancelled ones not in ``running``."""
        with self._lock:
            gone = set(request_ids) | (self._cancelled - set(running))
            for rid in gone:
                self._names.pop(rid, None)
            self._cancelled -= gone

    def clear(self) -> None:
        with self._lock:
            self._names.clear()
            self._cancelled.clear()


class ContinuousBatchingHook:
    """``init_continuous_batching`` and ``generate_batch`` of one patched model, installed on the
    transformers model instance (a ``PeftModel`` finds them there); removed by ``remove``."""

    _METHODS = ("init_continuous_batching", "generate_batch")

    def __init__(self, state):
        self.state = state
        self.inner = state.inner
        # under TP only the driver rank sees add_request: the other ranks would not know the adapters
        self.blocker = continuous_batching_blocker(self.inner) or tensor_parallel_reason(self.inner)
        self._methods = InstancePatches()
        self._local = threading.local()  # adapter names a generate_batch call hands its requests
        self._running = 0  # managers started and not stopped
        self._attention_suspended = False
        self._plain_attention: Optional[str] = None  # the model's own, while managers run
        self._registered_attention: Optional[str] = None  # fastlora's engine attention, while managers run
        self._lock = threading.Lock()
        self.in_flight = InFlightSteps()  # async batching: steps whose GPU work outlasts their call
        if self.blocker is None:
            self._install()

    # -- installing -------------------------------------------------------------------------
    def _install(self):
        for name in self._METHODS:
            wrapper = getattr(self, "_" + name)
            self._methods.wrap(self.inner, name, lambda original, _wrapper=wrapper:
                               lambda model, *args, **kwargs: _wrapper(original, *args, **kwargs))

    def remove(self):
        self._methods.restore()
        self._resume_attention(force=True)

    @property
    def active(self) -> bool:
        return self.state.continuous is self

    # -- adapters ---------------------------------------------------------------------------
    def default_adapter(self) -> str:
        """The adapter of a request that names none: PEFT's active adapter, as in a forward
        without ``adapter_names``."""
        if not self.state.has_lora:
            return BASE
        active = active_adapter_names(self.state.model)
        if len(active) != 1:
            raise ValueError(
                f"fastlora: {len(active)} adapters are active ({', '.join(active) or 'none'}); name the "
                "adapter of each request (adapter_name= / adapter_names=)")
        return active[0]

    def check_names(self, names: Sequence[str]) -> None:
        """Raise, naming them, for adapters the model does not have (before anything is queued)."""
        # PEFT's own list too: an adapter added since the last step joins the stacks at the next
        known = (set(self.state.registry.names) | set(getattr(self.state.model, "peft_config", None) or ())
                 | set(self.state.stored) | {BASE})
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"adapter names must be strings, got {bad[0]!r}")
        unknown = sorted({n for n in names if n not in known})
        if unknown:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(unknown)}")

    def _usable(self):
        if not self.active:
            raise RuntimeError("fastlora: this model was unpatched; its continuous batching is transformers' own")

    def report_field(self) -> str:
        """``PatchReport.continuous_batching``: "on", "off (why)", or the active adapter only."""
        if self.blocker is not None:
            return f"off ({self.blocker})"
        left = self.state.lora_plan.left_on_peft
        if left:  # PEFT applies the active adapter to every token there
            return f"active adapter only ({len(left)} LoRA layers on PEFT's path)"
        return "on"

    def graphs_blocker(self) -> Optional[str]:
        """Why the engine's CUDA graphs cannot carry this model's LoRA batches (None: they can,
        where the engine turns them on)."""
        state = self.state
        if state.options.cuda_graphs is False:
            return "cuda_graphs=False"
        split = multi_device_reason(self.inner)
        if split is not None:
            return f"{split}: a CUDA graph captures one device"
        if state.lora_plan.left_on_peft:
            return "some LoRA layers are left on PEFT's path, which a graph would replay with stale indices"
        uncapturable = uncapturable_layers_reason(self.inner) if state.options.cuda_graphs != "emulate" else None
        if uncapturable is not None:
            return uncapturable
        # judged on the dtype and device alone: while a manager runs, the model's attention is the
        # chosen one itself (a model that cannot take it never gets a manager with that choice).
        # Off fp16 / bf16 CUDA the varlen path runs a reference that syncs; "paged" takes it only
        # for sliding-window layers. Emulated graphs capture nothing, so a sync is no obstacle there.
        choice = state.options.engine_attention
        syncs = choice == "varlen" or (choice == "paged" and has_sliding_layers(self.inner))
        if (syncs and state.device is not None and state.options.cuda_graphs != "emulate"
                and kernel_blocker(model_dtype(self.inner), state.device) is not None):
            layers = " for its sliding-window layers" if choice == "paged" else ""
            return (f"engine_attention={choice!r} off fp16 / bf16 CUDA runs a per-request reference{layers} "
                    "that syncs with the host")
        return None

    def _check_servable(self, names: Sequence[str]) -> None:
        """LoRA layers left on PEFT's path apply PEFT's active adapter to every token: only requests
        for that adapter can be served with them."""
        left = self.state.lora_plan.left_on_peft
        if not left:
            return
        active = set(active_adapter_names(self.state.model))
        other = sorted({n for n in names if n not in active})
        if other:
            module, why = left[0]
            raise ValueError(
                f"fastlora: {len(left)} LoRA layers are on PEFT's path (e.g. {module}: {why}), which "
                f"applies the active adapter to every request; requests for {', '.join(other)} cannot "
                "be served in continuous batching")

    @contextlib.contextmanager
    def _pending(self, names: Optional[Sequence[str]]):
        previous = getattr(self._local, "pending", None)
        self._local.pending = None if names is None else iter(list(names))
        try:
            yield
        finally:
            self._local.pending = previous

    def _next_pending(self) -> Optional[str]:
        pending = getattr(self._local, "pending", None)
        if pending is None:
            return None
        name = next(pending, None)
        if name is None:
            raise RuntimeError("fastlora: more requests than adapter names")
        return name

    # -- the model's entry points -------------------------------------------------------------
    def _generate_batch(self, original, inputs, *args, adapter_names=None, **kwargs):
        self._usable()
        if adapter_names is not None:
            if len(adapter_names) != len(inputs):
                raise ValueError(
                    f"Length of `adapter_names` should be the same as the number of inputs, but got "
                    f"{len(adapter_names)} and {len(inputs)} respectively.")
            self.check_names(adapter_names)
        else:
            adapter_names = [self.default_adapter()] * len(inputs)
        self._check_servable(adapter_names)
        # transformers' generate_batch logs and swallows errors raised while it adds requests:
        # everything that can fail was checked above
        with self._pending(adapter_names):
            return original(inputs, *args, **kwargs)

    def _init_continuous_batching(self, original, generation_config=None, continuous_batching_config=None,
                                  workload_hints=None):
        self._usable()
        cached = cb_cached_manager(self.inner)
        if cached is not None and not getattr(cached, "_fastlora_enabled", False):
            raise RuntimeError(
                "fastlora: a continuous-batching manager made before fastlora.patch is cached on the "
                "model; call destroy_cached_continuous_batching_manager() first")
        gen = generation_config if generation_config is not None else self.inner.generation_config
        registry = self.state.registry  # fewer slots than adapters: no step may need more than the slots
        config, changes = cb_config_for_lora(continuous_batching_config, gen, self.graphs_blocker(),
                                             None if registry.all_resident else registry.num_slots)
        no_async = cb_async_device_blocker(self._device()) if config.use_async_batching else None
        if no_async is not None:  # asked for: the engine's thread would die on its first step
            raise ValueError(f"fastlora: use_async_batching=True cannot be served: {no_async}")
        for change in changes:
            self.state.warn_once(f"continuous batching with per-request adapters: {change}")
        self.state.values_unknown()  # a user's call: its first step reads every value (``.data`` edits too)
        hold = cached is None or not cached._fastlora_holds
        if hold:
            self._suspend_attention()
        try:
            manager = original(generation_config=generation_config, continuous_batching_config=config,
                               workload_hints=workload_hints)
        except BaseException:
            if hold:
                self._resume_attention()
            raise
        if manager is not cached:
            self._enable(manager)
        manager._fastlora_holds = True
        return manager

    # -- decode attention while managers run ----------------------------------------------------
    def _suspend_attention(self):
        with self._lock:
            self._running += 1
            if decode_attention_enabled(self.inner):
                disable_decode_attention(self.inner)
                self._attention_suspended = True
            if self._plain_attention is None:
                self._plain_attention = attn_implementation(self.inner)
                self._use_varlen_attention()

    def varlen_blocker(self) -> Optional[str]:
        """Why the engine keeps its own attention instead of one of fastlora's (None: it takes
        ``attention_name()``; see ``base_ops.paged_attention``)."""
        choice = self.state.options.engine_attention
        if choice == "engine":
            return "engine_attention='engine'"
        why = cb_engine_attention_blocker()
        if why is not None:
            return why
        dtype, device = model_dtype(self.inner), self._device()
        if choice == "auto":
            return varlen_blocker(self.inner, dtype, device)
        if choice == "paged":
            return in_place_blocker(self.inner, dtype, device)
        return forced_varlen_blocker(self.inner, device)

    def _device(self):
        return self.state.device or next(self.inner.parameters()).device

    def attention_name(self) -> str:
        """The attention fastlora gives the engine: the paged cache read in place ("paged"; "auto"
        where the in-place kernel applies: Triton, sm80 or newer), or gathered first."""
        choice = self.state.options.engine_attention
        if choice == "auto" and in_place_blocker(self.inner, model_dtype(self.inner), self._device()) is None:
            return IN_PLACE_NAME
        return IN_PLACE_NAME if choice == "paged" else PAGED_NAME

    def _use_varlen_attention(self):
        why = self.varlen_blocker()
        choice = self.state.options.engine_attention
        if why is not None:
            if choice in ("varlen", "paged"):
                raise ValueError(f"fastlora: engine_attention={choice!r} cannot be served: {why}")
            self.state.warn_once(f"continuous batching keeps the engine's attention: {why}")
            return
        name = self.attention_name()
        register_attention_function(name, paged_in_place_attention if name == IN_PLACE_NAME else paged_varlen_attention,
                                    mask=None)
        try:
            cb_set_attention(self.inner, name)
        except BaseException:
            release_attention_function(name)
            raise
        self._registered_attention = name

    def check_plain_call(self) -> None:
        """Raise when a manager runs with a paged attention implementation set on the model: a
        plain ``generate`` would run it too, and transformers' paged implementations give a plain
        forward wrong results (switching back and forth breaks the engine's requests instead)."""
        plain, current = self._plain_attention, attn_implementation(self.inner)
        if plain is not None and current != plain:
            raise RuntimeError(
                f"fastlora: a continuous-batching manager of this model is running with transformers' "
                f"{current!r} attention, which gives a plain generate wrong results; stop the manager "
                f"first, or send this work through it (with 'sdpa' on transformers >= 5.24 the engine "
                f"keeps the model's attention and both can run)")

    def _resume_attention(self, force: bool = False):
        with self._lock:
            self._running = 0 if force else max(0, self._running - 1)
            if self._running == 0:
                name, self._registered_attention = self._registered_attention, None
                if (self._plain_attention is not None and name is not None
                        and attn_implementation(self.inner) == name):
                    set_attn_implementation(self.inner, self._plain_attention)
                self._plain_attention = None
                if name is not None:
                    release_attention_function(name)
            if self._running == 0 and self._attention_suspended:
                self._attention_suspended = False
                if self.active and not force:
                    enable_decode_attention(self.inner)

    # -- one manager --------------------------------------------------------------------------
    def _enable(self, manager):
        hook, adapters, records = self, RequestAdapters(), RequestSampling()
        manager._fastlora_enabled = True
        manager.fastlora_adapters = adapters
        manager.fastlora_sampling = records
        add_request, add_requests = manager.add_request, manager.add_requests
        cancel_request, stop, destroy = manager.cancel_request, manager.stop, manager.destroy
        create = cb_processor_factory(manager)

        def add_request_(input_ids, request_id=None, *args, adapter_name=None, sampling=None, **kwargs):
            name = adapter_name if adapter_name is not None else hook._next_pending()
            if name is None:
                name = hook.default_adapter()
            hook.check_names([name])
            hook._check_servable([name])
            if sampling is not None and not isinstance(sampling, SamplingParams):
                raise TypeError(f"sampling must be a peft_fastlora SamplingParams, got {type(sampling).__name__}")
            if request_id is None:
                request_id = cb_new_request_id(manager)
            adapters.assign(request_id, name)
            if sampling is not None:
                records.assign(request_id, sampling)
            try:
                rid = add_request(input_ids, request_id, *args, **kwargs)
            except BaseException:
                adapters.forget([request_id])
                records.release(request_id)
                raise
            if rid is None:  # not accepted (manager stopping): nothing will run
                adapters.forget([request_id])
                records.release(request_id)
            return rid

        def add_requests_(inputs, *args, adapter_names=None, **kwargs):
            if adapter_names is not None:
                if len(adapter_names) != len(inputs):
                    raise ValueError(f"{len(adapter_names)} adapter names for {len(inputs)} inputs")
                hook.check_names(adapter_names)
                hook._check_servable(adapter_names)
                with hook._pending(adapter_names):
                    return add_requests(inputs, *args, **kwargs)
            return add_requests(inputs, *args, **kwargs)

        def cancel_request_(request_id):
            adapters.cancel(request_id)
            records.forget([request_id])
            return cancel_request(request_id)

        made: List = []  # batch processors this manager made (fastlora's wrappers on each)

        def release():
            # the manager's thread is gone: its requests are over, and it no longer needs the
            # engine's attention implementation
            if getattr(manager, "_fastlora_holds", False) and not manager.is_running():
                manager._fastlora_holds = False
                adapters.clear()
                records.clear()
                hook._resume_attention()
            if manager.batch_processor is None:  # not kept for the next generate_batch call
                # the wrappers close reference cycles over the processor (and its KV cache and
                # graphs): break them, so the memory goes when transformers lets it go
                for processor in made:
                    hook._unwrap_step(processor)
                made.clear()

        def stop_(*args, **kwargs):
            try:
                return stop(*args, **kwargs)
            finally:
                release()

        def destroy_():
            try:
                return destroy()
            finally:
                release()

        def create_():
            processor = create()  # a new processor, or the one kept, reset
            cb_settle_inputs(processor)
            if hook._registered_attention == IN_PLACE_NAME:
                # a processor kept and reset keeps its pages: its graphs read them; where no layer
                # is a sliding-window one (those gather), no layer needs the engine's read indices
                processor._fastlora_pages = cb_in_place_cache(processor, lambda: StepPages(processor, hook._device()),
                                                              skip_reads=not has_sliding_layers(hook.inner))
            if not getattr(processor, "_fastlora_enabled", False):
                hook._wrap_step(processor, adapters, records)
                manager.fastlora_graphs = processor._fastlora_graphs
                manager.fastlora_step_seconds = processor._fastlora_step_seconds
                made.append(processor)
            return processor

        def warmup_():
            if manager.is_running():  # its made-up steps would run beside the engine thread's
                raise RuntimeError("fastlora.warmup_engine: warm the manager up before manager.start()")
            began = time.perf_counter()
            before = getattr(manager.batch_processor, "_fastlora_graphs", None)
            captured = before.stats["captures"] if before is not None else 0
            manager.warmup()  # the engine's own: makes the batch processor, its largest step first
            graphs = getattr(manager.batch_processor, "_fastlora_graphs", None)
            if graphs is None:
                return EngineWarmup([], 0, time.perf_counter() - began)
            return graphs.warm_up(cb_manager_model(manager), began, captured)

        manager.fastlora_warmup = warmup_
        manager.add_request = add_request_
        manager.add_requests = add_requests_
        manager.cancel_request = cancel_request_
        manager.stop = stop_
        manager.destroy = destroy_
        cb_set_processor_factory(manager, create_)

    def _engine_graphs(self, processor) -> Optional[EngineGraphs]:
        """The LoRA side of the engine's graphs, where the engine runs any (or emulated ones).
        Where fastlora cannot follow them, the engine's graphs go off: a graph replaying LoRA
        batches nobody refreshes would serve every request a stale step's adapters."""
        emulate = self.state.options.cuda_graphs == "emulate"
        if not emulate and not cb_engine_uses_graphs(processor):
            return None
        why = self.graphs_blocker() or cb_graphs_blocker_of_engine(processor)
        if why is not None:
            self.state.warn_once(f"continuous batching runs eagerly: {why}")
            cb_disable_graphs(processor)
            return None
        return EngineGraphs(self.state, processor, emulate=emulate)

    def _wrap_step(self, processor, adapters: RequestAdapters, records: RequestSampling):
        """The engine thread's side: from the moment the next batch is scheduled to the end of its
        forward it holds fastlora's call lock, so no adapter is added or deleted in between (PEFT's
        adapter methods take the lock); requests whose adapter went are failed before scheduling.
        Each forward (a step's, or a warm-up's from the caller's thread) runs with its requests'
        adapters, through the engine's graphs where it uses them, and its requests' own sampling.
        A step whose forward raises fails its own requests only (``MAX_FAILED_STEPS_IN_A_ROW``)."""
        state, original = self.state, cb_processor_steps(processor)
        step, prepare, update = original["generation_step"], original["prepare_next_batch"], original["update_batch"]
        schedule, compute = original["schedule_batch"], original["compute_batch"]
        lock, held = state.call_lock, [0]
        last: List = []
        failed = [0, False]  # failing steps in a row; whether the next update is skipped
        overlapped = cb_async(processor)  # async batching: a step's GPU work outlasts its call
        graphs = self._engine_graphs(processor)
        max_tokens, max_requests = cb_capacity(processor)
        sampler = StepSampler(records, processor, rows=min(max_tokens, max_requests) + 1,
                              vocab=cb_vocab_size(self.inner))
        local = threading.local()  # the segments of the step the engine thread is running
        # the engine thread's wall time by phase of its loop, summed over steps (where a step's time
        # goes: scheduling, building its tensors, launching its forward, waiting for its outputs,
        # updating its requests); "adapters": the part of "forward" spent on the step's adapters
        # before the launch (checks, value copies, the graphs' batch info)
        clock = collections.Counter(steps=0, adapters=0.0, **dict.fromkeys(ENGINE_PHASES, 0.0))

        def release():
            while held[0]:
                held[0] -= 1
                lock.release()

        def schedule_batch(*args, **kwargs):
            # new requests and cancellations are in; the batch is not formed yet
            t = time.perf_counter()
            lock.acquire()
            held[0] += 1
            self._fail_orphans(processor, adapters)
            try:
                return schedule(*args, **kwargs)
            finally:
                clock["schedule"] += time.perf_counter() - t

        def prepare_next_batch(*args, **kwargs):
            t, scheduled = time.perf_counter(), clock["schedule"]
            try:
                ready = prepare(*args, **kwargs)
            except BaseException:
                release()
                raise
            if not ready:  # no step follows
                release()
            else:
                if graphs is not None:
                    graphs.prepared()
                clock["prepare"] += time.perf_counter() - t - (clock["schedule"] - scheduled)
            return ready

        def generation_step(model):
            try:
                if not self.active:
                    raise RuntimeError("fastlora: the model was unpatched while a continuous-batching "
                                       "manager ran; start a new manager")
                requests, lens, num_tokens = cb_step(processor)
                ids = [r.request_id for r in requests]
                # a request the engine soft-reset under cache pressure leaves a finished state behind
                # while an equivalent one of the same id waits: it is not done
                done = [r.request_id for r in last if cb_request_done(r)]
                if done:  # (the set of every request held only when some request of the last step ended)
                    alive = set(cb_request_ids(processor))
                    done = [rid for rid in done if rid not in alive]
                adapters.forget(done, running=ids)
                records.forget(done)
                last[:] = requests
                local.segments = TokenSegments(adapters.names_of(ids), lens, num_tokens)
                sampler.plan()
                t, launched = time.perf_counter(), clock["forward"]
                try:
                    step(model)
                except Exception as error:  # noqa: BLE001  (confined to this step's requests, below)
                    failed[0] += 1
                    if failed[0] >= MAX_FAILED_STEPS_IN_A_ROW:
                        raise
                    logger.error("fastlora: a continuous-batching step failed; its %d requests fail with "
                                 "it and the engine goes on: %r", len(ids), error)
                    failed[1] = cb_fail_step(processor, error)
                else:
                    failed[0] = 0
                    clock["steps"] += 1
                    clock["outputs"] += time.perf_counter() - t - (clock["forward"] - launched)
            finally:
                local.segments = None
                if overlapped:
                    self.in_flight.launched(processor, cb_stream(processor))
                release()

        def update_batch(*args, **kwargs):
            if failed[1]:  # the failed step's requests are over: nothing to update
                failed[1] = False
                return None
            t = time.perf_counter()
            try:
                if overlapped:
                    return cb_update_skipping_failed(processor, lambda: update(*args, **kwargs))
                return update(*args, **kwargs)
            finally:
                clock["update"] += time.perf_counter() - t

        def compute_batch(model, batch_data):
            t = time.perf_counter()
            try:
                return run_forward(model, batch_data)
            finally:
                clock["forward"] += time.perf_counter() - t

        def run_forward(model, batch_data):
            t = time.perf_counter()
            segments = getattr(local, "segments", None)
            if segments is None:  # a warm-up forward: made-up requests, no adapter
                _, lens, num_tokens = cb_step(processor)
                segments = TokenSegments([BASE] * len(lens), lens, num_tokens)
            with on_stream(cb_stream(processor)), state.segments(segments):
                pages = getattr(processor, "_fastlora_pages", None)
                if pages is not None:
                    pages.load(processor)
                if graphs is not None and graphs.graphed():
                    try:
                        sampler.before_forward(graphed=True, device=state.device)
                        with graphs.step(segments):
                            clock["adapters"] += time.perf_counter() - t
                            compute(model, batch_data)
                        return sampler.finish()
                    except GraphUnsafe as e:  # raised before any capture began: run it eagerly
                        graphs.give_up(str(e))
                        state.warn_once(f"continuous batching runs eagerly from now on: {e}")
                if graphs is not None:
                    graphs.stats["eager_steps"] += 1
                sampler.before_forward(graphed=False, device=state.device)
                clock["adapters"] += time.perf_counter() - t
                compute(model, batch_data)
                return sampler.finish()

        cb_set_processor_steps(processor, dict(generation_step=generation_step, prepare_next_batch=prepare_next_batch,
                                               update_batch=update_batch, schedule_batch=schedule_batch,
                                               compute_batch=compute_batch))
        processor._fastlora_graphs = graphs
        processor._fastlora_step_seconds = clock
        processor._fastlora_sampler = sampler
        processor._fastlora_enabled = True

    @staticmethod
    def _unwrap_step(processor) -> None:
        """Take fastlora's wrappers off a processor that will not run again."""
        cb_unset_processor_steps(processor)
        sampler = processor.__dict__.pop("_fastlora_sampler", None)
        if sampler is not None:
            sampler.close()
        graphs = processor.__dict__.pop("_fastlora_graphs", None)
        if graphs is not None:
            graphs.close()
        processor._fastlora_enabled = False

    def _fail_orphans(self, processor, adapters: RequestAdapters) -> None:
        """Fail, one by one, the requests whose adapter was deleted since they were added; the
        others keep running (a step with an unknown adapter would fail them all)."""
        config = getattr(self.state.model, "peft_config", None)  # PEFT's adapters as they are now
        known = (set(config) if isinstance(config, dict) else set(self.state.registry.names)) | set(self.state.stored)
        known.add(BASE)
        ids = cb_request_ids(processor)
        errors = {rid: RuntimeError(f"fastlora: adapter {name!r} of request {rid!r} was deleted "
                                    "while the request was in flight")
                  for rid, name in zip(ids, adapters.lookup_all(ids)) if name is not None and name not in known}
        if errors:
            cb_fail_requests(processor, errors)
            adapters.forget(list(errors))
