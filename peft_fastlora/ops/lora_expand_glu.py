"""The expand of a LoRA gate/up site and the gated activation after it, in one launch:
``out[t] = act(gate[t] + dg[t]) * (up[t] + du[t])``, where ``gate`` and ``up`` are the two halves
of the base GEMM's output (``full[:, :n]`` and ``full[:, n:2n]``) and ``dg``, ``du`` the batch's
LoRA deltas (``scaling * y @ B.T`` of the row's adapter, as ``lora_expand`` adds them).

``lora_expand`` followed by ``act_mul`` writes the gate/up output back with the deltas added and
reads it again for the activation: at decode sizes that is a round trip of the widest output of
the layer and one launch more. Here a program reads its rows' gate and up tiles once, adds both
deltas and writes only the half-width product.

Every row of ``out`` is written. Rows with an adapter are grouped by the chunk plan
(``batch.plan_chunks``); rows with none are in no chunk, so the grid has one program more per
``BLOCK_M`` rows of the input, which takes the rows whose ``token_slot`` is negative and writes
their plain ``act(gate) * up``. A chunk of a stale plan (a slot past the tables) gets no delta,
as in the expand, but its product.

Numerics follow the two kernels it replaces: the delta is added to the base value in float32 and
rounded to the dtype (``lora_expand``), then ``act_mul_rounded`` (``silu_mul``). B comes packed
(``backend.packed``), y as the shrink gives it (``(s, 2 * R)``) or, with ``y_cols``, as a folded
base GEMM gives it (every row of the A arena). PDL as the expand's: the plan (``token_slot`` with
it), the tables and the first rank block of B before the wait; y and the base output after it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..kernel_support import interpreting
from . import pdl
from .expand_common import chunk_rank, expand_operands
from .silu_mul import ACTIVATIONS, act_mul_rounded

# a program of rows with no adapter covers this many row tiles, skipping those with none (a batch
# all on adapters then launches few idle programs)
BASE_TILES = 4


@triton.jit
def _b_first(y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr,
             chunk, slot, j, rank, n_rows, R, offs_n, n_mask, stride_ys, stride_yr, stride_sl, stride_tl,
             B_ALIGN: tl.constexpr, Y_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Module ``j``'s operands for a chunk (``expand_operands``) and the first rank block of its B
    columns ``offs_n``, transposed (BLOCK_R, BLOCK_N): what a program reads before its wait."""
    scaling, row_mask, tok, y_row, b_rows, b_nstride, b_rstride, b_rank = expand_operands(
        y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr,
        chunk, slot, j, 0, rank, n_rows, R, stride_ys, stride_yr, 0, 0, 0, stride_sl,
        stride_tl, True, B_ALIGN, Y_COLS, BLOCK_M)
    b_base = b_rows + offs_n[None, :] * b_nstride
    offs_r = tl.arange(0, BLOCK_R)
    bt = tl.load(b_base + offs_r[:, None] * b_rstride, mask=(offs_r < b_rank)[:, None] & n_mask[None, :], other=0.0)
    return scaling, row_mask, tok, y_row, b_base, b_rstride, b_rank, bt


@triton.jit
def _y_first(y_row, stride_yr, row_mask, rank, BLOCK_R: tl.constexpr):
    """The chunk's rows of y, first rank block (BLOCK_M, BLOCK_R): after the wait."""
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(y_row + offs_r[None, :] * stride_yr, mask=row_mask[:, None] & (offs_r < rank)[None, :], other=0.0)


@triton.jit
def _delta(yt, bt, y_row, stride_yr, row_mask, b_base, b_rstride, b_rank, rank, scaling, n_mask,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``scaling * y @ B.T`` for the chunk's rows and the block's columns, (BLOCK_M, BLOCK_N) float32
    (zeros at rank 0), from the first rank blocks ``yt`` and ``bt`` on (after the wait)."""
    acc = tl.dot(yt, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), input_precision=DOT_PRECISION)
    for r0 in range(BLOCK_R, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        yt = tl.load(y_row + offs_r[None, :] * stride_yr, mask=row_mask[:, None] & (offs_r < rank)[None, :],
                     other=0.0)
        bt = tl.load(b_base + offs_r[:, None] * b_rstride, mask=(offs_r < b_rank)[:, None] & n_mask[None, :],
                     other=0.0)
        acc = tl.dot(yt, bt, acc, input_precision=DOT_PRECISION)
    return acc * scaling


@triton.jit
def _lora_expand_glu_kernel(
    y_ptr, b_ptr, full_ptr, out_ptr, b_offs_ptr, y_cols_ptr,
    R,  # the largest rank (y's columns per module without y_cols)
    num_slots, N, n_tokens, max_chunks,
    stride_ys, stride_yr, stride_fs, stride_os,
    ranks_ptr, stride_rl, scalings_ptr, stride_sl, stride_tl,
    token_slot_ptr, sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    B_ALIGN: tl.constexpr,
    Y_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BASE_TILES: tl.constexpr,  # row tiles a program of rows with no adapter covers
    GELU_TANH: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py
):
    pdl.launch_dependents(USE_PDL)
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dt = out_ptr.dtype.element_ty
    if p < max_chunks:  # a chunk of adapter rows (idle where unused)
        slot, n_rows, rank_g = chunk_rank(chunk_slot_ptr, chunk_len_ptr, ranks_ptr, stride_rl, p, 0, num_slots, R,
                                          True)
        slot_u, rows_u, rank_u = chunk_rank(chunk_slot_ptr, chunk_len_ptr, ranks_ptr, stride_rl, p, 1, num_slots, R, True)
        if (slot < 0) | (n_rows <= 0):
            pdl.wait(USE_PDL)
        else:
            slot = tl.where(slot < num_slots, slot, 0)  # a stale plan: ranks 0, tables read in bounds
            s_g, row_mask, tok, y_g, b_g, rs_g, br_g, bt_g = _b_first(
                y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr, p, slot, 0,
                rank_g, n_rows, R, offs_n, n_mask, stride_ys, stride_yr, stride_sl, stride_tl,
                B_ALIGN, Y_COLS, BLOCK_M, BLOCK_R)
            s_u, rm_u, tok_u, y_u, b_u, rs_u, br_u, bt_u = _b_first(
                y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr, p, slot, 1,
                rank_u, n_rows, R, offs_n, n_mask, stride_ys, stride_yr, stride_sl, stride_tl,
                B_ALIGN, Y_COLS, BLOCK_M, BLOCK_R)
            pdl.wait(USE_PDL)
            # every load the product needs in flight at once, then the arithmetic
            yt_g = _y_first(y_g, stride_yr, row_mask, rank_g, BLOCK_R)
            yt_u = _y_first(y_u, stride_yr, row_mask, rank_u, BLOCK_R)
            mask = row_mask[:, None] & n_mask[None, :]
            g_ptrs = full_ptr + tok[:, None] * stride_fs + offs_n[None, :]
            g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
            dg = _delta(yt_g, bt_g, y_g, stride_yr, row_mask, b_g, rs_g, br_g, rank_g, s_g, n_mask,
                        BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
            du = _delta(yt_u, bt_u, y_u, stride_yr, row_mask, b_u, rs_u, br_u, rank_u, s_u, n_mask,
                        BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
            g = (g + dg).to(dt).to(tl.float32)  # the expand's rounding
            u = (u + du).to(dt).to(tl.float32)
            h = act_mul_rounded(g, u, dt, GELU_TANH, LIBDEVICE)
            tl.store(out_ptr + tok[:, None] * stride_os + offs_n[None, :], h.to(dt), mask=mask)
    else:  # BASE_TILES row tiles of the input: the rows with no adapter, tiles with none skipped
        pdl.wait(USE_PDL)
        for t in range(BASE_TILES):
            rows = ((p - max_chunks) * BASE_TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
            in_range = rows < n_tokens
            row_mask = in_range & (tl.load(token_slot_ptr + rows, mask=in_range, other=0) < 0)
            if tl.sum(row_mask.to(tl.int32), axis=0) > 0:
                rows64 = rows.to(tl.int64)
                mask = row_mask[:, None] & n_mask[None, :]
                g_ptrs = full_ptr + rows64[:, None] * stride_fs + offs_n[None, :]
                g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
                u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
                h = act_mul_rounded(g, u, dt, GELU_TANH, LIBDEVICE)
                tl.store(out_ptr + rows64[:, None] * stride_os + offs_n[None, :], h.to(dt), mask=mask)


def expand_glu_config(block_m: int, max_rank: int) -> dict:
    """Column tile, rank block and warps (no autotuning: graphs need a fixed launch): decode row
    tiles read 128 columns of each half, wider row tiles 64."""
    return dict(block_n=128 if block_m <= 16 else 64, block_r=min(64, max(16, triton.next_power_of_2(max_rank))),
                num_warps=4 if block_m <= 16 else 8)


def lora_expand_glu(
    y: torch.Tensor,
    weights: torch.Tensor,
    offsets: Sequence[int],
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    full: torch.Tensor,
    token_slot: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    *,
    block_m: int,
    act: str,
    b_offs: torch.Tensor,
    max_rank: int,
    b_align: int = 1,
    y_cols: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    check: bool = True,
) -> torch.Tensor:
    """``act(gate + delta_gate) * (up + delta_up)`` of a gate/up LoRA site (module doc).

    Args:
        y: the shrink, (s, 2 * max_rank); with ``y_cols``, (s, rows of the A arena).
        weights: the packed B arena (flat); ``b_offs`` (num_slots, 2) int64, ``b_align`` 8 or 1,
            ``y_cols`` (num_slots, 2) int32 as ``lora_expand``'s.
        offsets: (0, n, 2n): gate's columns, then up's.
        ranks, scalings: (>= num_slots, 2) int32 / float32, unit column stride.
        full: (s, >= 2n), the base GEMM's output, gate then up; read only.
        token_slot: (>= s,) int32, each row's slot, negative for none; with the chunk plan
            (sorted_token_ids, chunk_slot, chunk_start, chunk_len) of the same batch.
        block_m: the plan's row tile. act: one of ``silu_mul.ACTIVATIONS``.
        out: (s, n) to write, unit column stride (a new tensor when None); must not overlap ``full``.
        block_n, num_warps: override ``expand_glu_config``. check: validate the shapes.
    Returns:
        ``out``.
    """
    offsets = [int(o) for o in offsets]
    s = full.shape[0]
    n = offsets[1] if len(offsets) == 3 else -1
    if check:
        if act not in ACTIVATIONS:
            raise ValueError(f"lora_expand_glu: unknown gated activation {act!r}; the kernel takes {ACTIVATIONS}")
        if len(offsets) != 3 or offsets[0] != 0 or offsets[2] != 2 * n or n <= 0:
            raise ValueError(f"lora_expand_glu: offsets must be (0, n, 2n) for gate and up, got {offsets}")
        if full.dim() != 2 or full.shape[1] < 2 * n or full.stride(1) != 1:
            raise ValueError(f"lora_expand_glu: full {tuple(full.shape)} must be (s, >= {2 * n}) with unit column stride")
        if y.dim() != 2 or y.shape[0] != s or y.stride(1) != 1 or y.dtype != full.dtype or weights.dtype != full.dtype:
            raise ValueError(f"lora_expand_glu: y {tuple(y.shape)} {y.dtype} and B {weights.dtype} must be "
                             f"({s}, ...) {full.dtype} with unit column stride")
        if y_cols is None and y.shape[1] != 2 * max_rank:
            raise ValueError(f"lora_expand_glu: y has {y.shape[1]} columns, expected 2 x rank {max_rank}")
        if weights.dim() != 1 or b_offs.dim() != 2 or b_offs.shape[1] != 2 or b_offs.stride(1) != 1 \
                or b_offs.dtype != torch.int64:
            raise ValueError("lora_expand_glu: B must be a flat packed arena with an int64 (num_slots, 2) offset table")
        if y_cols is not None and (y_cols.shape != b_offs.shape or y_cols.stride() != b_offs.stride()
                                   or y_cols.dtype != torch.int32):
            raise ValueError("lora_expand_glu: y_cols must be an int32 (num_slots, 2) table with b_offs' strides")
        for name, t in (("ranks", ranks), ("scalings", scalings)):
            if t.dim() != 2 or t.shape[1] != 2 or t.stride(1) != 1:
                raise ValueError(f"lora_expand_glu: {name} must be (num_slots, 2) with unit column stride")
        if token_slot.dim() != 1 or token_slot.shape[0] < s:
            raise ValueError(f"lora_expand_glu: token_slot holds {token_slot.shape[0]} rows, the input {s}")
    if out is None:
        out = torch.empty(s, n, dtype=full.dtype, device=full.device)
    elif check and (tuple(out.shape) != (s, n) or out.stride(1) != 1 or out.dtype != full.dtype):
        raise ValueError(f"lora_expand_glu: out {tuple(out.shape)} {out.dtype} must be ({s}, {n}) {full.dtype} "
                         "with unit column stride")
    max_chunks = chunk_slot.shape[0]
    if s == 0:
        return out
    cfg = expand_glu_config(block_m, max_rank)
    bn = block_n or cfg["block_n"]
    use_pdl = pdl.mode(out, preamble=True)
    grid = (max_chunks + triton.cdiv(s, block_m * BASE_TILES), triton.cdiv(n, bn))
    _lora_expand_glu_kernel[grid](
        y, weights, full, out, b_offs, y_cols if y_cols is not None else ranks,
        max(1, int(max_rank)), b_offs.shape[0], n, s, max_chunks,
        y.stride(0), y.stride(1), full.stride(0), out.stride(0),
        ranks, ranks.stride(0), scalings, scalings.stride(0), b_offs.stride(0),
        token_slot, sorted_token_ids, chunk_slot, chunk_start, chunk_len,
        B_ALIGN=b_align,
        Y_COLS=y_cols is not None,
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_R=cfg["block_r"],
        BASE_TILES=BASE_TILES,
        GELU_TANH=act == "gelu_tanh",
        LIBDEVICE=not interpreting(),
        DOT_PRECISION="ieee" if full.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl,
        num_warps=num_warps or cfg["num_warps"],
        launch_pdl=use_pdl > 0,
    )
    return out
