"""transformers' generate: the decode step's kwargs, its loop and stop checks, masks, and the static
cache fastlora's graphs decode over.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from .modules import TRANSFORMERS_VERSION
from .tensor_parallel import tp_size


_FORWARD_PARAMS: dict = {}  # forward function -> its parameter names (signatures do not change)


def forward_accepts(model: nn.Module, name: str) -> bool:
    # asked at every decode step (the runner finds the step's cache by its kwarg), and
    # inspect.signature costs more host time than the rest of the step's bookkeeping
    fn = getattr(model.forward, "__func__", model.forward)
    params = _FORWARD_PARAMS.get(fn)
    if params is None:
        try:
            params = frozenset(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            params = frozenset()
        _FORWARD_PARAMS[fn] = params
    return name in params


def cache_kwarg_name(model: nn.Module) -> str:
    """transformers >= 5.2x renamed the forward kwarg ``past_key_values`` to ``cache``."""
    return "cache" if forward_accepts(model, "cache") else "past_key_values"


@contextlib.contextmanager
def compiled_call_override(model: nn.Module, step):
    """Within the block, HF ``generate`` runs its decode steps through ``step``.

    ``GenerationMixin`` calls ``self.get_compiled_call(compile_config)`` for the forward of each
    decode step when ``self._valid_auto_compile_criteria(...)`` holds (a static cache is in use);
    both are overridden on this instance only and removed on exit.
    """
    for name in ("get_compiled_call", "_valid_auto_compile_criteria"):
        if not callable(getattr(type(model), name, None)):
            raise RuntimeError(
                f"fastlora: transformers {TRANSFORMERS_VERSION} has no GenerationMixin.{name}; "
                "decode graphs cannot hook into generate (patch with cuda_graphs=False)")
    model.get_compiled_call = lambda compile_config=None: step
    model._valid_auto_compile_criteria = lambda model_kwargs, generation_config: True
    try:
        yield
    finally:
        model.__dict__.pop("get_compiled_call", None)
        model.__dict__.pop("_valid_auto_compile_criteria", None)


@contextlib.contextmanager
def mask_builder_override(model: nn.Module, builder):
    """Within the block, ``generate`` builds each step's 4-D mask with ``builder`` (it looks up
    ``self.create_masks_for_generate`` first, then transformers' function; a class with its own
    is left alone). ``builder`` takes transformers' keyword arguments."""
    from transformers.generation import utils as gen_utils

    if (getattr(type(model), "create_masks_for_generate", None) is not None
            or not callable(getattr(gen_utils, "create_masks_for_generate", None))):
        yield
        return
    model.create_masks_for_generate = builder
    try:
        yield
    finally:
        model.__dict__.pop("create_masks_for_generate", None)


def transformers_mask_builder():
    from transformers.generation import utils as gen_utils

    return gen_utils.create_masks_for_generate


class StepMaskSpec(NamedTuple):
    """How transformers builds a config's one-token decode masks (``step_mask_spec``)."""

    keys: Optional[Tuple[str, ...]]  # layer types the masks come keyed by; None: one mask for all
    window: Optional[int]  # the sliding window of its sliding layers (None: no sliding layer)
    additive: bool  # eager's float masks (0 where attended, the dtype's min elsewhere), not booleans


def step_mask_spec(config) -> Optional[StepMaskSpec]:
    """For a config whose layers all get transformers' causal or sliding-window causal mask, made
    by ``sdpa_mask`` or ``eager_mask`` (no chunked attention, no other layer types), how it is
    laid out; None for any other config."""
    from transformers import masking_utils as mu

    cfg = config.get_text_config()
    try:
        interface = mu.ALL_MASK_ATTENTION_FUNCTIONS[cfg._attn_implementation]
    except (KeyError, AttributeError):
        return None
    if interface is not mu.sdpa_mask and interface is not mu.eager_mask:
        return None
    if getattr(cfg, "attention_chunk_size", None) is not None or getattr(cfg, "is_causal", True) is False:
        return None
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        makers = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask}
        patterns = set(layer_types)
        if not patterns <= set(makers) or any(
                mu.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(p) is not makers[p] for p in patterns):
            return None
        if "sliding_attention" not in patterns:
            window = None
        elif not isinstance(window, int):
            return None
        keys = tuple(sorted(patterns))
    else:
        keys = None
        if window is not None and not isinstance(window, int):
            return None
    return StepMaskSpec(keys, window, interface is mu.eager_mask)


def deferred_stop_check_class():
    """transformers' ``DeferredStopCheck`` (reads "all rows finished" one step late), or None
    where this version has none or its sampling loop does not pick it by that global name."""
    from transformers.generation import utils as gen_utils

    cls = getattr(gen_utils, "DeferredStopCheck", None)
    loop = getattr(gen_utils.GenerationMixin, "_sample", None)
    if cls is None or loop is None or getattr(loop, "__wrapped__", None) is not None:
        return None
    code = getattr(loop, "__code__", None)
    if code is None or "DeferredStopCheck" not in code.co_names:
        return None
    try:
        params = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return None
    if params[:6] != ["self", "input_ids", "max_length", "cache", "cache_is_returned", "streamer"]:
        return None
    return cls


def sample_loop_with_stop_check(stop_check_cls):
    """A copy of ``GenerationMixin._sample`` (greedy and sampling decode loop) that uses
    ``stop_check_cls`` where transformers' own reads ``DeferredStopCheck``; the module is not
    changed. Its globals are copied per call, so later changes to the module are seen."""
    from transformers.generation import utils as gen_utils

    loop = gen_utils.GenerationMixin._sample
    scope = dict(loop.__globals__)
    scope["DeferredStopCheck"] = stop_check_cls
    copy = types.FunctionType(loop.__code__, scope, loop.__name__, loop.__defaults__, loop.__closure__)
    copy.__kwdefaults__ = loop.__kwdefaults__
    copy.__qualname__, copy.__doc__ = loop.__qualname__, loop.__doc__
    return copy


_GREEDY_LOOP_PARTS = ("_prefill", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation",
                      "_has_unfinished_sequences", "_optimize_model_for_decode", "_valid_auto_compile_criteria",
                      "get_compiled_call")


def greedy_loop_missing(model) -> Optional[str]:
    """Why ``decode.greedy_loop`` cannot stand in for this transformers' greedy loop (None: it can):
    the loop's own steps (prefill, inputs, kwargs update, stop test) and the stop-check classes."""
    from transformers.generation import utils as gen_utils

    missing = [name for name in _GREEDY_LOOP_PARTS if not callable(getattr(model, name, None))]
    if getattr(gen_utils, "StopCheck", None) is None:
        missing.append("StopCheck")
    if not isinstance(getattr(gen_utils, "ALL_CACHE_NAMES", None), (list, tuple)):
        missing.append("ALL_CACHE_NAMES")
    if missing:
        return f"transformers {TRANSFORMERS_VERSION} has no {', '.join(missing)} for fastlora's greedy loop"
    return None


# the steps of transformers' greedy loop that ``decode.greedy_loop`` calls in the same order
def pad_token_tensor(generation_config):
    """The pad token id as the loop holds it (a tensor, or None)."""
    return generation_config._pad_token_tensor


def decode_forward(model, model_kwargs, generation_config):
    """What the loop runs its decode steps with: the compiled call where it would compile one."""
    if model._valid_auto_compile_criteria(model_kwargs, generation_config):
        return model.get_compiled_call(generation_config.compile_config)
    return model.__call__


def prefill(model, input_ids, generation_config, model_kwargs):
    """The loop's first forward (the prompt), its outputs."""
    return model._prefill(input_ids, generation_config, model_kwargs,
                          is_first_iteration=not generation_config.is_assistant)


def decode_loop_context(model):
    """The context the loop decodes in."""
    return model._optimize_model_for_decode()


def has_unfinished(model, finished: bool, device) -> bool:
    """The loop's test of whether another step runs."""
    return model._has_unfinished_sequences(finished, False, device=device)


def update_model_kwargs(model, outputs, model_kwargs):
    """The loop's kwargs for the next step (cache, attention mask, positions)."""
    return model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)


def cache_is_user_defined(cache) -> bool:
    """Whether the caller passed this cache (transformers then returns it)."""
    return bool(getattr(cache, "_is_user_defined", False))


def generation_output_cache(outputs):
    """The cache a step's outputs carry (transformers' loop looks it up by these names), or None."""
    from transformers.generation import utils as gen_utils

    return next((outputs[name] for name in gen_utils.ALL_CACHE_NAMES if name in outputs), None)


def default_max_length() -> int:
    """The ``max_length`` transformers applies where neither the call nor a generation config sets
    a length."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    length = defaults().get("max_length") if callable(defaults) else GenerationConfig().max_length
    return int(length) if length is not None else 20


def hand_back_cache(model: nn.Module, outputs, cache, rows: int) -> None:
    """Where ``generate``'s ``outputs`` return ``cache`` (one of fastlora's static caches: views of
    buffers the next call overwrites, with the graph bucket's padding rows and its whole length),
    put in its place a ``DynamicCache`` of its first ``rows`` rows and filled positions, the cache
    transformers' own call would have returned."""
    from transformers import DynamicCache

    items = getattr(outputs, "items", None)
    names = [name for name, value in items() if value is cache] if callable(items) else []
    if not names:
        return
    length = int(cache.get_seq_length())
    own = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        own.update(layer.keys[:rows, :, :length].clone(), layer.values[:rows, :, :length].clone(), i)
    for name in names:
        outputs[name] = own


def per_step_stop_check():
    """transformers' stop check that reads "all rows finished" after every step (no streamer)."""
    from transformers.generation import utils as gen_utils

    return gen_utils.StopCheck(None)


def generation_mode_name(generation_config) -> str:
    """The decoding method transformers picks for this (prepared) config: e.g. "_sample", or a
    Hub repository for the modes it moved there."""
    from transformers.generation import utils as gen_utils

    return gen_utils.GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode(), "?")


def static_cache_layout(model: nn.Module) -> list:
    """Per decoder layer: (kv heads, key head dim, value head dim) of its cache, from the config;
    under tensor parallelism, this rank's heads (k/v are column-sharded by whole heads)."""
    cfg = model.config.get_text_config(decoder=True)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return [(kv_heads // tp_size(model), head_dim, head_dim)] * cfg.num_hidden_layers


def sliding_window(model: nn.Module) -> Optional[int]:
    """The smallest attention window of the model's layers (None: every layer attends to all)."""
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and not any("sliding" in str(t) or "chunk" in str(t) for t in types):
        return None  # e.g. Qwen2 with use_sliding_window=False keeps a window it does not use
    return int(window) if isinstance(window, int) and window > 0 else None


def full_attention_config(model: nn.Module):
    """The text config with every layer full-attention: what a static cache is built from. A call
    whose sequence fits the window gives the same masks and attention with full layers (no token
    ever leaves the window), so fastlora's graphs serve sliding-window models up to their window."""
    import copy

    cfg = copy.deepcopy(model.config.get_text_config(decoder=True))
    if getattr(cfg, "sliding_window", None) is not None:
        cfg.sliding_window = None
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
    return cfg


def static_cache_blocker(model: nn.Module) -> Optional[str]:
    """Why decode graphs cannot run over a ``StaticCache`` of this model (None: they can).

    Builds the cache object (from ``full_attention_config``) without allocating it (its layers
    allocate lazily) and checks that every layer is a plain full-attention static layer that
    tracks its length on the device.
    """
    from transformers import StaticCache

    try:
        cache = StaticCache(config=full_attention_config(model), max_cache_len=8)
    except Exception as e:  # noqa: BLE001 - any failure means: no static cache for this model
        return f"transformers cannot build a StaticCache for it ({type(e).__name__}: {e})"
    if len(cache.layers) != len(static_cache_layout(model)):
        return "its cache layers do not match its decoder layers"
    for layer in cache.layers:
        if not is_plain_static_layer(layer):
            return (f"its static cache has {type(layer).__name__} layers (sliding windows or other "
                    "non-full attention)")
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            return f"cache layer {type(layer).__name__} tracks its length on the host"
    return None


def is_plain_static_layer(layer) -> bool:
    """transformers' own full-attention ``StaticLayer`` (not a subclass with another update)."""
    from transformers.cache_utils import StaticLayer

    return (isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False)
            and type(layer).update is StaticLayer.update)


def static_cache_over(model: nn.Module, max_cache_len: int, views) -> object:
    """A ``StaticCache`` whose layers use the given (keys, values) tensors, (rows, heads, len, dim)
    each, as their storage (views of buffers owned by the caller).

    ``StaticLayer.lazy_initialization`` sets the layer's device, dtype, sizes and length tensor from
    probe states and allocates zeros of ``max_cache_len``; it runs here with a length of 1, then the
    caller's views replace the two tiny tensors.
    """
    from transformers import StaticCache

    cache = StaticCache(config=full_attention_config(model), max_cache_len=max_cache_len)
    if len(cache.layers) != len(views):
        raise RuntimeError(f"fastlora: StaticCache has {len(cache.layers)} layers, expected {len(views)}")
    for layer, (k, v) in zip(cache.layers, views):
        probe_k = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
        probe_v = v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])
        layer.max_cache_len = 1
        try:
            layer.lazy_initialization(probe_k, probe_v)
        finally:
            layer.max_cache_len = max_cache_len
        if not (getattr(layer, "is_initialized", False) and tuple(layer.keys.shape) == tuple(probe_k.shape)
                and tuple(layer.values.shape) == tuple(probe_v.shape)):
            raise RuntimeError(
                f"fastlora: transformers {TRANSFORMERS_VERSION}'s {type(layer).__name__}.lazy_initialization "
                "no longer allocates (rows, heads, max_cache_len, dim) keys and values; static caches "
                "cannot be built over shared buffers")
        layer.keys, layer.values = k, v
    return cache
