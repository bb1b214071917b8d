"""Segmented LoRA expand, added in place:
``out[t, lo_j:hi_j] += scaling[slot, j] * (y[t, j*R : j*R + rank] @ B[slot, lo_j:hi_j, :rank].T (+ bias[slot, lo_j:hi_j]))``.

One program owns one (chunk, column block, module): it reads the chunk's rows of ``y`` and of
``out`` once, adds the delta in float32 and stores once, so the base output takes one read and
one write and no extra pass. Row tiles of up to 16 (decode) take ``lora_expand_wide``'s launch by
default: column spans sized by each program's rank, not by the launch's largest. Only the first ``rank(slot, j)`` columns of ``y`` and of ``B`` are
read: the shrink leaves the rest of ``y`` undefined and padded ranks may hold anything.

B comes padded, ``(num_slots, N_total, R)`` (the contract's), or *packed*: a flat arena with a
``(num_slots, c)`` table of element offsets, (slot, module j) stored as ``(width_j, rank)``
(``backend.packed``), so each adapter takes its own rank and only the modules it targets.

With ``y_cols`` (packed only), ``y`` holds the shrink of *every* row of the packed A arena, as the
base GEMM gives it when A's arena is stored under the base weight (``x @ [W; A].T``): module j of
a slot reads ``y[t, y_cols[slot, j] : y_cols[slot, j] + rank]`` (its A rows), not ``j * R``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..kernel_support import tl, triton
from . import pdl
from .lora_expand_wide import WIDE_MAX_BLOCK_M, WIDE_MAX_RANK, launch_wide
from .expand_common import (add_bias, check_column_table, check_dora, chunk_rank, dora_epilogue, expand_operands,
                            module_span)

MAX_MODULES_PER_LAUNCH = 4  # column offsets travel as scalar arguments (no device table to build)


@triton.jit
def _lora_expand_kernel(
    # pointers
    y_ptr,  # (s, c * R)
    b_ptr,  # padded: (num_slots, N_total, R); packed: flat arena
    out_ptr,  # (s, N_total), any row stride
    b_offs_ptr,  # packed: (>= num_slots, c) int64 element offset of each (slot, module)
    y_cols_ptr,  # Y_COLS: (>= num_slots, c) int32 first column of y of each (slot, module)
    bias_ptr,  # HAS_BIAS: (>= num_slots, N_total) the adapters' B bias, added before the scaling
    stride_biasl,
    scale_ptr, shift_ptr,  # HAS_DORA: (>= num_slots, N_total) each slot's DoRA column scale and shift
    stride_dl,
    # dimensions
    R,  # padded rank of one module in y and B
    num_slots,
    J0,  # first module of this launch (launches cover at most 4 modules)
    OFF0, OFF1, OFF2, OFF3, OFF4,  # column offsets of this launch's modules; unused ones repeat the end
    # strides
    stride_ys, stride_yr,
    stride_bl, stride_bn, stride_br,
    stride_os, stride_on,
    # batch info
    ranks_ptr, stride_rl,  # (>= num_slots, c) int32, unit column stride
    scalings_ptr, stride_sl,  # (>= num_slots, c) float32, unit column stride
    stride_tl,  # row stride of the packed offset table (and of y_cols)
    sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    # meta-parameters
    PACKED: tl.constexpr,
    B_ALIGN: tl.constexpr,  # packed: every B offset and rank is a multiple of this (1 or 8)
    Y_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DORA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py: the plan, the tables and B are read before the wait
):
    pdl.launch_dependents(USE_PDL)
    chunk = tl.program_id(0)
    nb = tl.program_id(1)
    jl = tl.program_id(2)
    j = J0 + jl
    lo, hi = module_span(jl, OFF0, OFF1, OFF2, OFF3, OFF4)
    n0 = nb * BLOCK_N
    # idle programs (rank 0): no adapter, a stale plan, no rows, or past this module's width (the
    # grid is sized for the widest); each still waits (pdl.py)
    slot, n_rows, rank = chunk_rank(chunk_slot_ptr, chunk_len_ptr, ranks_ptr, stride_rl, chunk, j, num_slots, R,
                                    n0 < hi - lo)
    if rank <= 0:
        pdl.wait(USE_PDL)
        return
    scaling, row_mask, tok, y_row, b_rows, b_nstride, b_rstride, b_rank = expand_operands(
        y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr,
        chunk, slot, j, lo, rank, n_rows, R, stride_ys, stride_yr, stride_bl, stride_bn, stride_br, stride_sl,
        stride_tl, PACKED, B_ALIGN, Y_COLS, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi - lo
    cols = lo + offs_n
    b_base = b_rows + offs_n[None, :] * b_nstride
    # the first rank block of B (transposed, (BLOCK_R, BLOCK_N)) before the wait: the usual
    # decode ranks fit in one; B's rows masked by b_rank, the same rows in a form that loads 16
    # bytes at a time
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    bt = tl.load(b_base + offs_r[:, None] * b_rstride, mask=(offs_r < b_rank)[:, None] & n_mask[None, :], other=0.0)
    pdl.wait(USE_PDL)
    yt = tl.load(y_row + offs_r[None, :] * stride_yr, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    acc = tl.dot(yt, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), input_precision=DOT_PRECISION)
    for r0 in range(BLOCK_R, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        yt = tl.load(y_row + offs_r[None, :] * stride_yr,
                     mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        bt = tl.load(b_base + offs_r[:, None] * b_rstride,
                     mask=(offs_r < b_rank)[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(yt, bt, acc, input_precision=DOT_PRECISION)
    acc = add_bias(acc, bias_ptr + slot.to(tl.int64) * stride_biasl, cols, n_mask, HAS_BIAS)

    out_ptrs = out_ptr + tok[:, None] * stride_os + cols[None, :] * stride_on
    mask = row_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    res = dora_epilogue(base + acc * scaling, scale_ptr + slot.to(tl.int64) * stride_dl,
                        shift_ptr + slot.to(tl.int64) * stride_dl, cols, n_mask, HAS_DORA)
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)


def expand_config(block_m: int, rank: int, max_width: int) -> dict:
    """Launch parameters for Hopper, by shape class (no autotuning: graphs need a fixed launch).

    Every size is memory bound on the output rows it reads and writes (and, at decode, on B):
    column blocks wide enough that each program moves a few KB, narrow enough to keep every SM
    busy. Four warps up to 64-row tiles: the prefill tiles (64 rows) stream faster with four than
    with eight (``benchmarks/sweep_expand.py``); eight only past them.
    """
    r_pow2 = max(16, triton.next_power_of_2(rank))
    cfg = dict(block_n=128 if block_m > 16 or rank <= 32 else 64, block_r=min(r_pow2, 64),
               num_warps=4 if block_m <= 64 else 8, num_stages=2)
    cfg["block_n"] = min(cfg["block_n"], max(16, triton.next_power_of_2(max_width)))
    return cfg


def lora_expand(
    y: torch.Tensor,
    weights: torch.Tensor,
    offsets: Sequence[int],
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    *,
    block_m: int,
    block_n: Optional[int] = None,
    block_r: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    check: bool = True,
    b_offs: Optional[torch.Tensor] = None,
    b_align: int = 1,
    y_cols: Optional[torch.Tensor] = None,
    max_rank: Optional[int] = None,
    wide: Optional[bool] = None,
    bias: Optional[torch.Tensor] = None,
    dora: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Stacked, segmented expand into ``out`` (in place).

    Args:
        y: (s, c * R), the shrink's output.
        weights: padded (num_slots, N_total, R), same dtype as ``y``; or, with ``b_offs``, a packed
            flat arena.
        offsets: c + 1 host ints; module j writes columns ``offsets[j]:offsets[j+1]`` of ``out``
            and reads rows ``offsets[j]:offsets[j+1]`` of ``weights``.
        ranks: (>= num_slots, c) int32; scalings: (>= num_slots, c) float32.
        out: (s, N_total), unit column stride; rows of tokens in no chunk are not touched.
        sorted_token_ids, chunk_slot, chunk_start, chunk_len: the chunk plan (int32).
        block_m: rows per chunk.
        block_n, block_r, num_warps, num_stages: override ``expand_config``.
        check: validate the shapes (False: the caller has).
        b_offs: packed layout: (num_slots, c) int64, where (slot, j)'s ``(width_j, rank)`` block
            starts in ``weights`` (read only where its rank is not 0); ``b_align``: 8 where
            every offset and rank is a multiple of 8 (16-byte loads), else 1.
        y_cols: packed only: (num_slots, c) int32 with ``b_offs``' strides, where each (slot, j)'s
            columns start in ``y`` (then y is (s, rows of the A arena) and ``max_rank`` the largest
            rank); see the module docstring.
        wide: the launch of ``lora_expand_wide`` (rank-sized column spans); None: where it applies,
            row tiles of up to 16 and ranks up to 128; False: the column-block launch (benchmarks
            compare the two). The block and warp overrides are the other launch's.
        bias: (>= num_slots, N_total), unit column stride: each slot's LoRA B bias (PEFT's
            ``lora_bias``; zeros where an adapter has none), added to the delta before the scaling
            in the columns of the modules the slot targets.
        dora: (scale, shift), each (>= num_slots, N_total) float32 with one row stride: DoRA's
            epilogue, ``out = (out + delta) * scale + shift`` in the columns of the modules the slot
            targets (ones and zeros in the rows of slots without DoRA).
    Returns:
        ``out``.
    """
    offsets = [int(o) for o in offsets]
    c = len(offsets) - 1
    s = y.shape[0]
    packed = b_offs is not None
    if y_cols is not None and (not packed or max_rank is None):
        raise ValueError("lora_expand: y_cols takes packed weights (b_offs) and max_rank")
    if packed:
        num_slots, n_total = b_offs.shape[0], offsets[-1]
        r = int(max_rank) if y_cols is not None else y.shape[1] // c
        if check and (weights.dim() != 1 or b_offs.dim() != 2 or b_offs.shape[1] != c
                      or b_offs.stride(1) != 1 or b_offs.dtype != torch.int64):
            raise ValueError(f"lora_expand: a packed B must be flat with an int64 (num_slots, {c}) "
                             "offset table")
        if check and y_cols is not None and (y_cols.shape != b_offs.shape or y_cols.stride() != b_offs.stride()
                                             or y_cols.dtype != torch.int32):
            raise ValueError(f"lora_expand: y_cols must be an int32 (num_slots, {c}) table with b_offs' strides")
    else:
        num_slots, n_total, r = weights.shape
    if check:
        if ((y_cols is None and y.shape[1] != c * r) or offsets[-1] != n_total
                or tuple(out.shape) != (s, n_total)):
            raise ValueError(f"lora_expand: y {tuple(y.shape)}, weights {tuple(weights.shape)}, out "
                             f"{tuple(out.shape)} and offsets {offsets} do not agree")
        if out.stride(1) != 1:
            raise ValueError("lora_expand: out must have unit column stride")
        for name, t in (("ranks", ranks), ("scalings", scalings)):
            if t.dim() != 2 or t.shape[1] != c or t.stride(1) != 1:
                raise ValueError(f"lora_expand: {name} must be (num_slots, {c}) with unit column stride")
        check_column_table("lora_expand", bias, num_slots, n_total)
        check_dora("lora_expand", dora, num_slots, n_total)
    max_chunks = chunk_slot.shape[0]
    if s == 0 or max_chunks == 0 or r == 0:
        return out
    dot_precision = "ieee" if y.dtype == torch.float32 else "tf32"  # Triton's fp32 default is tf32
    b_strides = (0, 0, 0) if packed else weights.stride()
    use_pdl = pdl.mode(out)
    wide_ok = block_m <= WIDE_MAX_BLOCK_M and r <= WIDE_MAX_RANK
    if wide and not wide_ok:
        raise ValueError(f"lora_expand: the wide launch takes row tiles of up to {WIDE_MAX_BLOCK_M} and ranks "
                         f"up to {WIDE_MAX_RANK}, got {block_m} and {r}")
    wide = wide_ok if wide is None else wide
    plan = (sorted_token_ids, chunk_slot, chunk_start, chunk_len)
    for j0 in range(0, c, MAX_MODULES_PER_LAUNCH):
        offs = offsets[j0 : j0 + MAX_MODULES_PER_LAUNCH + 1]
        n_mod = len(offs) - 1
        widest = max(b - a for a, b in zip(offs[:-1], offs[1:]))
        if widest == 0:
            continue
        if wide:
            offs = offs + [offs[-1]] * (MAX_MODULES_PER_LAUNCH + 1 - len(offs))
            launch_wide(y, weights, out, b_offs, y_cols, ranks, scalings, plan, r, num_slots, j0, offs,
                        block_m=block_m, b_align=b_align, dot_precision=dot_precision, use_pdl=use_pdl, bias=bias,
                        dora=dora)
            continue
        cfg = expand_config(block_m, r, widest)
        bn = block_n or cfg["block_n"]
        offs = offs + [offs[-1]] * (MAX_MODULES_PER_LAUNCH + 1 - len(offs))
        grid = (max_chunks, triton.cdiv(widest, bn), n_mod)
        _lora_expand_kernel[grid](
            y, weights, out, b_offs if packed else ranks, y_cols if y_cols is not None else ranks,
            bias if bias is not None else scalings, bias.stride(0) if bias is not None else 0,
            *(dora if dora is not None else (scalings, scalings)), dora[0].stride(0) if dora is not None else 0,
            r, num_slots, j0, *offs,
            y.stride(0), y.stride(1),
            *b_strides,
            out.stride(0), out.stride(1),
            ranks, ranks.stride(0),
            scalings, scalings.stride(0),
            b_offs.stride(0) if packed else 0,
            sorted_token_ids, chunk_slot, chunk_start, chunk_len,
            PACKED=packed,
            B_ALIGN=b_align,
            Y_COLS=y_cols is not None,
            HAS_BIAS=bias is not None,
            HAS_DORA=dora is not None,
            BLOCK_M=block_m,
            BLOCK_N=bn,
            BLOCK_R=block_r or cfg["block_r"],
            DOT_PRECISION=dot_precision,
            USE_PDL=use_pdl,
            num_warps=num_warps or cfg["num_warps"],
            num_stages=num_stages or cfg["num_stages"],
            launch_pdl=use_pdl > 0,
        )
    return out
