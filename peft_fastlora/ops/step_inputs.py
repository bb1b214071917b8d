"""The next greedy decode step's inputs in one launch: what ``decode.step_advance`` does to a
captured decode graph's static buffers after the token selection.

The 4-D masks (``(rows, 1, 1, length)``: one query per row) get their next column made visible
(``True`` in a boolean mask, ``0.0`` in an additive one), the counters (``position_ids``,
``cache_position``) grow by one, and the column index moves on, clamped at ``last_column`` (past
it only the deferred stop check's extra step reads the mask). A single program walks the rows in
blocks: it reads the column before it moves it, so no ordering between programs is needed, and a
decode bucket's rows are few. Without the kernel, ``advance_inputs_reference`` does the same in
torch (four to six launches).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ..kernel_support import kernel_runs_on

MAX_MASKS = 2  # a model's mask dict (full and sliding) has at most two
MAX_COUNTERS = 2  # position_ids and cache_position
MAX_BLOCK = 1024  # rows a pass of the program covers


@triton.jit
def _advance_masks_and_counters(
    mask0_ptr, mask1_ptr,  # (rows_m, 1, 1, length): the column at ``column_ptr`` made visible
    count0_ptr, count1_ptr,  # 1-D integers through their strides: + 1
    column_ptr,  # (1,) int64: the masks' next column, then moved on (clamped at last_column)
    rows_m0, rows_m1, stride_m0r, stride_m0c, stride_m1r, stride_m1c,
    n_c0, n_c1, stride_c0, stride_c1, last_column,
    N_MASKS: tl.constexpr, N_COUNTERS: tl.constexpr,
    VISIBLE0: tl.constexpr, VISIBLE1: tl.constexpr,  # the masks' "attend" value (1.0: True, 0.0: additive)
    BLOCK: tl.constexpr,
):
    col = tl.load(column_ptr)
    most = tl.maximum(tl.maximum(rows_m0, rows_m1), tl.maximum(n_c0, n_c1))
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
    tl.store(column_ptr, tl.minimum(col + 1, last_column))


def _visible(mask: torch.Tensor):
    return True if mask.dtype == torch.bool else 0.0


def advance_inputs_reference(masks: Sequence[torch.Tensor], counters: Sequence[torch.Tensor],
                             column: torch.Tensor, last_column: int) -> None:
    """``advance_inputs`` in torch ops (what the kernel must equal)."""
    for t in counters:
        t.add_(1)
    for m in masks:
        m.index_fill_(-1, column, _visible(m))
    column.add_(1).clamp_(max=last_column)


def kernel_takes(masks: Sequence[torch.Tensor], counters: Sequence[torch.Tensor], column: torch.Tensor) -> bool:
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
    return kernel_runs_on(column, *masks, *counters)


def advance_inputs(masks: Sequence[torch.Tensor], counters: Sequence[torch.Tensor], column: torch.Tensor,
                   last_column: int) -> None:
    """Make each mask's column ``column`` visible, add one to each counter, then move ``column`` on
    (at most ``last_column``): one launch where ``kernel_takes`` says so, torch ops otherwise.

    Args:
        masks: 4-D masks ``(rows, 1, 1, length)``, boolean (``True``: attend) or float (``0.0``: attend).
        counters: integer tensors, ``(n,)`` or ``(n, 1)`` (``position_ids``, ``cache_position``).
        column: (1,) int64 on the masks' device.
        last_column: the largest column ``column`` may reach.
    """
    if not kernel_takes(masks, counters, column):
        advance_inputs_reference(masks, counters, column, last_column)
        return
    m = list(masks) + [column] * (MAX_MASKS - len(masks))  # placeholders, never read or written
    c = list(counters) + [column] * (MAX_COUNTERS - len(counters))
    rows_m = [t.shape[0] if i < len(masks) else 0 for i, t in enumerate(m)]
    n_c = [t.shape[0] if i < len(counters) else 0 for i, t in enumerate(c)]
    most = max(rows_m + n_c + [1])
    vis = [1.0 if i < len(masks) and _visible(t) is True else 0.0 for i, t in enumerate(m)]
    _advance_masks_and_counters[(1,)](
        m[0], m[1], c[0], c[1], column,
        rows_m[0], rows_m[1], m[0].stride(0), m[0].stride(-1), m[1].stride(0), m[1].stride(-1),
        n_c[0], n_c[1], c[0].stride(0), c[1].stride(0), last_column,
        N_MASKS=len(masks), N_COUNTERS=len(counters), VISIBLE0=vis[0], VISIBLE1=vis[1],
        BLOCK=min(MAX_BLOCK, triton.next_power_of_2(most)), num_warps=4,
    )


__all__ = ["MAX_COUNTERS", "MAX_MASKS", "advance_inputs", "advance_inputs_reference", "kernel_takes"]
