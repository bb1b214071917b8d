"""The next greedy decode step's inputs in one launch: what ``decode.step_advance`` does to a
captured decode graph's static buffers after the token selection.

The 4-D masks (``(rows, 1, 1, length)``: one query per row) get their next column made visible
(``True`` in a boolean mask, ``0.0`` in an additive one), the counters (``position_ids``,
``cache_position``) grow by one, and the column index moves on, clamped at ``last_column`` (past
it only the deferred stop check's extra step reads the mask). A single program walks the rows in
blocks: it reads the column before it moves it, so no ordering between programs is needed, and a
decode bucket's rows are few. Without the kernel, ``advance_inputs_reference`` does the same in
torch (four to six launches).

Given a ``StepRecord``, the same launch also does what the loop did between steps with torch ops:
the step's tokens go into a history buffer's next column, and a flag says whether every row has
finished (transformers' ``unfinished.max() == 0``, the stop check's input).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..kernel_support import tl, triton
from ..kernel_support import kernel_runs_on

MAX_MASKS = 2  # a model's mask dict (full and sliding) has at most two
MAX_COUNTERS = 2  # position_ids and cache_position
MAX_BLOCK = 1024  # rows a pass of the program covers


class StepRecord(NamedTuple):
    """What a step leaves for the loop: ``tokens`` (rows,) int64 written into ``history`` (rows,
    width) int64 at column ``column`` ((1,) int64, then moved on, clamped at width - 1), and
    ``done`` ((1,) bool) set to whether every ``unfinished`` (rows,) int64 flag is 0."""

    tokens: torch.Tensor
    history: torch.Tensor
    column: torch.Tensor
    unfinished: torch.Tensor
    done: torch.Tensor


@triton.jit
def _advance_masks_and_counters(
    mask0_ptr, mask1_ptr,  # (rows_m, 1, 1, length): the column at ``column_ptr`` made visible
    count0_ptr, count1_ptr,  # 1-D integers through their strides: + 1
    column_ptr,  # (1,) int64: the masks' next column, then moved on (clamped at last_column)
    tokens_ptr, history_ptr, history_column_ptr, unfinished_ptr, done_ptr,  # a StepRecord (RECORD)
    rows_m0, rows_m1, stride_m0r, stride_m0c, stride_m1r, stride_m1c,
    n_c0, n_c1, stride_c0, stride_c1, last_column,
    n_rec, stride_t, stride_hr, last_history_column,
    N_MASKS: tl.constexpr, N_COUNTERS: tl.constexpr,
    VISIBLE0: tl.constexpr, VISIBLE1: tl.constexpr,  # the masks' "attend" value (1.0: True, 0.0: additive)
    RECORD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    col = tl.load(column_ptr)
    most = tl.maximum(tl.maximum(rows_m0, rows_m1), tl.maximum(n_c0, n_c1))
    if RECORD:
        hcol = tl.load(history_column_ptr)
        most = tl.maximum(most, n_rec)
        running = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, most, BLOCK):
        r = start + tl.arange(0, BLOCK)
        r64 = r.to(tl.int64)
        if N_MASKS > 0:
            value = tl.full([BLOCK], VISIBLE0, tl.float32).to(mask0_ptr.dtype.element_ty)
            tl.store(mask0_ptr + r64 * stride_m0r + col * stride_m0c, value, mask=r < rows_m0)
        if N_MASKS > 1:
            value = tl.full([BLOCK], VISIBLE1, tl.float32).to(mask1_ptr.dtype.element_ty)
            tl.store(mask1_ptr + r64 * stride_m1r + col * stride_m1c, value, mask=r < rows_m1)
        if N_COUNTERS > 0:
            at = count0_ptr + r64 * stride_c0
            tl.store(at, tl.load(at, mask=r < n_c0) + 1, mask=r < n_c0)
        if N_COUNTERS > 1:
            at = count1_ptr + r64 * stride_c1
            tl.store(at, tl.load(at, mask=r < n_c1) + 1, mask=r < n_c1)
        if RECORD:
            tok = tl.load(tokens_ptr + r64 * stride_t, mask=r < n_rec)
            tl.store(history_ptr + r64 * stride_hr + hcol, tok, mask=r < n_rec)
            running = tl.maximum(running, tl.load(unfinished_ptr + r64, mask=r < n_rec, other=0))
    tl.store(column_ptr, tl.minimum(col + 1, last_column))
    if RECORD:
        tl.store(done_ptr, tl.max(running, axis=0) == 0)
        tl.store(history_column_ptr, tl.minimum(hcol + 1, last_history_column))


def _visible(mask: torch.Tensor):
    return True if mask.dtype == torch.bool else 0.0


def advance_inputs_reference(masks: Sequence[torch.Tensor], counters: Sequence[torch.Tensor],
                             column: torch.Tensor, last_column: int, record: Optional[StepRecord] = None) -> None:
    """``advance_inputs`` in torch ops (what the kernel must equal)."""
    for t in counters:
        t.add_(1)
    for m in masks:
        m.index_fill_(-1, column, _visible(m))
    column.add_(1).clamp_(max=last_column)
    if record is not None:
        record.history.index_copy_(1, record.column, record.tokens.unsqueeze(1))
        record.column.add_(1).clamp_(max=record.history.shape[1] - 1)
        record.done.copy_((record.unfinished.max() == 0).reshape(1))


def _check_record(record: StepRecord) -> None:
    tokens, history, column, unfinished, done = record
    rows = tokens.shape[0]
    if (tokens.dim() != 1 or history.dim() != 2 or history.shape[0] != rows or unfinished.shape != (rows,)
            or column.shape != (1,) or done.shape != (1,)):
        raise ValueError("a StepRecord needs (rows,) tokens and unfinished, (rows, width) history, (1,) column "
                         "and done")
    if {tokens.dtype, history.dtype, column.dtype, unfinished.dtype} != {torch.int64} or done.dtype != torch.bool:
        raise ValueError("a StepRecord's tensors are int64 (done: bool)")
    if history.stride(1) != 1 or not unfinished.is_contiguous():
        raise ValueError("a StepRecord's history rows and unfinished must be contiguous")


def kernel_takes(masks: Sequence[torch.Tensor], counters: Sequence[torch.Tensor], column: torch.Tensor,
                 record: Optional[StepRecord] = None) -> bool:
    """Whether ``advance_inputs`` launches its kernel for these buffers (otherwise the torch ops):
    at most two one-query masks and two 1-D-like integer counters, on a device Triton runs on."""
    if len(masks) > MAX_MASKS or len(counters) > MAX_COUNTERS:
        return False
    if any(m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1 for m in masks):
        return False
    if any(t.is_floating_point() or t.dim() > 2 or (t.dim() == 2 and t.shape[1] != 1) for t in counters):
        return False
    if column.shape != (1,) or column.dtype != torch.int64:
        return False
    return kernel_runs_on(column, *masks, *counters, *(record or ()))


def advance_inputs(masks: Sequence[torch.Tensor], counters: Sequence[torch.Tensor], column: torch.Tensor,
                   last_column: int, record: Optional[StepRecord] = None, max_block: int = MAX_BLOCK) -> None:
    """Make each mask's column ``column`` visible, add one to each counter, then move ``column`` on
    (at most ``last_column``): one launch where ``kernel_takes`` says so, torch ops otherwise.

    Args:
        masks: 4-D masks ``(rows, 1, 1, length)``, boolean (``True``: attend) or float (``0.0``: attend).
        counters: integer tensors, ``(n,)`` or ``(n, 1)`` (``position_ids``, ``cache_position``).
        column: (1,) int64 on the masks' device.
        last_column: the largest column ``column`` may reach.
        record: the step's tokens into a history and the "every row finished" flag (``StepRecord``).
        max_block: rows a pass of the program covers (a power of 2; more rows take several passes).
    """
    if record is not None:
        _check_record(record)
    if not isinstance(max_block, int) or max_block < 1 or max_block & (max_block - 1):
        raise ValueError(f"advance_inputs: max_block must be a power of 2, got {max_block!r}")
    if not kernel_takes(masks, counters, column, record):
        advance_inputs_reference(masks, counters, column, last_column, record)
        return
    m = list(masks) + [column] * (MAX_MASKS - len(masks))  # placeholders, never read or written
    c = list(counters) + [column] * (MAX_COUNTERS - len(counters))
    rows_m = [t.shape[0] if i < len(masks) else 0 for i, t in enumerate(m)]
    n_c = [t.shape[0] if i < len(counters) else 0 for i, t in enumerate(c)]
    n_rec = record.tokens.shape[0] if record is not None else 0
    most = max(rows_m + n_c + [n_rec, 1])
    vis = [1.0 if i < len(masks) and _visible(t) is True else 0.0 for i, t in enumerate(m)]
    rec = record if record is not None else (column,) * 5  # placeholders, never read or written
    _advance_masks_and_counters[(1,)](
        m[0], m[1], c[0], c[1], column, *rec,
        rows_m[0], rows_m[1], m[0].stride(0), m[0].stride(-1), m[1].stride(0), m[1].stride(-1),
        n_c[0], n_c[1], c[0].stride(0), c[1].stride(0), last_column,
        n_rec, rec[0].stride(0), rec[1].stride(0), (rec[1].shape[1] - 1) if record is not None else 0,
        N_MASKS=len(masks), N_COUNTERS=len(counters), VISIBLE0=vis[0], VISIBLE1=vis[1],
        RECORD=record is not None, BLOCK=min(max_block, triton.next_power_of_2(most)), num_warps=4,
    )


__all__ = ["MAX_COUNTERS", "MAX_MASKS", "StepRecord", "advance_inputs", "advance_inputs_reference", "kernel_takes"]
