"""Weights pulled into L2 ahead of the GEMM that reads them (Hopper's bulk prefetch).

A decode step alternates weight-streaming GEMMs with small kernels (norms, the activation, rotary,
attention) during which the memory is nearly idle, and each GEMM then spends its first microseconds
waiting for its first tiles. A small kernel that runs before a GEMM can ask the memory system to
bring part of that GEMM's weight into L2 first: ``cp.async.bulk.prefetch.L2`` is a hint to the
copy engine, with no registers held, no result and nothing to wait for, so the small kernel
finishes as it would have, and the GEMM finds that part of its weight in L2.

The weights are never written during a step, so the prefetch may run before a kernel's
``pdl.wait()``. It changes no value anywhere: a prefetch that does not arrive in time, or is
evicted, only costs what it would have cost without it.

``L2Prefetch`` names the bytes: ``rows`` ranges of ``row_bytes`` bytes, ``stride`` bytes apart,
from ``tensor``'s first element (a weight's leading columns: one range per row; a leading part of
the tensor: ranges of one chunk). Kernels take it as four arguments and a ``PREFETCH`` flag
(``prefetch_args``) and call ``issue`` at their start. Only on CUDA devices of compute capability
9.0 or more, never under Triton's interpreter (``supported``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

ALIGN = 16  # bulk copies move multiples of 16 bytes from 16-byte aligned addresses
CHUNK = 1 << 14  # bytes per prefetch of a contiguous region
_capable: dict = {}


class L2Prefetch(NamedTuple):
    tensor: torch.Tensor  # keeps the memory alive while a kernel (or a graph) may read it
    rows: int
    stride: int  # bytes between the starts of two ranges
    row_bytes: int  # bytes per range, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def supported(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device can issue the bulk prefetch (CUDA, compute capability 9+)."""
    if not t.is_cuda:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def plan(weight: torch.Tensor, max_bytes: int, layout: str = "columns") -> Optional[L2Prefetch]:
    """The first ``max_bytes`` of a GEMM's ``(N, K)`` weight worth prefetching, or None.

    ``layout="columns"``: the leading columns of every row (every output block of the GEMM finds its
    first K tiles in L2); ``"rows"``: the leading rows, as one contiguous region in chunks.
    Strided or misaligned weights (rows not 16-byte aligned) get None.
    """
    if max_bytes <= 0 or weight.dim() != 2 or weight.stride(1) != 1 or not supported(weight):
        return None
    esize = weight.element_size()
    n, k = weight.shape
    row_stride = weight.stride(0) * esize
    if weight.data_ptr() % ALIGN or row_stride % ALIGN or n == 0 or k == 0:
        return None
    if layout == "columns":
        per_row = min(k * esize, max_bytes // n) // ALIGN * ALIGN
        return L2Prefetch(weight, n, row_stride, per_row) if per_row else None
    if layout == "rows":
        if row_stride != k * esize:  # rows with gaps: no contiguous region
            return None
        total = min(n * row_stride, max_bytes) // ALIGN * ALIGN
        chunks = triton.cdiv(total, CHUNK)
        return L2Prefetch(weight, chunks, CHUNK, CHUNK) if total >= CHUNK else None
    raise ValueError(f"unknown prefetch layout {layout!r}: 'columns' or 'rows'")


def prefetch_args(pf: Optional[L2Prefetch], fallback: torch.Tensor):
    """A kernel's four prefetch arguments and its ``PREFETCH`` flag (``fallback``: any tensor of the
    launch, passed as the pointer when there is nothing to prefetch)."""
    if pf is None:
        return (fallback, 0, 0, 0), False
    return (pf.tensor, pf.rows, pf.stride, pf.row_bytes), True


@triton.jit
def _bulk_prefetch(addr, size, pred):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, pred], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def issue(pf_ptr, pf_rows, pf_stride, pf_row_bytes, pid, nprog, PREFETCH: tl.constexpr,
          BLOCK: tl.constexpr = 128):
    """Program ``pid`` of ``nprog`` asks for its share of the ranges (a hint: nothing returns)."""
    if PREFETCH:
        base = pf_ptr.to(tl.pointer_type(tl.int8)).to(tl.int64)
        size = tl.full((BLOCK,), 0, tl.int32) + pf_row_bytes
        for start in range(pid * BLOCK, pf_rows, nprog * BLOCK):
            r = start + tl.arange(0, BLOCK)
            _bulk_prefetch(base + r.to(tl.int64) * pf_stride, size, (r < pf_rows).to(tl.int32))


@triton.jit
def _l2_prefetch_kernel(pf_ptr, pf_rows, pf_stride, pf_row_bytes, BLOCK: tl.constexpr):
    issue(pf_ptr, pf_rows, pf_stride, pf_row_bytes, tl.program_id(0), tl.num_programs(0), True, BLOCK)


def l2_prefetch(pf: Optional[L2Prefetch], programs: int = 8) -> None:
    """The prefetch as a launch of its own (probes; kernels issue it inside their own launch)."""
    if pf is None or pf.rows == 0:
        return
    programs = max(1, min(programs, triton.cdiv(pf.rows, 32)))
    _l2_prefetch_kernel[(programs,)](pf.tensor, pf.rows, pf.stride, pf.row_bytes, BLOCK=32, num_warps=1)
