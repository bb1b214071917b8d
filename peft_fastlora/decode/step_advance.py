"""Greedy decode steps whose next inputs the GPU writes: no host work between two replays but
launching them.

Between two replayed decode steps, transformers' loop builds the next step's inputs on the host
(``prepare_inputs_for_generation``, the mask builder, ``_update_model_kwargs_for_generation``) and
the runner copies them into the graph's static buffers: some hundreds of microseconds of Python and
about fifteen small launches a step, each waiting for the one before. On a greedy call whose step
inputs follow fixed rules, ``StepAdvance`` replaces all of that with one small graph replayed after
the step's own: the token selection (``ops.greedy_select``) writes the next ids straight into the
static ``input_ids``, ``position_ids`` and ``cache_position`` advance by one, and the static 4-D
masks (built by ``step_mask``: the 2-D padding mask laid into the first columns) get their next
column (those three in one more kernel, ``ops.step_inputs``). That kernel also writes the tokens
into a history buffer's next column and sets a flag when every row has finished, so the loop
launches nothing else between steps: it copies the history into its ids once, at the end, and
its stop check reads the flag (``stop_flag.FlagStopCheck``). The static cache advances its own
lengths inside the step's graph, as on every replay. While a minimum length suppresses EOS ids
the selection takes them from a static buffer; the loop moves to the graph without them at the
step the rule ends.

``blocker`` says why a step's inputs do not follow those rules (then the call keeps the loop's own
per-step work): an input other than those four and the cache, a mask ``step_mask`` did not build,
a sliding window or a cache shorter than the call, more suppressed ids than the kernel takes. A
step-advance graph whose capture fails runs its few ops eagerly: the call stays correct.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from ..ops.greedy_select import MAX_IDS, SelectWorkspace
from ..ops.step_inputs import advance_inputs, advance_inputs_reference, kernel_takes, StepRecord

MASK_TAG = "_fastlora_step_mask"  # set by ``step_mask`` on the masks it builds: value, the window (or 0)
_ADVANCED = ("input_ids", "position_ids", "cache_position", "attention_mask")


def _masks(value) -> Optional[List[torch.Tensor]]:
    """The 4-D mask tensors of a step's ``attention_mask`` (a tensor or a dict of them), or None."""
    tensors = list(value.values()) if isinstance(value, dict) else [value]
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return None
    return tensors


def blocker(inputs: Dict[str, object], rows: int, max_length: int, n_suppress: int) -> Optional[str]:
    """Why a greedy call cannot advance its steps' inputs on the GPU from this step on (None: it can).
    ``inputs``: the step's own (not the static copies); ``max_length``: the widest 2-D mask a step
    of the call will have (the deferred check's extra step included); ``n_suppress``: the most ids
    a minimum length of the call suppresses at once."""

    if n_suppress > MAX_IDS:
        return f"more than {MAX_IDS} suppressed ids"
    for name, value in inputs.items():
        tensor_like = isinstance(value, torch.Tensor) or (
            isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()))
        if tensor_like and name not in _ADVANCED:
            return f"a step input it does not advance ({name})"
    ids, masks = inputs.get("input_ids"), _masks(inputs.get("attention_mask"))
    if not isinstance(ids, torch.Tensor) or ids.shape != (rows, 1) or ids.dtype != torch.int64:
        return "no (rows, 1) int64 input_ids"
    if masks is None or any(getattr(m, MASK_TAG, None) is None for m in masks):
        return "a mask fastlora's step mask did not build"
    window = getattr(masks[0], MASK_TAG)
    if (window and max_length > window) or max_length > masks[0].shape[-1]:
        return "the call outgrows its mask (a sliding window or the cache)"
    pos, cpos = inputs.get("position_ids"), inputs.get("cache_position")
    if pos is not None and (pos.dim() != 2 or pos.shape[1] != 1 or pos.dtype not in (torch.int32, torch.int64)):
        return "position_ids not (rows, 1) integers"
    if cpos is not None and (cpos.shape != (1,) or cpos.dtype not in (torch.int32, torch.int64)):
        return "cache_position not one integer"
    return None


class StepAdvance:
    """The token selection and the next step's inputs of one captured decode graph, for every row
    of its bucket, as a graph of its own (``EmulatedGraph``-style re-runs when emulating). A call
    of fewer rows reads the first ones; the bucket's padding rows count as finished (they select
    ``pad``) and their tokens, like their inputs on the host-built path, are never read. One per
    decode graph and kind of call (an EOS criterion or not, EOS ids suppressed or not): the ids
    sit in ``MAX_IDS`` slots padded with -1, which no column matches, so any EOS list and any
    minimum length share the graph, and ``warmup`` captures the ones a server's calls use.

    Args:
        static: the decode graph's static inputs (the runner's copies, ``padded`` rows).
        logits: the decode graph's static logits, (padded, 1 or more, vocab).
        has_stop: the calls have an EOS criterion (rows finish on a stop id; finished rows take ``pad``).
        suppressing: a minimum length suppresses EOS ids at these steps.
        select: ``(logits, tokens, unfinished, pad, stop_ids, suppress, workspace)``, the loop's selection.
    """

    def __init__(self, static: Dict[str, object], logits: torch.Tensor, has_stop: bool, suppressing: bool,
                 select):

        dev = logits.device
        self.tokens = static["input_ids"][:, 0]  # the selection writes the next ids here
        self.logits = logits[:, -1]
        padded = self.tokens.shape[0]
        self.unfinished = torch.ones(padded, dtype=torch.int64, device=dev)
        self.pad = torch.zeros((), dtype=torch.int64, device=dev)
        self.stop = torch.full((MAX_IDS,), -1, dtype=torch.int64, device=dev) if has_stop else None
        self.suppress = torch.full((MAX_IDS,), -1, dtype=torch.int64, device=dev) if suppressing else None
        self.column = torch.zeros(1, dtype=torch.int64, device=dev)
        self.counters = [t for t in (static.get("position_ids"), static.get("cache_position")) if t is not None]
        self.masks = _masks(static["attention_mask"])
        self.last_column = self.masks[0].shape[-1] - 1
        self._select = select
        # a call's tokens stop at its maximum length (at most the mask's width, ``blocker``), one
        # past it for the deferred check's extra step: two columns more than the mask's
        self.record = StepRecord(tokens=self.tokens, column=torch.zeros(1, dtype=torch.int64, device=dev),
                                 history=torch.zeros(padded, self.last_column + 3, dtype=torch.int64, device=dev),
                                 unfinished=self.unfinished, done=torch.zeros(1, dtype=torch.bool, device=dev))
        self.first_column = 0  # the call's first column in the history (``start``)
        fused = kernel_takes(self.masks, self.counters, self.column, self.record)
        self._advance = advance_inputs if fused else advance_inputs_reference
        # its own slots and tickets: the shared workspace is replaced when a larger batch selects,
        # and a captured launch would keep the freed one
        self.workspace = SelectWorkspace(dev, padded)
        self.graph = None  # a CUDA graph, or None: ``run`` calls the work directly (emulation, eager)

    def _work(self):
        self._select(self.logits, self.tokens, self.unfinished, self.pad if self.stop is not None else None,
                     self.stop, self.suppress, self.workspace)
        # the masks' next column, the counters and the column in one launch; past the cache's
        # last column only the deferred check's extra step reads the mask: the column stays in range
        self._advance(self.masks, self.counters, self.column, self.last_column, self.record)

    def _state(self) -> List[torch.Tensor]:
        rec = self.record
        return [self.tokens, self.unfinished, self.column, rec.history, rec.column, rec.done,
                *self.counters, *self.masks]

    def capture(self, pool, capture_fn):
        """Capture the work as a CUDA graph in ``pool``; warm-up runs are undone."""
        saved = [t.clone() for t in self._state()]

        def restore():
            for t, s in zip(self._state(), saved):
                t.copy_(s)

        try:
            self.graph, _ = capture_fn(self._work, pool, restore)
        except BaseException:
            restore()
            raise
        self.graph.fastlora_step_advance = True  # benchmarks time the step graphs' replays alone

    def start(self, rows: int, unfinished: torch.Tensor, pad: Optional[torch.Tensor], stop_ids: Optional[torch.Tensor],
              suppress_ids: Optional[torch.Tensor], next_column: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """A call's values (from this step on; its ``rows`` first rows) into the graph's buffers;
        returns (tokens, unfinished) of those rows, the buffers the loop reads from now on."""
        self.unfinished[:rows].copy_(unfinished)
        self.unfinished[rows:].zero_()  # the bucket's padding rows: finished
        if self.stop is not None:
            self.pad.copy_(pad)
            self.stop.fill_(-1)[:stop_ids.numel()].copy_(stop_ids)
        if self.suppress is not None:
            self.suppress.fill_(-1)[:suppress_ids.numel()].copy_(suppress_ids)
        self.column.fill_(min(next_column, self.last_column))
        self.record.column.fill_(next_column)
        self.first_column = next_column
        return self.tokens[:rows], self.unfinished[:rows]

    def done(self) -> torch.Tensor:
        """(1,) bool: whether every row had finished after the last run (the stop check's flag)."""
        return self.record.done

    def flush(self, ids: torch.Tensor, length: int) -> None:
        """The tokens of the runs since ``start`` (columns ``first_column .. length - 1``) into the
        call's ``ids`` (its rows, in one copy)."""
        first = self.first_column
        if length > first:
            ids[:, first:length].copy_(self.record.history[:ids.shape[0], first:length])

    def run(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self._work()
