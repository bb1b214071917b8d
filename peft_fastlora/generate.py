"""The ``generate`` of a patched model: decides per call whether decode steps replay CUDA graphs,
and arms the graph runner for the call (see ``graphs.py``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Optional

import torch

from . import _compat
from .graphs import DecodeGraphRunner

logger = logging.getLogger("peft_fastlora")


def graphs_wanted(state) -> Optional[str]:
    """Whether this model can use the graph runner at all: None if yes, else the reason."""
    opt = state.options["cuda_graphs"]
    if opt is False:
        return "cuda_graphs=False"
    if opt != "emulate" and state.device.type != "cuda":
        return "the model is not on CUDA"
    if not hasattr(state.inner, "get_compiled_call") or not hasattr(state.inner, "config"):
        return "not a transformers generation model"
    if state.report.left_on_peft:
        return "some LoRA layers are left on PEFT's path"
    return None


def call_blocker(state, args, kwargs) -> Optional[str]:
    """Why this ``generate`` call must decode eagerly, or None."""
    if kwargs.get("adapter_names") is None:
        return "no adapter_names"
    if int(kwargs.get("num_beams", 1) or 1) > 1:
        return "beam search reorders the cache"
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        return "assisted generation"
    if any(k in kwargs for k in ("past_key_values", "cache", "cache_implementation")):
        return "the caller chose the cache"
    if state.inner.training:
        return "training mode"
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return "no 2-D input_ids"
    return None


def _needed_length(state, ids, kwargs) -> int:
    gc = kwargs.get("generation_config") or state.inner.generation_config
    new = kwargs.get("max_new_tokens", None)
    if new is None and "max_length" in kwargs:
        return int(kwargs["max_length"])
    if new is None:
        new = gc.max_new_tokens
    if new is None:
        return int(gc.max_length)
    return ids.shape[1] + int(new)


@contextlib.contextmanager
def armed(inner, runner: DecodeGraphRunner, adapter_names):
    """Within the block, ``inner.generate`` sends its decode steps to ``runner``.

    HF's generate calls ``get_compiled_call`` for the forward of each step when its cache is a
    static one; the override lives on this instance only and is removed on exit.
    """
    inner.get_compiled_call = lambda compile_config=None: runner
    inner._valid_auto_compile_criteria = lambda model_kwargs, generation_config: True
    runner.adapter_names = None if adapter_names is None else list(adapter_names)
    try:
        yield runner
    finally:
        runner.adapter_names = None
        inner.__dict__.pop("get_compiled_call", None)
        inner.__dict__.pop("_valid_auto_compile_criteria", None)


def install_generate(state):
    model = state.model
    why = graphs_wanted(state)
    state.graph_blocker = why
    if why is not None:
        return
    state.graph_runner = DecodeGraphRunner(state, state.inner,
                                           fake_graphs=state.options["cuda_graphs"] == "emulate",
                                           buckets=state.options["graph_buckets"])
    original = model.__dict__.get("generate")
    state._saved_generate = original
    orig_bound = model.generate

    @functools.wraps(orig_bound)
    def generate(self, *args, **kwargs):
        blocker = call_blocker(state, args, kwargs)
        if blocker is not None:
            state.graph_runner.stats["eager_reasons"][blocker] = (
                state.graph_runner.stats["eager_reasons"].get(blocker, 0) + 1)
            return orig_bound(*args, **kwargs)
        runner = state.graph_runner
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids.shape[0] * int(kwargs.get("num_return_sequences", 1) or 1)
        if runner.bucket_for(rows) is None:
            reason = f"batch of {rows} rows exceeds the largest graph bucket {runner.buckets[-1]}"
            runner.stats["eager_reasons"][reason] = runner.stats["eager_reasons"].get(reason, 0) + 1
            return orig_bound(*args, **kwargs)
        state.sync()
        if runner.generation != state.generation:
            runner.graphs.clear()  # they read stacks or fused weights that were rebuilt
            runner.generation = state.generation
        kwargs[_compat.generate_cache_kwarg(state.inner)] = runner.cache_for(rows, _needed_length(state, ids, kwargs))
        with armed(state.inner, runner, kwargs["adapter_names"]):
            return orig_bound(*args, **kwargs)

    model.generate = types.MethodType(generate, model)


def uninstall_generate(state):
    if state.graph_runner is None:
        return
    saved = getattr(state, "_saved_generate", None)
    if saved is None:
        state.model.__dict__.pop("generate", None)
    else:
        state.model.generate = saved
    state.graph_runner = None
