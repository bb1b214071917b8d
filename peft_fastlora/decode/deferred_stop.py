"""Decode steps queued one ahead of the host, on calls fastlora's graphs serve.

transformers' greedy / sampling loop asks after every step whether all rows have finished
(``StopCheck``): a device-to-host read, so the host prepares the next step only once the GPU has
run the last one, and the GPU waits meanwhile. Its ``DeferredStopCheck`` reads that flag one step
late and undoes the one extra step it then runs; transformers enables it on "mps" only, and on
CUDA only where a returned cache could be rolled back.

On a call whose decode steps fastlora replays, the cache is fastlora's own static cache: reset by
the next call and not handed to the caller (calls that ask for it back, ``return_dict_in_generate``,
keep the per-step check), so the extra step's cache entry needs no rollback. fastlora then passes
``generate`` a copy of transformers' loop whose ``DeferredStopCheck`` accepts that cache, through
the public ``custom_generate`` argument: transformers' module is not changed, and every other call
(and every other model) keeps transformers' own choice. Greedy calls whose logits processors and
stopping criteria ``greedy_loop`` reproduces run that loop instead (each step's token selection in
one kernel); the others run the copy.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional


from ..compat.generate import (cache_kwarg_name, deferred_stop_check_class, generation_mode_name,
                               sample_loop_with_stop_check)
from ..compat.modules import TRANSFORMERS_VERSION
from . import greedy_loop, stop_flag

# the attribute that marks the cache of an armed call (the runner serving it), set by ``armed``
CALL_ATTR = "_fastlora_deferred_stop_runner"
_LOOP = "_sample"  # transformers' greedy / sampling loop: the one copied


@functools.lru_cache(maxsize=None)
def _stop_check_class(base):
    class OwnCacheDeferredStopCheck(base):
        """transformers' deferred check, accepted for the cache of a call fastlora's graphs serve
        (which needs no rollback); any other cache gets transformers' own answer."""

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant):
            if getattr(cache, CALL_ATTR, None) is not None and device.type in stop_flag.DEVICE_TYPES and not is_assistant:
                return True
            return base.is_supported(device, cache, cache_is_returned, is_assistant)

        def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None):
            self._runner = getattr(cache, CALL_ATTR, None)
            # fastlora's cache is reset by the next call and not returned: nothing to roll back
            super().__init__(input_ids, max_length, cache, cache_is_returned and self._runner is None, streamer)

        def finish(self):
            undo = super().finish()
            if self._runner is not None:
                self._runner.note_deferred_stop(undo)
            return undo

    return OwnCacheDeferredStopCheck


def unavailable_reason(options) -> Optional[str]:
    """Why no call of this model can defer its stop check (None: calls may)."""
    if options.defer_stop_check is False:
        return "defer_stop_check=False"
    if deferred_stop_check_class() is None:
        return f"transformers {TRANSFORMERS_VERSION} has no deferred stop check fastlora can use"
    return None


_MODE_FIELDS = ("do_sample", "num_beams", "num_beam_groups", "top_k", "penalty_alpha", "constraints",
                "force_words_ids", "dola_layers", "use_mtp", "prompt_lookup_num_tokens",
                "assistant_early_exit", "return_dict_in_generate")


def call_reason(inner, args, kwargs) -> Optional[str]:
    """Why this call keeps the per-step check (None: it may defer). The decoding mode is read as
    transformers will read it; the loop copied handles greedy search and sampling only."""
    if len(args) > 1:
        return "positional arguments after the inputs"
    if kwargs.get("custom_generate") is not None:
        return "the caller's custom_generate"
    if kwargs.get("synced_gpus"):
        return "synced_gpus"
    # transformers hands a custom_generate callable none of its tokenizer arguments (stop strings)
    for name in ("tokenizer", "assistant_tokenizer"):
        if kwargs.get(name) is not None:
            return f"{name} given"
    config = kwargs.get("generation_config") or inner.generation_config
    probe = copy.copy(config)
    for name in _MODE_FIELDS:
        if name in kwargs:
            setattr(probe, name, kwargs[name])
    if probe.return_dict_in_generate:
        return "return_dict_in_generate returns the cache"
    if generation_mode_name(probe) != _LOOP:
        return f"decoding mode {probe.get_generation_mode()}"
    return None


def decoding_method(streamer=None):
    """The ``custom_generate`` callable: transformers' loop with the deferred check fastlora
    accepts. ``streamer``: the call's (transformers hands a callable none, though it still streams
    the prompt itself). A decoding mode other than the loop's, which ``call_reason`` rules out,
    raises."""
    stop_check = _stop_check_class(deferred_stop_check_class())
    call_streamer = streamer

    def fastlora_sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                        synced_gpus=False, streamer=None, **model_kwargs):
        mode = generation_mode_name(generation_config)
        if mode != _LOOP:
            raise RuntimeError(f"fastlora: a graphed generate call reached decoding method {mode!r}; "
                               "patch with defer_stop_check=False and report this")
        streamer = streamer if streamer is not None else call_streamer
        runner = getattr(model_kwargs.get(cache_kwarg_name(self)), CALL_ATTR, None)
        why = greedy_loop.blocker(self, logits_processor, stopping_criteria, generation_config, streamer, synced_gpus)
        if runner is not None:
            runner.note_token_selection(why)
        if why is None:
            return greedy_loop.greedy_loop(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                           stop_check, fastlora_runner=runner, **model_kwargs)
        loop = sample_loop_with_stop_check(stop_check)
        return loop(self, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                    generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    return fastlora_sample
