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
def _pick(sel, values):
    """``values[i]`` where ``sel[:, i]`` (one hit a row at most; 0 for none): a gather in registers."""
    return tl.sum(tl.where(sel, values[None, :], 0), axis=1)


@triton.jit
def used_slots(chunk_slot_ptr, n_chunks, num_slots, U: tl.constexpr, BLOCK_C: tl.constexpr):
    """The plan's distinct slots, compacted in registers from one load of its chunk slots (sorted,
    so a slot's chunks are one run): ``(slot_u, has_u, n_used)``, ``U`` entries, the used first."""
    offs_c = tl.arange(0, BLOCK_C)
    cs = tl.load(chunk_slot_ptr + offs_c, mask=offs_c < n_chunks, other=-1)
    cs_prev = tl.load(chunk_slot_ptr + offs_c - 1, mask=(offs_c >= 1) & (offs_c < n_chunks), other=-1)
    first = (cs >= 0) & (cs < num_slots) & (cs != cs_prev)  # a slot's first chunk (stale slots skipped)
    pos = tl.cumsum(first.to(tl.int32), axis=0) - 1
    at_u = first[None, :] & (pos[None, :] == tl.arange(0, U)[:, None])  # (U, BLOCK_C)
    has_u = tl.sum(at_u.to(tl.int32), axis=1) > 0
    return tl.sum(tl.where(at_u, cs[None, :], 0), axis=1), has_u, tl.sum(first.to(tl.int32), axis=0)


@triton.jit
def module_tables(slot_u, has_u, j, b_offs_ptr, y_cols_ptr, stride_tl, ranks_ptr, stride_rl, scalings_ptr,
                  stride_sl, R, B_ALIGN: tl.constexpr, active=True):
    """Module ``j``'s (rank, B row stride, B offset, shrink column, scaling) of each used slot, as
    vectors; rank 0 where the slot does not target it, or everywhere unless ``active``."""
    has_u = tl.where(active, has_u, False)
    rank_u = tl.minimum(tl.load(ranks_ptr + slot_u * stride_rl + j, mask=has_u, other=0), R)
    on = has_u & (rank_u > 0)
    boff_u = tl.load(b_offs_ptr + slot_u * stride_tl + j, mask=on, other=0)
    ycol_u = tl.load(y_cols_ptr + slot_u * stride_tl + j, mask=on, other=0)
    scal_u = tl.load(scalings_ptr + slot_u * stride_sl + j, mask=on, other=0.0)
    return tl.where(on, rank_u, 0), packed_row_stride(tl.where(on, rank_u, 0), B_ALIGN), boff_u, ycol_u, scal_u


@triton.jit
def _bulk_prefetch(addr, size):
    return tl.inline_asm_elementwise(
        "{ cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_b(b_ptr, rank_u, brows_u, boff_u, n0, end, BLOCK_N: tl.constexpr):
    """Ask the L2 for each used slot's B rows of a module's columns ``[n0, min(end, n0 + BLOCK_N))``
    (one contiguous block of the packed layout), so that the epilogue's reads of them hit it. A
    hint: no registers held. Needs 16-byte aligned blocks (B_ALIGN 8 in 16-bit dtypes)."""
    esize: tl.constexpr = b_ptr.dtype.element_ty.primitive_bitwidth // 8
    cols = tl.maximum(tl.minimum(end - n0, BLOCK_N), 0)
    size = cols * brows_u * esize
    ok = (rank_u > 0) & (size >= 16)
    addr = b_ptr + tl.where(ok, boff_u + n0.to(tl.int64) * brows_u, 0)
    _bulk_prefetch(addr.to(tl.pointer_type(tl.int8)), tl.where(ok, size, 16))


@triton.jit
def row_tables(row_slot, slot_u, rank_u, ycol_u, scal_u):
    """Each row's used-slot index (-1: none, or a slot that leaves this module alone), rank, shrink
    column and scaling for one module."""
    mine = (row_slot[:, None] == slot_u[None, :]) & (rank_u[None, :] > 0)  # (BLOCK_M, U)
    offs_u = tl.arange(0, slot_u.shape[0])
    row_u = tl.where(tl.sum(mine.to(tl.int32), axis=1) > 0, _pick(mine, offs_u), -1)
    return row_u, _pick(mine, rank_u), _pick(mine, ycol_u), _pick(mine, scal_u)


@triton.jit
def slot_delta(acc, u, rows, y_ptr, stride_ym, offs_m, m_ok, b_ptr, brows_u, boff_u, cols, c_ok,
               RC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc`` plus used slot ``u``'s delta on its rows: ``rows`` = (row_u, row_rank, row_ycol,
    row_scaling) of ``row_tables``; one dot of (rows, RC) x (RC, cols), each row's shrink scaled by
    its slot's scaling, rows of other slots zero."""
    row_u, row_rank, row_ycol, row_scaling = rows
    offs_r = tl.arange(0, RC)
    s_ok = (row_u == u)[:, None] & (offs_r[None, :] < row_rank[:, None]) & m_ok[:, None]
    s = tl.load(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + row_ycol[:, None] + offs_r[None, :],
                mask=s_ok, other=0.0).to(tl.float32) * row_scaling[:, None]
    at = tl.arange(0, brows_u.shape[0]) == u
    b_rows = tl.sum(tl.where(at, brows_u, 0), axis=0)
    b_off = tl.sum(tl.where(at, boff_u, 0), axis=0)
    bt = tl.load(b_ptr + b_off + cols.to(tl.int64)[None, :] * b_rows + offs_r[:, None],
                 mask=(offs_r < b_rows)[:, None] & c_ok[None, :], other=0.0)
    if UPCAST:
        return tl.dot(s, bt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(s.to(y_ptr.dtype.element_ty), bt, acc)


@triton.jit
def lora_tile_delta(acc, offs_m, m_ok, cols, c_ok, j, active, slots, row_slot,
                    y_ptr, stride_ym, b_ptr, b_offs_ptr, y_cols_ptr, stride_tl, ranks_ptr, stride_rl,
                    scalings_ptr, stride_sl, R, RC: tl.constexpr, B_ALIGN: tl.constexpr, UPCAST: tl.constexpr):
    """``acc`` (BLOCK_M rows, the tile's columns; float32) plus every used slot's delta for module
    ``j``: ``cols`` are the module's own columns, ``c_ok`` those the tile has of it; ``slots`` is
    ``used_slots``', ``row_slot`` each row's slot. One dot a used slot (only the used ones run)."""
    slot_u, has_u, n_used = slots
    rank_u, brows_u, boff_u, ycol_u, scal_u = module_tables(slot_u, has_u, j, b_offs_ptr, y_cols_ptr, stride_tl,
                                                            ranks_ptr, stride_rl, scalings_ptr, stride_sl, R, B_ALIGN,
                                                            active)
    rows = row_tables(row_slot, slot_u, rank_u, ycol_u, scal_u)
    for u in tl.static_range(slot_u.shape[0]):  # no branch: the accumulator keeps its layout (masks do it)
        acc = slot_delta(acc, u, rows, y_ptr, stride_ym, offs_m, m_ok, b_ptr, brows_u, boff_u, cols, c_ok,
                         RC, UPCAST)
    return acc


@triton.jit
def lora_glu_deltas(acc, acc_up, offs_m, m_ok, cols, c_ok, slots, gate, up, row_slot, y_ptr, stride_ym, b_ptr,
                    RC: tl.constexpr, UPCAST: tl.constexpr):
    """``lora_tile_delta`` for a gated tile: gate's deltas into ``acc`` and up's into ``acc_up``, both
    modules' dots of a slot side by side (their loads in flight together); ``gate`` and ``up`` are
    their ``module_tables``."""
    slot_u, has_u, n_used = slots
    g_rows = row_tables(row_slot, slot_u, gate[0], gate[3], gate[4])
    u_rows = row_tables(row_slot, slot_u, up[0], up[3], up[4])
    for u in tl.static_range(slot_u.shape[0]):  # no branch: the accumulators keep their layout (masks do it)
        acc = slot_delta(acc, u, g_rows, y_ptr, stride_ym, offs_m, m_ok, b_ptr, gate[1], gate[2], cols, c_ok,
                         RC, UPCAST)
        acc_up = slot_delta(acc_up, u, u_rows, y_ptr, stride_ym, offs_m, m_ok, b_ptr, up[1], up[2], cols, c_ok,
                            RC, UPCAST)
    return acc, acc_up


def slots_bound(n_chunks: int, num_slots: int) -> int:
    """``U``: the used slots a launch can meet (at most one a chunk, at most every slot), a power of two."""
    return triton.next_power_of_2(max(1, min(n_chunks, num_slots)))


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
    tensors) and its constexprs ``(RC, B_ALIGN, U, BLOCK_C)``."""
    if lora is None:
        return (fallback,) * 8 + (0,) * 8 + (0, 0, 0, 0, 0), (16, 1, 1, 1)
    offs = tuple(lora.offsets) + (lora.offsets[-1],) * (MAX_MODULES + 1 - len(lora.offsets))
    return ((lora.y, lora.b, lora.b_offs, lora.y_cols, lora.ranks, lora.scalings, lora.token_slot, lora.chunk_slot,
             lora.y.stride(0), lora.y_cols.stride(0), lora.ranks.stride(0), lora.scalings.stride(0),
             lora.chunk_slot.shape[0], lora.ranks.shape[0], lora.max_rank, len(lora.offsets) - 1) + offs,
            (rank_class(lora.max_rank), lora.align, slots_bound(lora.chunk_slot.shape[0], lora.ranks.shape[0]),
             triton.next_power_of_2(max(1, lora.chunk_slot.shape[0]))))


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


__all__ = ["LoraEpilogue", "check_lora", "lora_args", "lora_delta_reference", "lora_glu_deltas", "lora_tile_delta",
           "module_tables", "prefetch_b", "rank_class", "slots_bound", "used_slots"]
