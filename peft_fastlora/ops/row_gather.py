"""Row gather whose row list lives on the device: ``dst[i] = src[table[1 + i]]`` for
``i < table[0]``, in one launch.

A CUDA graph that captured the launch copies, at each replay, as many rows as the table says at
that moment, and none when it says 0: the continuous-batching engine's sampler keeps the logits of
the few rows it selects again (requests with sampling parameters) without copying the whole step's
logits at every step.
"""

from __future__ import annotations

import torch

from ..kernel_support import kernel_runs_on, tl, triton

GATHER_BLOCK = 1024  # columns a program moves per row


@triton.jit
def _gather_rows_kernel(src_ptr, table_ptr, dst_ptr, n_src_rows, max_count, n_cols, src_stride, dst_stride,
                        BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    count = tl.minimum(tl.load(table_ptr), max_count)  # never past dst's rows nor the table's entries
    dst_row = dst_ptr + cols  # advanced a row at a time (64-bit pointers: no index overflow)
    for i in range(count):
        row = tl.load(table_ptr + 1 + i).to(tl.int64) + tl.zeros([BLOCK], dtype=tl.int64)
        mask = in_row & (row >= 0) & (row < n_src_rows)  # a stale table never reads past ``src``
        values = tl.load(src_ptr + row * src_stride + cols, mask=mask, other=0.0)
        tl.store(dst_row, values, mask=in_row)
        dst_row += dst_stride


def gather_rows(src: torch.Tensor, table: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy rows of the 2-D ``src`` into the first rows of ``dst`` (same columns and dtype), as the
    int32 ``table`` on ``src``'s device lists them: ``[count, row_0, row_1, ...]``. A count past
    ``dst``'s rows or the table's entries copies only as many as both hold, and a listed row outside
    ``src`` gives zeros: a wrong table never reads or writes out of bounds."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"gather_rows: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                         "must be 2-D with the same columns and dtype")
    if table.dtype != torch.int32 or table.dim() != 1 or table.numel() < 1 or table.device != src.device:
        raise ValueError(f"gather_rows: the table must be a 1-D int32 tensor on {src.device}, got "
                         f"{tuple(table.shape)} {table.dtype} on {table.device}")
    if src.stride(1) != 1:
        src = src.contiguous()
    max_count = min(dst.shape[0], table.numel() - 1)
    if kernel_runs_on(src, table, dst) and dst.stride(1) == 1:
        grid = (triton.cdiv(src.shape[1], GATHER_BLOCK),)
        _gather_rows_kernel[grid](src, table, dst, src.shape[0], max_count, src.shape[1], src.stride(0),
                                  dst.stride(0), BLOCK=GATHER_BLOCK, num_warps=4)
        return
    # without Triton (the reference): the same rows, read on the host
    count = max(0, min(int(table[0]), max_count))
    rows = table[1: 1 + count].long()
    inside = (rows >= 0) & (rows < src.shape[0])
    dst[:count] = torch.where(inside[:, None], src[rows.clamp(0, max(0, src.shape[0] - 1))], 0)
