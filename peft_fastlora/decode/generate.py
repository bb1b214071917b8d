"""The ``generate`` of a patched model: one call boundary per call (PEFT's adapters checked and
their values copied once), and, where the call allows it, decode steps replayed from CUDA graphs
(see ``runner.py``). ``warmup`` captures a server's graphs before its first request."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..compat.generate import (cache_kwarg_name, compiled_call_override, default_max_length, hand_back_cache,
                               mask_builder_override, static_cache_blocker)
from ..compat.modules import multi_device_reason, uncapturable_layers_reason
from ..compat.tensor_parallel import tp_graph_blocker
from ..instance_methods import InstancePatches
from . import deferred_stop, step_mask
from .runner import DecodeGraphRunner
from .static_cache import CacheUnavailable

logger = logging.getLogger("peft_fastlora")


def graphs_wanted(state) -> Optional[str]:
    """Whether this model can use the graph runner at all: None if yes, else the reason."""
    opt = state.options.cuda_graphs
    if opt is False:
        return "cuda_graphs=False"
    if opt != "emulate" and state.device.type != "cuda":
        return "the model is not on CUDA"
    uncapturable = uncapturable_layers_reason(state.inner) if opt != "emulate" else None
    if uncapturable is not None:
        return uncapturable
    if not hasattr(state.inner, "get_compiled_call") or not hasattr(state.inner, "config"):
        return "not a transformers generation model"
    split = multi_device_reason(state.inner)
    if split is not None:
        return f"{split}: a CUDA graph captures one device"
    tp = tp_graph_blocker(state.inner)  # a sharded model's collectives are captured too
    if tp is not None:
        return tp
    if state.lora_plan.left_on_peft:
        return "some LoRA layers are left on PEFT's path"
    return static_cache_blocker(state.inner)


def call_blocker(state, args, kwargs) -> Optional[str]:
    """Why this ``generate`` call must decode eagerly, or None."""
    if kwargs.get("adapter_names") is None and state.has_lora:
        return "no adapter_names"
    if int(call_setting(state, kwargs, "num_beams") or 1) > 1:
        return "beam search reorders the cache"
    if kwargs.get("assistant_model") is not None or call_setting(state, kwargs, "prompt_lookup_num_tokens"):
        return "assisted generation"
    if any(k in kwargs for k in ("past_key_values", "cache", "cache_implementation")):
        return "the caller chose the cache"
    if state.inner.training:
        return "training mode"
    if call_setting(state, kwargs, "use_cache") is False:
        return "use_cache=False"  # each step feeds the whole sequence: no cache may be given
    if call_setting(state, kwargs, "output_hidden_states") or call_setting(state, kwargs, "output_attentions"):
        # a replayed step's outputs live in the graph's buffers, which the next step overwrites
        return "the call returns each step's hidden states or attentions"
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return "no 2-D input_ids"
    return None


def call_setting(state, kwargs, name):
    """A ``generate`` setting as transformers resolves it: the call's keyword, else the call's
    ``generation_config``, else the model's (None where none sets it)."""
    for source in (kwargs, kwargs.get("generation_config"), state.inner.generation_config):
        value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
        if value is not None:
            return value
    return None


def _needed_length(state, ids, kwargs) -> int:
    new = kwargs.get("max_new_tokens", None)
    if new is None and kwargs.get("max_length") is not None:
        return int(kwargs["max_length"])
    if new is None:
        new = call_setting(state, kwargs, "max_new_tokens")
    if new is None:
        length = call_setting(state, kwargs, "max_length")
        # set nowhere: transformers generates its default length past the prompt
        return int(length) if length is not None else ids.shape[1] + default_max_length()
    return ids.shape[1] + int(new)


@contextlib.contextmanager
def armed(inner, runner: DecodeGraphRunner, adapter_names, cache=None):
    """Within the block, ``inner.generate`` sends its decode steps to ``runner``.

    HF's generate calls ``get_compiled_call`` for the forward of each step when its cache is a
    static one; the override lives on this instance only and is removed on exit. ``cache``: the
    call's static cache when the call may read its stop flag one step late (marked for the block).
    """
    with compiled_call_override(inner, runner), \
            mask_builder_override(inner, step_mask.builder(runner.caches)):
        runner.adapter_names = None if adapter_names is None else list(adapter_names)
        if cache is not None:
            setattr(cache, deferred_stop.CALL_ATTR, runner)
        try:
            yield runner
        finally:
            runner.adapter_names = None
            runner.last_step = None  # the last step's inputs (a sampling loop never clears them)
            if cache is not None:
                cache.__dict__.pop(deferred_stop.CALL_ATTR, None)


def run_generate(state, generate, args, kwargs, min_cache_len: int = 0):
    """One call of the patched ``generate`` (``generate``: the original bound method)."""
    if state.continuous is not None:
        state.continuous.check_plain_call()
    with state.call(kwargs.get("adapter_names")):
        runner = state.graph_runner
        if runner is None:
            return generate(*args, **kwargs)
        blocker = call_blocker(state, args, kwargs)
        if blocker is not None:
            runner.note_eager(blocker)
            return generate(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids.shape[0] * int(call_setting(state, kwargs, "num_return_sequences") or 1)
        needed_len = max(_needed_length(state, ids, kwargs), min_cache_len)
        try:
            cache = runner.begin_call(rows, needed_len)
        except CacheUnavailable as e:
            runner.note_eager(str(e))
            runner.make_room(rows, needed_len)
            return generate(*args, **kwargs)
        kwargs = dict(kwargs)
        kwargs[cache_kwarg_name(state.inner)] = cache
        runner.own_positions = kwargs.get("position_ids") is not None
        deferred = (state.decode_plan.stop_check_off is None
                    and deferred_stop.call_reason(state.inner, args, kwargs) is None)
        if deferred:
            kwargs["custom_generate"] = deferred_stop.decoding_method(kwargs.get("streamer"))
        with armed(state.inner, runner, kwargs.get("adapter_names"), cache if deferred else None):
            out = generate(*args, **kwargs)
        if getattr(out, "sequences", None) is not None:  # return_dict_in_generate: the cache is the caller's
            hand_back_cache(state.inner, out, cache, out.sequences.shape[0])
        return out


class GenerateHook:
    """The patched ``generate`` of one model: installed on the instance, removed by ``remove``."""

    def __init__(self, state):
        self.model = state.model
        self._methods = InstancePatches()
        self.original = self._methods.wrap(self.model,
            "generate", lambda original: lambda model, *args, **kwargs: run_generate(state, original, args, kwargs))

    def remove(self):
        self._methods.restore()


@dataclass
class WarmupReport:
    """What ``warmup`` did: graphs captured, seconds, and the memory held afterwards."""

    batch_sizes: list
    max_length: int
    captures: int
    seconds: float
    cache_bytes: int
    graph_pool_bytes: Optional[int]
    cuda_graphs: str


def warm_up(state, batch_sizes: Optional[Sequence[int]] = None, max_length: int = 512,
            adapter_names: Optional[Sequence[str]] = None) -> WarmupReport:
    """``fastlora.warmup`` on a model's ``FastLoRAState``."""
    runner = state.graph_runner
    if runner is None:
        return WarmupReport([], max_length, 0, 0.0, 0, 0, state.report.cuda_graphs)
    if max_length < 2:
        raise ValueError(f"fastlora.warmup: max_length must be at least 2, got {max_length}")
    if batch_sizes is None:
        buckets = list(runner.buckets)
    else:
        buckets = []
        for b in batch_sizes:
            bucket = runner.bucket_for(int(b))
            if bucket is None:
                raise ValueError(f"fastlora.warmup: batch size {b} exceeds the largest graph bucket "
                                 f"{runner.buckets[-1]}")
            buckets.append(bucket)
    # PEFT's adapters as they are now (a server warms up again after adding or deleting some)
    state.sync(())
    # default: as many adapters as the GPU slots hold (all, unless the model has fewer slots)
    given = adapter_names is not None and len(adapter_names) > 0
    names = list(adapter_names) if given else (state.registry.names[:state.registry.num_slots] or ["__base__"])
    unknown = sorted({n for n in names if n != "__base__" and n not in state.registry.index and n not in state.stored})
    if unknown:
        raise ValueError(f"fastlora.warmup: unknown adapter(s): {', '.join(unknown)}")
    gc = state.inner.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else 0
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    captures0 = runner.stats["captures"]
    t0 = time.perf_counter()
    both_folds = state.has_lora and not given and state.folds_per_call()
    for rows in sorted(set(buckets), reverse=True):
        mixes = [names]
        if both_folds:  # the graph of calls that do not fold, and of calls that do
            mixes += [["__base__"], state.slots.fold_prone_adapters(min(rows, state.registry.num_slots))]
        for mix in mixes:
            ids = torch.full((rows, 1), int(pad), dtype=torch.long, device=state.device)
            # three tokens, EOS suppressed for two: a decode step with the EOS ids suppressed and
            # one without, so that both of the bucket's step-advance graphs exist too
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                          min_new_tokens=2, do_sample=False, pad_token_id=int(pad))
            if state.has_lora:
                kwargs["adapter_names"] = [mix[i % len(mix)] for i in range(rows)]
            with torch.no_grad():
                run_generate(state, state.generate_hook.original, (), kwargs, min_cache_len=max_length)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    stats = runner.stats
    report = WarmupReport(sorted(set(buckets)), max_length, stats["captures"] - captures0,
                          time.perf_counter() - t0, stats["cache_bytes"], stats["graph_pool_bytes"],
                          state.report.cuda_graphs)
    logger.info("fastlora: warm-up captured %d decode graphs in %.2f s (static caches %.1f MiB)",
                report.captures, report.seconds, report.cache_bytes / 2**20)
    return report
