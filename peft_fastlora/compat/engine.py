"""transformers' continuous-batching engine (``generate_batch`` / ``init_continuous_batching``), used
as shipped: the requests of each step, their states, the config fields fastlora turns off, the
engine's graphs, its token selection and its step failures. Checked on 5.17 and 5.25.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .modules import TRANSFORMERS_VERSION, set_attn_implementation


# The engine (``generate_batch`` / ``init_continuous_batching``, transformers >= 5.x) is used as
# shipped. What fastlora reads and wraps of it is grouped below by concern: its config, its paged
# cache (views, update, page tables), each step's requests (``inputs_and_outputs.requests_in_batch``,
# ``num_q_tokens``, set by ``prepare_batch_tensors``, in the order of the forward's one row), async
# batching, graphs, token selection, failures and the processor's steps. Checked on 5.17 and 5.25.
CB_CHILD_MARK = "__child#"  # request ids of forked sequences: f"{parent}__child#{i}"


_CB_OFF = {  # config field -> (value fastlora needs, why)
    "allow_block_sharing": (False, "prefix sharing would serve one adapter's KV cache to another"),
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


@functools.lru_cache(maxsize=None)  # the installed transformers' form: asked at every layer of an eager step
def _paged_update_form() -> Tuple[Optional[str], Optional[str]]:
    """How this transformers' engine updates its paged cache around an attention function:
    "indices" (5.17: the function calls ``cache.update`` with the step's read and write indices),
    "in_model" (5.24 on: the model's attention calls ``cache.update(key, value, layer_idx, kwargs)``
    first and hands the function every key the step reads); or (None, why not)."""
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        params = set(inspect.signature(PagedAttentionCache.update).parameters)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return None, f"transformers {TRANSFORMERS_VERSION}: {e}"
    if {"read_index", "write_index"} <= params:
        return "indices", None
    if "kwargs" in params:
        return "in_model", None
    return None, f"transformers {TRANSFORMERS_VERSION}'s paged cache takes another update call"


def cb_engine_attention_blocker() -> Optional[str]:
    """Why this transformers' engine cannot run fastlora's varlen attention (None: it can)."""
    return _paged_update_form()[1]


def cb_varlen_attention_name() -> str:
    """The name fastlora's varlen attention is registered under for the engine. From 5.24 the engine
    takes only ``paged|eager``, ``sdpa`` and names containing "flash" (for which it builds no mask
    and hands the packed layout alone), so the name says "flash"; before, a ``paged|`` name."""
    return "fastlora_flash_varlen" if _paged_update_form()[0] == "in_model" else "paged|fastlora_varlen"


def cb_paged_attention_name() -> str:
    """The name fastlora's in-place paged attention is registered under (the same forms as
    ``cb_varlen_attention_name``; no digit after "flash": the engine would take it for flash
    attention 2 or 3 and look for its block-table kernel)."""
    return "fastlora_flash_paged" if _paged_update_form()[0] == "in_model" else "paged|fastlora_paged"


def cb_full_attention_views(cache, layer_idx: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The (slots, KVH, D) key and value views of a full-attention layer of the engine's paged
    cache, which its write and read indices address (None: a sliding-window layer, or a cache
    laid out otherwise)."""
    if _paged_update_form()[0] == "in_model":
        from transformers.generation.continuous_batching.cache_allocators.full_attention import (
            FullAttentionCacheAllocator)

        allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
        if type(allocator) is not FullAttentionCacheAllocator:
            return None
        return allocator._kv_token_views.get(layer_idx)
    groups = getattr(cache, "layer_index_to_group_indices", None)
    if groups is None or layer_idx not in groups or cache.sliding_windows[layer_idx] != 1:
        return None
    _, in_group = groups[layer_idx]
    return cache.key_cache[in_group], cache.value_cache[in_group]


def cb_layer_indices(cache, layer_idx: int, kwargs: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """This layer's (read index, write index) out of the step's attention kwargs."""
    if _paged_update_form()[0] == "in_model":
        index = cache.layer_to_allocator[layer_idx].index
    else:
        index = cache.layer_index_to_group_indices[layer_idx][0]
    return kwargs["read_index"][index], kwargs["write_index"][index]


IN_PLACE_KV = "fastlora_kv_in_place"  # the kwargs key: (key view, value view, ``ops.paged_varlen.Pages``) of the layer


# The engine's page tables: a full-attention group of its paged cache keeps, per request, the ids of
# the blocks holding its keys (``block_table``), a page of ``tokens_per_page`` (5.24 on) or
# ``block_size`` (before) keys each, page ``j``'s first key at slot ``block_table[j] *
# block_physical_stride`` (5.24 on) or ``* block_size`` (before) of the layer's (slots, KVH, D)
# view. Checked on 5.17 and 5.25.
class PageGroup(NamedTuple):
    """One full-attention group (its allocator or cache manager); keys a page; the slot of block b's
    first key / b."""

    owner: object
    size: int
    stride: int

    def tables(self) -> Dict[str, list]:
        """Request id -> its block ids, as the engine holds them now."""
        return self.owner.block_table


def cb_page_groups(cache) -> Tuple[list, Dict[int, int]]:
    """The full-attention groups of the engine's paged cache (``PageGroup``) and, for each of its
    full-attention layers, the position of the layer's group in that list."""
    groups, positions, layer_group = [], {}, {}
    in_model = _paged_update_form()[0] == "in_model"
    layers = cache.layer_to_allocator if in_model else cache.layer_index_to_group_indices
    for layer in layers:
        if cb_full_attention_views(cache, layer) is None:
            continue
        owner = (cache.layer_to_allocator[layer] if in_model
                 else cache.group_cache_managers[cache.layer_index_to_group_indices[layer][0]])
        if id(owner) not in positions:
            positions[id(owner)] = len(groups)
            size = int(owner.tokens_per_page if in_model else owner.block_size)
            groups.append(PageGroup(owner, size, int(owner.block_physical_stride if in_model else owner.block_size)))
        layer_group[layer] = positions[id(owner)]
    return groups, layer_group


def cb_step_key_counts(processor) -> Tuple[list, list]:
    """The step about to run (a made-up warm-up step too): its requests' ids and how many keys each
    reads (its past and its new tokens), in the order of the forward's row."""
    states = [fs.state for fs in _host_io(processor).requests_in_batch]
    # the step's preparation moved each request's offset past its new tokens
    return [s.request_id for s in states], [int(s.position_offset) for s in states]


def cb_skip_read_indices(processor) -> None:
    """The engine builds no read indices (every key of every request a step reads, a Python list
    made and copied to the GPU at each step, the longer the contexts the costlier): its steps all
    say they read nothing from the cache, as steps of fresh prompts do. For a cache every layer of
    which the attention reads in place through a page table."""
    runner = processor.model_runner
    if "maybe_pad_inputs" in runner.__dict__:
        return
    # held weakly: a cycle through the runner would keep its cache until a garbage collection
    pad, runner_ref = type(runner).maybe_pad_inputs, weakref.ref(runner)

    def pad_no_reads(num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool):
        return pad(runner_ref(), num_q_tokens, max_kv_read, use_decode_fast_path)[0], 0

    runner.maybe_pad_inputs = pad_no_reads


def cb_step_pages(cache, layer_idx: int):
    """The page table of the step running on ``cache`` for a layer (``ops.paged_varlen.Pages``;
    None: the layer is not read in place)."""
    pages = getattr(cache, "_fastlora_pages", None)
    return None if pages is None else pages.of_layer(layer_idx)


def cb_write_only_updates(cache) -> None:
    """From 5.24 the model's attention calls ``cache.update(key, value, layer_idx, kwargs)``, which
    writes the step's new keys and values and gathers a copy of every key the step reads. Make
    this cache's update write only, for full-attention layers: it leaves (key view, value view,
    the step's pages) in ``kwargs[IN_PLACE_KV]`` for the attention function, which reads the cache
    in place, and returns the new tokens' states unchanged. A block-table step, a sliding-window
    layer or a cache without pages keeps the update. The wrapper holds the cache weakly: a cycle
    through it would keep the cache's memory until a garbage collection, after its manager
    stopped."""
    update, cache_ref = type(cache).update, weakref.ref(cache)

    def write_only(key_states, value_states, layer_idx, kwargs):
        cache = cache_ref()
        views = None if kwargs.get("block_table") is not None else cb_full_attention_views(cache, layer_idx)
        pages = cb_step_pages(cache, layer_idx) if views is not None else None
        if pages is None:
            kwargs.pop(IN_PLACE_KV, None)
            return update(cache, key_states, value_states, layer_idx, kwargs)
        allocator = cache.layer_to_allocator[layer_idx]
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
        _, write_index = cb_layer_indices(cache, layer_idx, kwargs)
        k_view, v_view = views
        k_view.index_copy_(0, write_index, key_states.squeeze(0).transpose(0, 1))
        v_view.index_copy_(0, write_index, value_states.squeeze(0).transpose(0, 1))
        kwargs[IN_PLACE_KV] = (k_view, v_view, pages)
        return key_states, value_states

    cache.update = write_only
    cache._fastlora_write_only = True


def cb_in_place_cache(processor, new_pages, skip_reads: bool):
    """Prepare a batch processor's cache for an attention that reads it in place through a page
    table (``continuous.pages.StepPages``, made by ``new_pages()`` where the cache holds none yet),
    returned: from 5.24 its update writes only (``cb_write_only_updates``); before, the attention
    function writes itself. ``skip_reads``: every layer reads in place, so the engine builds no
    read indices (``cb_skip_read_indices``)."""
    cache = processor.cache
    if getattr(cache, "_fastlora_pages", None) is None:
        cache._fastlora_pages = new_pages()
    if _paged_update_form()[0] == "in_model" and not getattr(cache, "_fastlora_write_only", False):
        cb_write_only_updates(cache)
    if skip_reads:
        cb_skip_read_indices(processor)
    return cache._fastlora_pages


def cb_set_attention(model: nn.Module, name: str) -> None:
    """Make ``name`` (a registered attention function) the model's attention. A name containing
    "flash" is set on the config directly: ``set_attn_implementation`` would look it up as a flash
    kernel to load from the hub."""
    if "flash" in name:
        model.config._attn_implementation = name
    else:
        set_attn_implementation(model, name)


def cb_config_for_lora(config, generation_config, graphs_blocker: Optional[str] = None,
                       max_requests: Optional[int] = None) -> Tuple[object, list]:
    """A copy of the continuous-batching config (the caller's, the one set on the generation
    config, or the default) with what per-request adapters need; and what was changed, why.
    ``graphs_blocker``: why the engine's CUDA graphs cannot carry this model's LoRA batches
    (None: the engine keeps its own choice). ``max_requests``: the most requests one step may
    hold (the slots, when the model has fewer than adapters). Graphs and async batching stay the
    caller's or the engine's choice."""
    import dataclasses

    from transformers import ContinuousBatchingConfig

    if config is None:
        config = getattr(generation_config, "continuous_batching_config", None)
    if not isinstance(config, ContinuousBatchingConfig):
        config = ContinuousBatchingConfig()
    off = dict(_CB_OFF)
    why_not_async = cb_async_blocker()
    if why_not_async is not None:
        off["use_async_batching"] = (False, why_not_async)
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


# Async batching (``use_async_batching``): the engine holds two IO pairs (``io_pairs``, a host and a
# device ``ContinuousBatchingIOs`` each) and alternates them: it prepares step N+1 in one pair while
# step N computes from the other, and updates step N's requests after launching step N+1 (its
# ``current_pair`` then points at step N's pair again). Checked on 5.17 and 5.25.


def cb_async(processor) -> bool:
    """Whether the engine runs async batching (two IO pairs)."""
    return getattr(processor.inputs_and_outputs, "io_pairs", None) is not None


def cb_async_blocker() -> Optional[str]:
    """Why fastlora cannot follow this transformers' async batching (None: it can)."""
    try:
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs
    except ImportError as e:
        return f"transformers {TRANSFORMERS_VERSION}: {e}"
    missing = [n for n in ("swap_io_pairs", "prepare_batch_update", "infer_carry_over_ids")
               if not callable(getattr(ContinuousBatchingAsyncIOs, n, None))]
    if missing:
        return f"transformers {TRANSFORMERS_VERSION}'s async batching has no {', '.join(missing)}"
    return None


def cb_async_device_blocker(device) -> Optional[str]:
    """Why the engine's async batching cannot run on ``device`` (None: it can): it needs the
    device's streams and events."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs

    kinds = tuple(getattr(ContinuousBatchingAsyncIOs, "_supported_device_types", ("cuda", "xpu")))
    kind = torch.device(device).type if device is not None else "cpu"
    if kind not in kinds:
        return f"transformers' async batching runs on {' or '.join(kinds)} only, and this model is on {kind}"
    return None


def _current_pair(processor):
    """The IO pair of the step about to run (None without async batching)."""
    ios = processor.inputs_and_outputs
    pairs = getattr(ios, "io_pairs", None)
    return None if pairs is None else pairs[ios.current_pair]


def _host_io(processor):
    """The host inputs of the step about to run (with async batching: its pair's)."""
    pair = _current_pair(processor)
    return processor.inputs_and_outputs if pair is None else pair.host_io


def _step_graph_io(processor):
    """The IO holding the graphs of the step about to run (with async batching: its pair's device IO)."""
    pair = _current_pair(processor)
    return processor.inputs_and_outputs if pair is None else pair.device_io


def _graph_ios(processor) -> list:
    """The IOs holding the engine's graphs: one, or one per IO pair (each pair its own graphs)."""
    ios = processor.inputs_and_outputs
    pairs = getattr(ios, "io_pairs", None)
    return [ios] if pairs is None else [pair.device_io for pair in pairs]


def cb_step(processor) -> Tuple[list, list, int]:
    """The step about to run: its requests' states (``.request_id``) and query lengths, in the
    order of their tokens in the forward's one row, and the forward's token count (padding
    included)."""
    ios = _host_io(processor)
    reqs = getattr(ios, "requests_in_batch", None)
    if reqs is None or not hasattr(ios, "num_q_tokens"):
        raise RuntimeError(f"fastlora: transformers {TRANSFORMERS_VERSION}'s continuous-batching inputs "
                           "do not list the step's requests")
    return [fs.state for fs in reqs], [int(fs.query_length) for fs in reqs], int(ios.num_q_tokens)


def cb_tokens_in_flight(processor) -> Tuple[Dict[str, int], Optional[object]]:
    """The tokens the engine selected and has not handed to its requests yet: with async batching,
    those of the step launched before the one about to run (its update comes after this step's
    launch). Returns (request id -> the token's index in ``output_ids``, that step's device
    ``output_ids`` row of tokens); ({}, None) without async batching."""
    ios = processor.inputs_and_outputs
    pairs = getattr(ios, "io_pairs", None)
    if pairs is None:
        return {}, None
    previous = pairs[1 - ios.current_pair]
    # the engine's own carry-over reads them in this order: one per request that got a token
    order = {rid: i for i, rid in enumerate(previous.host_io.req_id_to_new_token_position)}
    return order, previous.device_io.output_ids[0]


def cb_request_ids(processor) -> list:
    """Ids of the engine's requests that will be stepped again (active, then waiting)."""
    sched = processor.scheduler
    return list(sched.active_requests) + list(sched.waiting_requests)


def cb_active_count(manager) -> int:
    """How many requests the manager's engine holds in its batch (prefilling or decoding), 0
    before its processor exists."""
    sched = getattr(getattr(manager, "batch_processor", None), "scheduler", None)
    return len(getattr(sched, "active_requests", None) or ())


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
    holder = _graph_ios(processor)[0] if ios is not None else None
    for obj, attr in ((runner, "_get_forward_fn"), (runner, "use_cuda_graph_varlen"), (runner, "pad_inputs"),
                      (runner, "cache"), (holder, "graphs"), (ios, "use_block_table")):
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


def cb_step_graph_held(processor) -> Optional[bool]:
    """Whether the engine already holds a graph for the step about to run (False: the step captures
    one: the engine keys its graphs by the padded query tokens and, on the varlen path, the keys
    the step reads); None where this transformers does not say."""
    ios = _step_graph_io(processor)
    key_of, graphs = getattr(ios, "_get_graph_key", None), getattr(ios, "graphs", None)
    if key_of is None or not hasattr(graphs, "get_graph"):
        return None
    return graphs.get_graph(key_of()) is not None


def cb_settle_inputs(processor) -> None:
    """Wait for the work a batch processor left on the current stream when it was made or reset.
    With async batching the engine copies each step's inputs to the GPU on a stream of its own,
    which does not wait for the current one, where transformers 5.17 zeroes the IO pairs' device
    tensors (at construction and at each reset: the manager's start resets the processor its
    warm-up made) and goes on: that zeroing could land after the first step's inputs and run the
    first request on zeros. Later transformers synchronize the device there themselves."""
    stream = cb_stream(processor)
    if cb_async(processor) and isinstance(stream, torch.cuda.Stream):
        torch.cuda.synchronize(stream.device)


def cb_stream(processor):
    """The stream the engine computes (and replays its graphs) on; None off CUDA."""
    return getattr(processor.inputs_and_outputs, "compute_stream", None)


def cb_drop_graphs(processor) -> None:
    """Drop the engine's captured graphs (each is recaptured at its next use)."""
    for ios in _graph_ios(processor):
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


# Graph keys and warm-up. The engine keys a graph by the step's padded query count, its padded count
# of keys read and the longest request's key count padded to a power of two up to a cap
# (``max_length_k`` from 5.24, ``max_seqlen_k`` before); ``model_runner.run_one_warmup`` runs one
# made-up step of a given size on the current IO pair. Checked on 5.17 and 5.25.
def cb_key_length_cap(processor) -> int:
    """The most keys one engine step reads (the engine's bound on its read indices)."""
    cache = processor.cache
    return int(cache.max_tokens_read if hasattr(cache, "max_tokens_read") else cache.num_pages)


def cb_reads_skipped(processor) -> bool:
    """Whether the engine builds no read indices (``cb_skip_read_indices``): with the key length
    pinned (``cb_pin_key_lengths``), its graphs are then keyed by the query count alone."""
    return "maybe_pad_inputs" in processor.model_runner.__dict__


def cb_pin_key_lengths(processor) -> None:
    """Key the step about to run as if its longest request read the most keys the engine allows:
    with one bucket of keys read, graphs are then keyed by the query count alone."""
    io = _host_io(processor)
    lengths = io.max_length_k if hasattr(io, "max_length_k") else io.max_seqlen_k
    cap = cb_key_length_cap(processor)
    for layer_type in lengths:
        lengths[layer_type] = cap


def cb_query_sizes(processor) -> list:
    """Every padded query count a graphed step of the engine can have, largest first."""
    runner = processor.model_runner
    top, interval = int(runner.cache.max_batch_tokens), int(runner.cb_config.q_padding_interval_size)
    if interval <= 0:
        return [top]
    return sorted({min(q, top) for q in range(interval, top + interval, interval)}, reverse=True)


def cb_warm_up_sizes(processor, model, sizes) -> None:
    """One made-up step per query count in ``sizes`` (one request reading the most keys the engine
    allows) on every IO pair, each of which holds its own graphs; then the cache emptied."""
    runner, ios = processor.model_runner, processor.inputs_and_outputs
    pairs = len(getattr(ios, "io_pairs", None) or [ios])
    cap = cb_key_length_cap(processor)
    with torch.no_grad():  # as the engine's own warm-up
        for _ in range(pairs):
            for q in sizes:
                runner.run_one_warmup(model=model, num_q_tokens=int(q), max_kv_read=max(1, cap - int(q)))
            if pairs > 1:
                ios.swap_io_pairs()
    reset = getattr(processor.cache, "reset", None)
    if callable(reset):
        reset()


# The engine's token selection and step failures (``model_runner._sample`` writes the step's tokens
# into ``output_ids[0]`` in the order of the requests that get one; ``handle_batch_error`` fails a
# step's requests and frees their cache). Checked on 5.17 and 5.25.
def cb_logit_requests(processor) -> list:
    """The states of the step's requests that get a token, in the order of the logits' rows."""
    return [fs.state for fs in _host_io(processor).requests_in_batch if fs.has_new_token]


def cb_output_ids(processor):
    """The device tensor the current step's tokens are written into (row 0) before they are read
    back: with async batching, its IO pair's (a graph replay writes where it was captured, so this
    is read per step, not kept from a capture)."""
    return processor.inputs_and_outputs.output_ids


def cb_wrap_sample(processor, wrapper) -> None:
    """The engine's selection of this processor's tokens goes through
    ``wrapper(original, scores, output_ids)``; ``cb_unwrap_sample`` takes it off."""
    runner = processor.model_runner
    original = runner._sample
    runner._sample = lambda scores, output_ids: wrapper(original, scores, output_ids)


def cb_unwrap_sample(processor) -> None:
    processor.model_runner.__dict__.pop("_sample", None)


def cb_fail_step(processor, error: Exception) -> bool:
    """Fail the requests of the step that just raised (each delivered with the error), free their
    cache; the engine's other requests go on at the next step. Returns whether the engine's next
    ``update_batch`` must be skipped: without async batching it would update the failed step; with
    it, the step launched before this one is next, whose pair this makes current again (as the
    step's end would have), and is updated as usual (``cb_update_skipping_failed``)."""
    processor.handle_batch_error(error)
    if not cb_async(processor):
        return True
    ios = processor.inputs_and_outputs
    stream = getattr(ios, "compute_stream", None)
    if isinstance(stream, torch.cuda.Stream):  # what the step launched before it raised must not
        stream.synchronize()  # still run when its pair is prepared again (its update never waits)
    ios.swap_io_pairs()
    return False


def cb_update_skipping_failed(processor, update) -> None:
    """With async batching, run the engine's ``update`` of a step some of whose requests may have
    failed since it was launched (in the step after it, or between steps): the engine skips the
    requests it sees finished, consuming their tokens, and so skips these, which keep their failed
    status (the engine alone would update them and deliver them again)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    failed = [fs.state for fs in _host_io(processor).requests_in_batch if fs.state.status == RequestStatus.FAILED]
    for state in failed:
        state.status = RequestStatus.FINISHED
    try:
        update()
    finally:
        for state in failed:
            state.status = RequestStatus.FAILED


def _reset_start(request_state) -> int:
    """Where the tokens a request generated before the engine soft-reset it (its cache freed under
    pressure, an equivalent request requeued whose prompt holds them) start in its prompt; the
    prompt's length where it was never reset."""
    return getattr(request_state, "_true_initial_tokens", 0) or len(request_state.initial_tokens)


def _tokens_before_reset(request_state) -> list:
    return list(request_state.initial_tokens[_reset_start(request_state):])


def cb_generated_len(request_state) -> int:
    """How many tokens the request has generated (soft resets included)."""
    return len(request_state.initial_tokens) - _reset_start(request_state) + int(request_state.generated_len())


def cb_generated_tokens(request_state) -> list:
    """The request's generated tokens (soft resets included)."""
    return _tokens_before_reset(request_state) + list(request_state.generated_tokens)


def cb_cache_tokens(processor) -> int:
    """The most tokens (prompt and output) one request can hold in the engine's cache."""
    cache = processor.cache
    most = getattr(cache, "max_tokens_read", None)  # 5.24+: the largest allocator's pages
    if isinstance(most, int) and most > 0:
        return most
    return int(cache.num_blocks) * int(cache.block_size)


def cb_fatal_error(manager) -> Optional[BaseException]:
    """The error that ended the manager's thread (None when it ended normally or runs)."""
    status = getattr(manager, "background_thread_status", None)
    return getattr(status, "fatal_error", None)


# the batch processor's steps fastlora wraps on the instance: its name -> (owner attribute, method)
_PROCESSOR_STEPS = {"generation_step": (None, "_generation_step"), "prepare_next_batch": (None, "prepare_next_batch"),
                    "update_batch": (None, "update_batch"), "schedule_batch": ("scheduler", "schedule_batch"),
                    "compute_batch": ("model_runner", "compute_batch")}


def _step_owner(processor, owner: Optional[str]):
    return processor if owner is None else getattr(processor, owner)


def cb_processor_steps(processor) -> Dict[str, object]:
    """The processor's steps as they are now (``_PROCESSOR_STEPS``' names)."""
    return {name: getattr(_step_owner(processor, owner), attr) for name, (owner, attr) in _PROCESSOR_STEPS.items()}


def cb_set_processor_steps(processor, steps: Dict[str, object]) -> None:
    """Install these callables as the processor's steps, on its instances (``cb_unset_processor_steps``
    takes them off)."""
    for name, fn in steps.items():
        owner, attr = _PROCESSOR_STEPS[name]
        setattr(_step_owner(processor, owner), attr, fn)


def cb_unset_processor_steps(processor) -> None:
    for owner, attr in _PROCESSOR_STEPS.values():
        _step_owner(processor, owner).__dict__.pop(attr, None)


def cb_processor_factory(manager):
    """How the manager makes its batch processor."""
    return manager._create_batch_processor


def cb_set_processor_factory(manager, factory) -> None:
    manager._create_batch_processor = factory


def cb_manager_model(manager):
    """The model the manager's steps run."""
    return manager.model


def cb_cached_manager(model):
    """The manager transformers keeps on the model for its next ``generate_batch`` call (None: none)."""
    return getattr(model, "_cached_continuous_batching_manager", None)
