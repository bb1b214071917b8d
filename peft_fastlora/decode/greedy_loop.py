"""Greedy decoding with each step's token selection in one kernel (``ops.greedy_select``).

transformers' loop runs about 25 small launches between two decode steps, outside the step's
graph; at 8B they hold the GPU for about a step's 2%. This loop is transformers' greedy loop (the
same prefill, inputs, cache and stop check, read one step late) with the work from the logits to
the next ids done by ``greedy_select``: the argmax, the minimum-length processors' EOS masks, the
padding of finished rows and the EOS criterion. The ids grow in a buffer allocated once, not by a
``cat`` a step.

It serves the calls whose processors and criteria it reproduces exactly (``blocker`` says why
another call keeps transformers' loop): greedy, no streamer, logits processors among the two
minimum-length ones, stopping criteria among the maximum length and EOS.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..compat.generate import (cache_is_user_defined, decode_forward, decode_loop_context, generation_output_cache,
                               greedy_loop_missing, has_unfinished, pad_token_tensor, per_step_stop_check, prefill,
                               update_model_kwargs)
from ..kernel_support import kernel_runs_on
from ..ops.greedy_select import MAX_IDS, greedy_select, greedy_select_reference
from .stop_flag import FlagStopCheck, flag_check_applies



def _suppress_rules(logits_processor):
    """(kind, processor) of the minimum-length processors, or None when another is present."""
    rules = []
    for p in logits_processor:
        if type(p) is MinLengthLogitsProcessor:
            rules.append(("min_length", p))
        elif type(p) is MinNewTokensLengthLogitsProcessor:
            rules.append(("min_new_tokens", p))
        else:
            return None, type(p).__name__
    return rules, None


def patch_blocker(model) -> Optional[str]:
    """Why no call of this model runs this loop (None: greedy calls may; ``blocker`` decides each)."""
    return greedy_loop_missing(model)


def blocker(model, logits_processor, stopping_criteria, generation_config, streamer=None,
            synced_gpus=False) -> Optional[str]:
    """Why this call keeps transformers' loop (None: this loop serves it)."""
    why = patch_blocker(model)
    if why is not None:
        return why
    if generation_config.do_sample:
        return "sampling"
    if streamer is not None:
        return "a streamer"
    if synced_gpus or getattr(generation_config, "is_assistant", False):
        return "synced GPUs or an assistant model"
    if generation_config.return_dict_in_generate or getattr(model.config, "is_encoder_decoder", False):
        return "a dict result or an encoder-decoder"
    rules, other = _suppress_rules(logits_processor)
    if rules is None:
        return f"logits processor {other}"
    for c in stopping_criteria:
        if type(c) not in (MaxLengthCriteria, EosTokenCriteria):
            return f"stopping criterion {type(c).__name__}"
    if stopping_criteria.max_length is None:
        return "no maximum length"
    ids = [c.eos_token_id for c in stopping_criteria if type(c) is EosTokenCriteria]
    if any(torch.as_tensor(t).numel() > MAX_IDS for t in ids + [p.eos_token_id for _, p in rules]):
        return f"more than {MAX_IDS} EOS ids"
    return None


class _Suppression:
    """The ids the active minimum-length rules set to -inf at each length, on the device: one
    tensor per set of active rules, built once per call (no launch per step)."""

    def __init__(self, rules, device):
        self.rules = [(kind, p, p.eos_token_id.to(device=device, dtype=torch.int64).reshape(-1)) for kind, p in rules]
        self.by_active = {}

    def most(self) -> int:
        """The most ids suppressed at once (every rule active)."""
        return int(torch.unique(torch.cat([ids for _, _, ids in self.rules])).numel()) if self.rules else 0

    def at(self, length: int) -> Optional[torch.Tensor]:
        active = tuple(i for i, (kind, p, _) in enumerate(self.rules)
                       if (length < p.min_length if kind == "min_length"
                           else length - p.prompt_length_to_skip < p.min_new_tokens))
        if not active:
            return None
        if active not in self.by_active:
            self.by_active[active] = torch.unique(torch.cat([self.rules[i][2] for i in active]))
        return self.by_active[active]


def _select(logits, tokens, unfinished, pad, stop_ids, suppress, workspace=None):
    fits = suppress is None or suppress.numel() <= MAX_IDS
    if fits and logits.stride(-1) == 1 and kernel_runs_on(logits, tokens, unfinished):
        return greedy_select(logits, tokens, unfinished, pad, stop_ids, suppress, workspace)
    return greedy_select_reference(logits, tokens, unfinished, pad, stop_ids, suppress)


def greedy_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, stop_check_cls,
                fastlora_runner=None, **model_kwargs):
    """transformers' greedy ``_sample`` (the call ``blocker`` accepted) with the token selection
    in one kernel. ``stop_check_cls``: the deferred stop check's class; ``fastlora_runner``: the
    graph runner serving the call (its replayed steps may then advance their own inputs)."""
    device = input_ids.device
    rules, _ = _suppress_rules(logits_processor)
    suppression = _Suppression(rules, device)
    eos = [c.eos_token_id for c in stopping_criteria if type(c) is EosTokenCriteria]
    has_stop = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    stop_ids = (torch.cat([torch.as_tensor(t).reshape(-1) for t in eos]).to(device=device, dtype=torch.int64)
                if eos else None)
    pad = pad_token_tensor(generation_config)
    if has_stop:
        if pad is None:  # transformers' own loop fails here too (``pad * (1 - unfinished)``)
            raise ValueError("fastlora: an EOS criterion needs a pad token id (pass pad_token_id)")
        pad = pad.to(device=device, dtype=torch.int64).reshape(())
        if stop_ids is None:
            stop_ids = torch.empty(0, dtype=torch.int64, device=device)
    rows, length = input_ids.shape
    max_length = stopping_criteria.max_length
    # int64 whatever the prompt's dtype (transformers' ``cat`` with the int64 tokens promotes to it);
    # one column more than the maximum length for the deferred check's extra step
    ids = torch.empty(rows, max(max_length, length + 1) + 1, dtype=torch.int64, device=device)
    ids[:, :length] = input_ids
    unfinished = torch.ones(rows, dtype=torch.long, device=device)

    model_forward = decode_forward(model, model_kwargs, generation_config)
    outputs = prefill(model, input_ids, generation_config, model_kwargs)
    cache = generation_output_cache(outputs)
    cache_is_returned = generation_config.return_dict_in_generate or cache_is_user_defined(cache)
    runner = fastlora_runner
    is_assistant = generation_config.is_assistant
    if stop_check_cls.is_supported(device, cache, cache_is_returned, is_assistant=is_assistant):
        stop_check = (FlagStopCheck(device, max_length, runner) if flag_check_applies(device, runner, is_assistant)
                      else stop_check_cls(input_ids, max_length, cache, cache_is_returned, None))
    else:
        stop_check = per_step_stop_check()
    # the flag check's calls take advanced steps' tokens from the step-advance history, once
    from_history = isinstance(stop_check, FlagStopCheck)
    advance_refused = False
    n_stop = stop_ids.numel() if has_stop else None
    n_suppress_most = suppression.most()
    advance = None  # once set, each step's inputs are written on the GPU (``step_advance``)
    advance_suppress, tokens, widest = None, None, max_length
    prefill_consumed = False
    finished = False
    with decode_loop_context(model):
        while has_unfinished(model, finished, device):
            suppress = suppression.at(length)
            if advance is not None:
                if suppress is not advance_suppress:  # a minimum length ended: its graph without the ids
                    if from_history:
                        advance.flush(ids, length)
                    advance = runner.step_advance(widest, n_stop, suppress, n_suppress_most, _select)
                    if advance is None:  # the same inputs passed at the call's first decode step
                        raise RuntimeError("fastlora: a step-advance graph was refused mid-call; report this")
                    tokens, unfinished = advance.start(rows, unfinished, pad if has_stop else None,
                                                       stop_ids if has_stop else None, suppress, length)
                    advance_suppress = suppress
                runner.replay_advanced(advance)
            else:
                decode_step = prefill_consumed
                if decode_step:
                    model_inputs = model.prepare_inputs_for_generation(
                        input_ids, next_sequence_length=1 if model_kwargs["use_cache"] else None, **model_kwargs)
                    if runner is not None:
                        runner.last_step = None
                    outputs = model_forward(**model_inputs, return_dict=True)
                prefill_consumed = True
                if decode_step and runner is not None and not advance_refused:
                    widest = max(max_length, length + 1)
                    advance = runner.step_advance(widest, n_stop, suppress, n_suppress_most, _select)
                    advance_refused = advance is None  # nothing later in the call changes the answer
                if advance is not None:
                    runner.note_advanced_call()
                    tokens, unfinished = advance.start(rows, unfinished, pad if has_stop else None,
                                                       stop_ids if has_stop else None, suppress, length)
                    advance_suppress = suppress
                    advance.run()
                else:
                    model_kwargs = update_model_kwargs(model, outputs, model_kwargs)
                    logits = outputs.logits[:, -1]
                    if logits.device != device:
                        logits = logits.to(device)
                    _select(logits, ids[:, length], unfinished, pad if has_stop else None,
                            stop_ids if has_stop else None, suppress)
                del outputs
            if advance is not None and not from_history:
                ids[:, length].copy_(tokens)
            length += 1
            input_ids = ids[:, :length]
            if length >= max_length:  # the maximum-length criterion: every row is done
                unfinished.zero_()
            if from_history:
                finished = stop_check(advance.done() if advance is not None else unfinished.max() == 0, length)
            else:
                finished = stop_check(unfinished, ids[:, length - 1], length)
    if advance is not None and from_history:
        advance.flush(ids, length)
    if runner is not None:
        runner.last_step = None
    undo = stop_check.finish()
    return input_ids[:, :length - undo].contiguous() if undo else input_ids.contiguous()
