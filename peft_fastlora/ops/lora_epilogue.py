"""The LoRA expand as a base GEMM's epilogue: every row's adapter delta added to the GEMM's float32
tile before its one rounding, from a shrink computed before the GEMM.

A folded site's GEMM gives the base output and the shrink together (``x @ [W; A].T``), so the expand
must be a launch of its own after it, reading and writing the whole output again. With the shrink
done first (``y = x @ A.T`` over the packed A arena: a small GEMM), a GEMM that owns all the rows
of a column tile can add the deltas itself: for each slot the batch uses (walked from the plan's
chunk slots, which are sorted, so each slot is met in one run of chunks),

    tile[rows of the slot, cols] += scaling * y[rows, a_rows[slot, j] : + rank] @ B[slot, j][cols].T

one ``tl.dot`` of (rows, rank class) x (rank class, cols) per slot, the rows of other slots masked
to zero. Rows with no adapter (slot -1) get nothing. ``B`` is the packed layout
(``backend.packed``): module j of slot s is the (width_j, rank) block at ``b_offs[s, j]``, rows
``packed_row_stride(rank)`` apart. A module's columns are the tile's columns minus its offset.

Everything read here is written before the GEMM by kernels that complete before it (the shrink's
GEMM, the plan's copy), and the helper runs after the GEMM's PDL wait.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .expand_common import packed_row_stride


class LoraEpilogue(NamedTuple):
    """What a GEMM's LoRA epilogue reads (module docstring).

    y: (M, rows of the A arena), the shrink, unit column stride, the GEMM's dtype.
    b: the packed B arena (flat). b_offs: (num_slots, c) int64; y_cols: (num_slots, c) int32, the
        first arena row (so column of ``y``) of each (slot, module); the same row stride.
    ranks: (num_slots, c) int32; scalings: (num_slots, c) float32.
    token_slot: (>= M,) int32, each row's slot (-1: none).
    chunk_slot: (chunks,) int32, the plan's chunk slots, ascending, -1 past the used ones.
    offsets: the c + 1 output column offsets of the modules.
    max_rank: R, the largest rank a table may hold (ranks past it are cut to it).
    align: 8 or 1, the packed blocks' alignment (``backend.packed``).
    """

    y: torch.Tensor
    b: torch.Tensor
    b_offs: torch.Tensor
    y_cols: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    token_slot: torch.Tensor
    chunk_slot: torch.Tensor
    offsets: Tuple[int, ...]
    max_rank: int
    align: int = 1


MAX_MODULES = 4  # the modules one launch covers (q/k/v: 3; gate/up: 2)


@triton.jit
def lora_tile_delta(acc, offs_m, m_ok, cols, c_ok, j,
                    y_ptr, stride_ym, b_ptr, b_offs_ptr, y_cols_ptr, stride_tl, ranks_ptr, stride_rl,
                    scalings_ptr, stride_sl, token_slot_ptr, chunk_slot_ptr, n_chunks, num_slots, R,
                    RC: tl.constexpr, B_ALIGN: tl.constexpr, UPCAST: tl.constexpr):
    """``acc`` (BLOCK_M rows, the tile's columns; float32) plus every used slot's delta for module
    ``j``: ``cols`` are the module's own columns, ``c_ok`` those the tile has of it."""
    offs_r = tl.arange(0, RC)
    row_slot = tl.load(token_slot_ptr + offs_m, mask=m_ok, other=-1)
    prev = tl.full([], -1, tl.int32)
    for c in range(n_chunks):
        slot = tl.load(chunk_slot_ptr + c)
        first = (slot >= 0) & (slot < num_slots) & (slot != prev)  # a slot's first chunk
        rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + j, mask=first, other=0), R)
        if rank > 0:
            scaling = tl.load(scalings_ptr + slot * stride_sl + j)
            y_col = tl.load(y_cols_ptr + slot * stride_tl + j)
            b_off = tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + j), B_ALIGN)
            b_rows = packed_row_stride(rank, B_ALIGN)
            rows = m_ok & (row_slot == slot)
            s = tl.load(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + (y_col + offs_r)[None, :],
                        mask=rows[:, None] & (offs_r < rank)[None, :], other=0.0)
            bt = tl.load(b_ptr + b_off + cols.to(tl.int64)[None, :] * b_rows + offs_r[:, None],
                         mask=(offs_r < b_rows)[:, None] & c_ok[None, :], other=0.0)
            if UPCAST:
                d = tl.dot(s.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(s, bt)
            acc += d * scaling
        prev = slot
    return acc


def rank_class(max_rank: int) -> int:
    """The rank columns of a slot's dot: the largest rank rounded up to a power of two, at least 16
    (the smallest ``tl.dot`` K)."""
    return max(16, triton.next_power_of_2(max(1, max_rank)))


def check_lora(lora: LoraEpilogue, m: int, n: int, x: torch.Tensor, glu: bool) -> None:
    """The epilogue's operands against a GEMM of ``m`` rows and ``n`` output columns (per half with
    ``glu``: the launch's modules are then gate's and up's, each ``n`` wide)."""
    c = len(lora.offsets) - 1
    if not 1 <= c <= MAX_MODULES or lora.offsets[0] != 0 or any(b < a for a, b in zip(lora.offsets, lora.offsets[1:])):
        raise ValueError(f"lora offsets {lora.offsets}: 1 to {MAX_MODULES} modules from column 0")
    if glu and (c != 2 or lora.offsets[1] != n or lora.offsets[2] != 2 * n):
        raise ValueError(f"lora with glu needs two modules of {n} columns (gate's, up's), got offsets {lora.offsets}")
    if not glu and lora.offsets[-1] != n:
        raise ValueError(f"lora offsets {lora.offsets} do not cover the {n} output columns")
    if lora.y.dim() != 2 or lora.y.shape[0] != m or lora.y.stride(1) != 1 or lora.y.dtype != x.dtype:
        raise ValueError(f"lora y {tuple(lora.y.shape)} {lora.y.dtype}: expected ({m}, arena rows) {x.dtype}, "
                         "unit column stride")
    if lora.b.dtype != x.dtype:
        raise ValueError(f"lora b is {lora.b.dtype}, the GEMM {x.dtype}")
    slots = lora.ranks.shape[0] if lora.ranks.dim() == 2 else -1
    for name, t, dtype in (("ranks", lora.ranks, torch.int32), ("scalings", lora.scalings, torch.float32),
                           ("y_cols", lora.y_cols, torch.int32), ("b_offs", lora.b_offs, torch.int64)):
        if t.dim() != 2 or t.shape != (slots, c) or t.dtype != dtype or t.stride(1) != 1:
            raise ValueError(f"lora {name} {tuple(t.shape)} {t.dtype}: expected ({slots}, {c}) {dtype}, "
                             "unit stride on the modules")
    if lora.b_offs.stride(0) != lora.y_cols.stride(0):
        raise ValueError("lora b_offs and y_cols must share their row stride (one table buffer)")
    if lora.token_slot.dim() != 1 or lora.token_slot.shape[0] < m or lora.token_slot.dtype != torch.int32:
        raise ValueError(f"lora token_slot {tuple(lora.token_slot.shape)}: expected at least {m} int32 entries")
    if lora.chunk_slot.dim() != 1 or lora.chunk_slot.dtype != torch.int32:
        raise ValueError("lora chunk_slot must be a 1-D int32 tensor")
    if lora.align not in (1, 8) or lora.max_rank < 1:
        raise ValueError(f"lora align {lora.align} (1 or 8) and max_rank {lora.max_rank} (>= 1)")
    tensors = (lora.y, lora.b, lora.b_offs, lora.y_cols, lora.ranks, lora.scalings, lora.token_slot, lora.chunk_slot)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"lora tensors must be on {x.device}")


def lora_args(lora: Optional[LoraEpilogue], fallback: torch.Tensor) -> tuple:
    """The kernels' LoRA arguments (pointers, strides, counts; ``fallback`` stands for absent
    tensors) and its constexprs ``(RC, B_ALIGN)``."""
    if lora is None:
        return (fallback,) * 8 + (0,) * 8 + (0, 0, 0, 0, 0), (16, 1)
    offs = tuple(lora.offsets) + (lora.offsets[-1],) * (MAX_MODULES + 1 - len(lora.offsets))
    return ((lora.y, lora.b, lora.b_offs, lora.y_cols, lora.ranks, lora.scalings, lora.token_slot, lora.chunk_slot,
             lora.y.stride(0), lora.y_cols.stride(0), lora.ranks.stride(0), lora.scalings.stride(0),
             lora.chunk_slot.shape[0], lora.ranks.shape[0], lora.max_rank, len(lora.offsets) - 1) + offs,
            (rank_class(lora.max_rank), lora.align))


def lora_delta_reference(lora: LoraEpilogue, m: int) -> torch.Tensor:
    """float32 (m, offsets[-1]) deltas from the same tables, in plain torch (the tests' reference)."""
    out = torch.zeros(m, lora.offsets[-1], dtype=torch.float32, device=lora.y.device)
    seen = set()
    for slot in lora.chunk_slot.tolist():
        if slot < 0 or slot >= lora.ranks.shape[0] or slot in seen:
            continue
        seen.add(slot)
        rows = (lora.token_slot[:m] == slot).nonzero().flatten()
        for j, (lo, hi) in enumerate(zip(lora.offsets[:-1], lora.offsets[1:])):
            rank = min(int(lora.ranks[slot, j]), lora.max_rank)
            if rank <= 0 or rows.numel() == 0:
                continue
            stride = -(-rank // lora.align) * lora.align
            off, col = int(lora.b_offs[slot, j]), int(lora.y_cols[slot, j])
            bmat = lora.b[off: off + (hi - lo) * stride].view(hi - lo, stride)[:, :rank].float()
            s = lora.y[rows, col: col + rank].float()
            out[rows, lo:hi] += float(lora.scalings[slot, j]) * (s @ bmat.T)
    return out


__all__ = ["LoraEpilogue", "check_lora", "lora_args", "lora_delta_reference", "lora_tile_delta", "rank_class"]
