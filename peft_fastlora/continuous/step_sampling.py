"""One batch processor's per-request token selection (``sampling.select``), around its steps.

Before a step's forward, ``plan`` reads which of the rows that get a token belong to requests with
sampling parameters. The engine's own selection runs as always (inside its CUDA graph where the
step is graphed) and leaves its logits here: a reference to them on eager steps; on graphed steps
a copy of the planned rows' logits into a buffer of this object's, by a gather captured in the
graph that reads its row list from the device (``ops.row_gather``: the list is written before each
replay, and a step with no planned row copies nothing). After the forward, ``finish`` selects again
for the planned rows only and overwrites their tokens before the engine reads them back.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..compat.engine import (cb_generated_len, cb_generated_tokens, cb_logit_requests, cb_output_ids,
                             cb_tokens_in_flight, cb_unwrap_sample, cb_wrap_sample)
from ..ops.row_gather import gather_rows
from .sampling import RequestSampling, SamplingParams, select, to_device


class _Plan:
    """The rows of one step that ``finish`` selects for. With async batching the step before is
    still in flight when this one is planned: a request's token from it is not in its state yet,
    so it counts in its position and is read for the penalties from that step's device tokens
    (``in_flight[j]``: its index there, -1 for none)."""

    __slots__ = ("rows", "request_ids", "params", "positions", "outputs", "in_flight", "in_flight_tokens")

    def __init__(self, rows, request_ids, params, positions, outputs, in_flight, in_flight_tokens):
        self.rows: List[int] = rows
        self.request_ids: List[str] = request_ids
        self.params: List[SamplingParams] = params
        self.positions: List[int] = positions
        self.outputs: List[List[int]] = outputs
        self.in_flight: List[int] = in_flight
        self.in_flight_tokens: Optional[torch.Tensor] = in_flight_tokens


class StepSampler:
    """Args:
        records: the manager's ``RequestSampling``.
        processor: the engine's batch processor (its selection is wrapped until ``close``).
        rows: the most rows of logits one step has (the buffer of graphed steps).
        vocab: the logits' columns.
    """

    def __init__(self, records: RequestSampling, processor, rows: int, vocab: int):
        self.records, self.processor = records, processor
        self._rows, self._vocab = rows, vocab
        self._plan: Optional[_Plan] = None
        self._scores: Optional[torch.Tensor] = None  # this eager step's logits
        self._selected = False  # the engine's selection ran through ``_sample`` (or was captured)
        self._graph_scores: Optional[torch.Tensor] = None  # what graphed steps gather planned rows' logits into
        self._row_table: Optional[torch.Tensor] = None  # the gather's [count, rows...] on the device
        self._table_count = 0  # the count the table holds
        self._graphed = False
        cb_wrap_sample(processor, self._sample)

    def close(self) -> None:
        cb_unwrap_sample(self.processor)
        self._scores = self._graph_scores = self._row_table = self._plan = None

    def plan(self) -> None:
        """Read the step about to run (its inputs are prepared)."""
        self._plan = None
        if not len(self.records):
            return
        states = cb_logit_requests(self.processor)
        params = self.records.params_of([s.request_id for s in states])
        rows = [i for i, p in enumerate(params) if p is not None]
        if not rows:
            return
        chosen = [params[i] for i in rows]
        outputs = [cb_generated_tokens(states[i]) if (p.presence_penalty or p.frequency_penalty) else []
                   for i, p in zip(rows, chosen)]
        order, tokens = cb_tokens_in_flight(self.processor)
        in_flight = [order.get(states[i].request_id, -1) for i in rows]
        positions = [cb_generated_len(states[i]) + (k >= 0) for i, k in zip(rows, in_flight)]
        self._plan = _Plan(rows, [states[i].request_id for i in rows], chosen, positions, outputs,
                           in_flight, tokens if any(k >= 0 for k in in_flight) else None)

    def before_forward(self, graphed: bool, device: torch.device) -> None:
        """``graphed``: the forward is captured or replayed in a graph (or emulates one)."""
        self._graphed = graphed
        if not graphed:
            return
        if self._graph_scores is None:  # made before any capture, outside its pool
            self._graph_scores = torch.empty(self._rows, self._vocab, dtype=torch.float32, device=device)
            self._row_table = torch.zeros(self._rows + 1, dtype=torch.int32, device=device)
            self._table_count = 0
        rows = self._plan.rows if self._plan is not None else []
        if rows or self._table_count:  # queued on the step's stream before its replay, the host not waiting
            self._row_table[: len(rows) + 1].copy_(to_device([len(rows)] + rows, torch.int32, device),
                                                    non_blocking=True)
            self._table_count = len(rows)

    def _sample(self, original, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        original(scores, output_ids)
        self._selected = True
        if self._graphed:
            gather_rows(scores[0], self._row_table, self._graph_scores)
            self._scores = None
        else:
            self._scores = scores[0]

    def finish(self) -> None:
        """After the forward: the planned rows' tokens selected again, their log-probabilities
        recorded."""
        plan, self._plan = self._plan, None
        scores = self._graph_scores if self._graphed else self._scores
        self._scores = None
        if plan is None:
            return
        if scores is None or not self._selected:
            raise RuntimeError("fastlora: the engine's step selected no tokens through its sampler")
        output_ids = cb_output_ids(self.processor)
        index = to_device(plan.rows, torch.int64, scores.device)
        # graphed: the gather left the planned rows first, in the plan's order
        planned = scores[: len(plan.rows)] if self._graphed else scores.index_select(0, index)
        last = None
        if plan.in_flight_tokens is not None:
            at = to_device(plan.in_flight, torch.int64, plan.in_flight_tokens.device)
            last = torch.where(at >= 0, plan.in_flight_tokens[at.clamp(min=0)].long(), -1).to(scores.device)
        tokens, logprobs = select(planned, plan.params, plan.positions, plan.outputs, last)
        output_ids[0].index_copy_(0, index.to(output_ids.device), tokens.to(output_ids.dtype).to(output_ids.device))
        for rid, entry in zip(plan.request_ids, logprobs):
            if entry is not None:
                self.records.record(rid, entry)
