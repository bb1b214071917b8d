"""Fused decode LoRA: shrink and expand of one site in one launch,
``out[t, lo_j:hi_j] += scaling[slot, j] * (x[t] @ A[slot, j*R : j*R + rank].T) @ B[slot, lo_j:hi_j, :rank].T``.

For decode-sized batches the two-kernel path is latency bound: the shrink gives each program a
whole K loop (one program per chunk and rank block streams all of A's rows it owns), and the
expand is a second launch that waits for all of it. Here one persistent launch does both:

- *Items.* Work is cut into shrink items (chunk, module, K split: one K tile of x @ A.T) and expand
  items (chunk, module, column block). Programs take items from a ticket counter, all shrink items
  before any expand item, so a program that waits only ever waits for items already taken by
  running programs: nothing can deadlock, whatever the grid size or the order the GPU starts them.
- *Split-K.* A shrink item adds its fp32 partial into the (chunk, module) accumulator of a small
  workspace (atomic adds) and then counts itself in the (chunk, module) counter (release).
- *Expand.* An expand item loads its B block and its rows of ``out`` first, then waits until the
  counter shows every split (acquire), reads the accumulator, rounds it to the input dtype (as the
  shrink output of the two-kernel path is), multiplies and adds into ``out`` in place.
- *Clean-up.* Readers count themselves in the high bits of the same counter; whoever brings it to
  its final value zeroes the accumulator and the counter, so the workspace is clean for the next
  call (and for the next CUDA-graph replay) without a memset launch.
- *Safety net.* A reader that has waited ``max_spin`` polls computes the shrink of its rows itself
  (correct, slow) and counts a timeout, so no bug or scheduling surprise can hang the GPU; tests
  and the benchmark check that the count stays 0.

- *Trace* (for measurements only, ``trace=``): a variant that stamps each item's phases with the
  SM's clock; compiled out otherwise.

The grid is fixed by the host (SM count, and the chunk plan's *capacity*), the work list is read on
the device, and the workspace is allocated once: CUDA-graph safe. Rows of tokens in no chunk are
not touched; only the first ``rank(slot, j)`` rows of A and columns of B are read.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..kernel_support import AVAILABLE, tl, triton
from ..kernel_support import num_sms
from .expand_common import add_bias, check_column_table, check_dora, dora_epilogue, packed_row_stride

if AVAILABLE:
    from triton.language.extra.cuda import globaltimer, smid

MAX_MODULES = 4  # column offsets travel as scalar arguments, as in the expand
MAX_BLOCK_R = 128  # larger padded ranks take the two-kernel path
# rank rows an item handles per step (``fused_config``), chosen from a sweep of block sizes on an H200
RANK_BLOCK = 32
MIXED_RANK_BLOCK = 16
READER = 1 << 16  # a reader's increment of a (chunk, module) counter; splits count in the low bits
SYNC_HEAD = 32  # int32 slots before the counters: [0] ticket, [1] timeouts (own 128-byte line)
_READER = tl.constexpr(READER)  # the kernels' copies (Triton reads only constexpr globals)
_SYNC_HEAD = tl.constexpr(SYNC_HEAD)
# probes only: one int64 record per item drawn, in ticket order (``lora_fused(trace=...)``)
TRACE_FIELDS = 10
(T_GLOBAL_NS, T_SM, T_START, T_META, T_FIRST, T_WAITED, T_COMPUTED, T_FINISHED, T_SPINS,
 T_KIND) = range(TRACE_FIELDS)
_TRACE_FIELDS = tl.constexpr(TRACE_FIELDS)


@triton.jit
def _x_tile(x_ptr, tok, row_mask, k0, K, stride_xs, stride_xk, BLOCK_K: tl.constexpr):
    """x[tok, k0:k0+BLOCK_K]."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + tok[:, None] * stride_xs + offs_k[None, :] * stride_xk,
                   mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _a_tile(a_base, r0, rank, k0, K, stride_ar, stride_ak, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows r0:r0+BLOCK_R of the module's A (``a_base`` its first row), columns k0:k0+BLOCK_K, read
    transposed: (BLOCK_K, BLOCK_R). Rows past the rank (padding, maybe NaN) are not read."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                   mask=(offs_k < K)[:, None] & (offs_r < rank)[None, :], other=0.0)


@triton.jit
def _shrink_rows(x_ptr, a_base, tok, row_mask, r0, rank, K, stride_xs, stride_xk, stride_ar, stride_ak,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x[tok] @ A_module[r0:r0+BLOCK_R].T over all of K, in small tiles (the readers' safety net:
    it must not raise the kernel's register count)."""
    y = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, 32):
        xf = _x_tile(x_ptr, tok, row_mask, k0, K, stride_xs, stride_xk, 32)
        af = _a_tile(a_base, r0, rank, k0, K, stride_ar, stride_ak, BLOCK_R, 32)
        y = tl.dot(xf, af, y, input_precision=DOT_PRECISION)
    return y


@triton.jit
def _a_module(a_ptr, a_rows_ptr, slot, j, R, stride_tl, stride_al, stride_ar, PACKED: tl.constexpr):
    """Where module j of ``slot`` starts in A: its row in the packed table, or ``j * R`` of the
    slot's padded stack."""
    if PACKED:
        return a_ptr + tl.load(a_rows_ptr + slot * stride_tl + j).to(tl.int64) * stride_ar
    return a_ptr + slot.to(tl.int64) * stride_al + (j * R) * stride_ar


@triton.jit
def _b_tile(b_base, r0, rank, R, offs_n, n_mask, cols, stride_bn, stride_br,
            PACKED: tl.constexpr, B_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rank rows r0:r0+BLOCK_R of the module's B, transposed: (BLOCK_R, BLOCK_N), zero past the
    rank. Packed (``b_base`` at the module's block): (width, rank) rows, 16-byte loads where
    aligned. Padded (``b_base`` at the slot): every column up to R is read (a (BLOCK_N, R) block is
    contiguous), those past the rank (padding, maybe NaN) are then zeroed."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    if PACKED:
        rs = packed_row_stride(rank, B_ALIGN)
        bt = tl.load(b_base + offs_n[None, :] * rs + offs_r[:, None],
                     mask=(offs_r < rs)[:, None] & n_mask[None, :], other=0.0)
    else:
        bt = tl.load(b_base + cols[None, :] * stride_bn + offs_r[:, None] * stride_br,
                     mask=(offs_r < R)[:, None] & n_mask[None, :], other=0.0)
    return tl.where((offs_r < rank)[:, None], bt, 0.0)


@triton.jit
def _finish(cnt_ptr, add, total, acc_tile_ptrs, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Count this item in its (chunk, module) counter; the item that completes it cleans up."""
    # acq_rel: releases this item's writes (partials) / reads (of the accumulator), and the
    # cleaning item acquires everyone's before it zeroes the accumulator
    old = tl.atomic_add(cnt_ptr, add, sem="acq_rel")
    if old + add == total:
        tl.store(acc_tile_ptrs, tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32))
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    return old


@triton.jit
def _stamp(trace_ptr, t, field: tl.constexpr, dep, TRACE: tl.constexpr):
    """Probes only (``TRACE``): the SM's clock once ``dep`` (an int32 scalar) has arrived, as field
    ``field`` of item ``t``'s record (``TRACE_FIELDS`` int64 each). The clock is read in the same
    asm block as an instruction that uses ``dep``, so the warp stalls on its load first; the
    clock's last bit carries ``dep``'s, a one-cycle error that keeps the use from being dropped."""
    if TRACE:
        c = tl.inline_asm_elementwise(
            "{ .reg .u64 d; cvt.u64.u32 d, $1; and.b64 d, d, 1; mov.u64 $0, %clock64; add.u64 $0, $0, d; }",
            "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(trace_ptr + t.to(tl.int64) * _TRACE_FIELDS + field, c)


@triton.jit
def _note(trace_ptr, t, field: tl.constexpr, value, TRACE: tl.constexpr):
    """Probes only: ``value`` as field ``field`` of item ``t``'s record."""
    if TRACE:
        tl.store(trace_ptr + t.to(tl.int64) * _TRACE_FIELDS + field, value.to(tl.int64))


@triton.jit
def _lora_fused_decode_kernel(
    # pointers
    x_ptr,  # (s, K)
    a_ptr,  # padded: (num_slots, c * R, K); packed: (rows, K)
    b_ptr,  # padded: (num_slots, N_total, R); packed: flat
    out_ptr,  # (s, N_total), any row stride
    a_rows_ptr,  # packed: (>= num_slots, c) int32 first row in A of each (slot, module)
    b_offs_ptr,  # packed: (>= num_slots, c) int64 element offset in B of each (slot, module)
    acc_ptr,  # fp32 workspace, (>= max_chunks * c, BLOCK_M, BLOCK_R); zero between calls
    sync_ptr,  # int32 workspace: ticket, timeouts, then one counter per (chunk, module)
    trace_ptr,  # probes only (TRACE): int64 records, TRACE_FIELDS per item drawn
    bias_ptr,  # HAS_BIAS: (>= num_slots, N_total) the adapters' B bias, added before the scaling
    stride_biasl,
    scale_ptr, shift_ptr,  # HAS_DORA: (>= num_slots, N_total) each slot's DoRA column scale and shift
    stride_dl,
    # dimensions
    K,
    R,  # padded rank of one module in A and B
    num_slots,
    C,  # modules (<= 4)
    NSPLIT,  # shrink items per (chunk, module): cdiv(K, BLOCK_K)
    OFF0, OFF1, OFF2, OFF3, OFF4,  # column offsets; unused modules repeat the end
    NB0, NB1, NB2, NB3,  # column blocks per module (0 for unused ones)
    NUM_PROGRAMS,
    # strides
    stride_xs, stride_xk,
    stride_al, stride_ar, stride_ak,
    stride_bl, stride_bn, stride_br,
    stride_os, stride_on,
    # batch info
    ranks_ptr, stride_rl,  # (>= num_slots, c) int32, unit column stride
    scalings_ptr, stride_sl,  # (>= num_slots, c) float32, unit column stride
    stride_tl,  # row stride of the packed tables
    sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    max_chunks,
    # meta-parameters
    PACKED: tl.constexpr,
    B_ALIGN: tl.constexpr,  # packed: every B offset and rank is a multiple of this (1 or 8)
    MAX_CHUNKS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # the padded rank's power of two: the accumulator's columns
    R_SUB: tl.constexpr,  # rank rows per step (BLOCK_R: one step, every rank row in one tile)
    PREFETCH: tl.constexpr,  # steps: the next rank block's tile loaded before this block's dot
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    WAIT_FIRST: tl.constexpr,  # tests only: hand out expand items first (exercises the timeout)
    DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DORA: tl.constexpr,
    TRACE: tl.constexpr,  # probes only: time each item's phases into trace_ptr (fields: TRACE_FIELDS)
):
    # the plan fills chunks from index 0; items are numbered over chunks [0, n_act) only
    cidx = tl.arange(0, MAX_CHUNKS_P2)
    cmask = cidx < max_chunks
    cslot = tl.load(chunk_slot_ptr + cidx, mask=cmask, other=-1)
    clen = tl.load(chunk_len_ptr + cidx, mask=cmask, other=0)
    n_act = tl.max(tl.where((cslot >= 0) & (clen > 0), cidx + 1, 0), axis=0)
    nb_chunk = NB0 + NB1 + NB2 + NB3
    n_shrink = n_act * C * NSPLIT
    n_expand = n_act * nb_chunk
    n_items = n_shrink + n_expand

    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while t < n_items:
        if TRACE:  # record fields 0-2 (T_GLOBAL_NS, T_SM, T_START); 9 (T_KIND) 2 until known
            _note(trace_ptr, t, 0, globaltimer(), TRACE)
            _note(trace_ptr, t, 1, smid() + 256 * tl.program_id(0), TRACE)  # SM and program
            _stamp(trace_ptr, t, 2, t, TRACE)
            _note(trace_ptr, t, 9, tl.full((), 2, tl.int32), TRACE)
        item = t
        if WAIT_FIRST:
            item = tl.where(t < n_expand, t + n_shrink, t - n_expand)
        is_shrink = item < n_shrink
        e = item - n_shrink
        # shrink item: (chunk, module j, split sp); expand item: (chunk, module j, column block nb)
        chunk = tl.where(is_shrink, item // (C * NSPLIT), e // nb_chunk)
        q = e % nb_chunk
        jx = (q >= NB0).to(tl.int32) + (q >= NB0 + NB1).to(tl.int32) + (q >= NB0 + NB1 + NB2).to(tl.int32)
        j = tl.where(is_shrink, (item % (C * NSPLIT)) // NSPLIT, jx)
        lo = tl.where(j == 0, OFF0, tl.where(j == 1, OFF1, tl.where(j == 2, OFF2, OFF3)))
        hi = tl.where(j == 0, OFF1, tl.where(j == 1, OFF2, tl.where(j == 2, OFF3, OFF4)))
        nb_j = tl.where(j == 0, NB0, tl.where(j == 1, NB1, tl.where(j == 2, NB2, NB3)))
        nb = q - tl.where(jx == 0, 0, tl.where(jx == 1, NB0, tl.where(jx == 2, NB0 + NB1, NB0 + NB1 + NB2)))

        slot = tl.load(chunk_slot_ptr + chunk)
        n_rows = tl.load(chunk_len_ptr + chunk)
        start = tl.load(chunk_start_ptr + chunk)
        slot_ok = (slot >= 0) & (slot < num_slots)  # a stale plan must never read past the weights
        slot = tl.where(slot_ok, slot, 0)
        # a rank table larger than the buffer's padded rank must not spill into the next module
        rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + j), R)
        # shrink and expand decide alike, so a (chunk, module) is counted by all its items or none
        active = slot_ok & (n_rows > 0) & (rank > 0) & (hi > lo)
        # the next ticket is drawn while this item's loads are in flight (its round trip overlaps
        # theirs); a program never holds a shrink item it has not started while it waits
        t_next = t
        if active:
            row_mask = offs_m < n_rows
            tok = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
            if TRACE:  # T_META; T_KIND 0 shrink, 1 expand
                _stamp(trace_ptr, t, 3, rank + tl.sum(tok).to(tl.int32), TRACE)
                _note(trace_ptr, t, 9, 1 - is_shrink.to(tl.int32), TRACE)
            r_mask = offs_r < rank
            cnt_ptr = sync_ptr + _SYNC_HEAD + chunk * C + j
            acc_ptrs = acc_ptr + ((chunk * C + j) * BLOCK_M + offs_m[:, None]) * BLOCK_R + offs_r[None, :]
            total = NSPLIT + nb_j * _READER
            if is_shrink:
                a_base = _a_module(a_ptr, a_rows_ptr, slot, j, R, stride_tl, stride_al, stride_ar, PACKED)
                k0 = (item % NSPLIT) * BLOCK_K
                xt = _x_tile(x_ptr, tok, row_mask, k0, K, stride_xs, stride_xk, BLOCK_K)
                if R_SUB == BLOCK_R:
                    at = _a_tile(a_base, 0, rank, k0, K, stride_ar, stride_ak, BLOCK_R, BLOCK_K)
                    if TRACE:  # T_FIRST: x and A tiles arrived
                        _stamp(trace_ptr, t, 4, (tl.sum(xt.to(tl.float32)) + tl.sum(at.to(tl.float32))).to(tl.int32), TRACE)
                    part = tl.dot(xt, at, input_precision=DOT_PRECISION)
                    if TRACE:  # T_COMPUTED
                        _stamp(trace_ptr, t, 6, tl.sum(part).to(tl.int32), TRACE)
                    # (drawn before the dot, it would keep both tiles live across the draw: ~100
                    # more registers, fewer programs per SM)
                    t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed")
                    tl.atomic_add(acc_ptrs, part, mask=row_mask[:, None] & r_mask[None, :], sem="relaxed")
                else:
                    # rank blocks of R_SUB rows: an item's bytes follow its own rank, not the
                    # padded one; the next block's load is issued before this block's dot
                    offs_s = tl.arange(0, R_SUB)
                    at = _a_tile(a_base, 0, rank, k0, K, stride_ar, stride_ak, R_SUB, BLOCK_K)
                    if TRACE:  # T_FIRST: x and the first A tile arrived
                        _stamp(trace_ptr, t, 4, (tl.sum(xt.to(tl.float32)) + tl.sum(at.to(tl.float32))).to(tl.int32), TRACE)
                    chk = 0.0
                    for r0 in range(0, rank, R_SUB):
                        if PREFETCH:
                            at_next = _a_tile(a_base, r0 + R_SUB, rank, k0, K, stride_ar, stride_ak, R_SUB, BLOCK_K)
                        part = tl.dot(xt, at, input_precision=DOT_PRECISION)
                        if TRACE:
                            chk += tl.sum(part)
                        rows = r0 + offs_s
                        tl.atomic_add(acc_ptr + ((chunk * C + j) * BLOCK_M + offs_m[:, None]) * BLOCK_R
                                      + rows[None, :], part,
                                      mask=row_mask[:, None] & (rows < rank)[None, :], sem="relaxed")
                        if PREFETCH:
                            at = at_next
                        else:  # one tile live at a time: fewer registers, more programs per SM
                            at = _a_tile(a_base, r0 + R_SUB, rank, k0, K, stride_ar, stride_ak, R_SUB, BLOCK_K)
                    if TRACE:  # T_COMPUTED: every block's dot
                        _stamp(trace_ptr, t, 6, chk.to(tl.int32), TRACE)
                    t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed")
                tl.debug_barrier()  # every thread's adds before the counter's release
                old = _finish(cnt_ptr, 1, total, acc_ptrs, BLOCK_M, BLOCK_R)
                _stamp(trace_ptr, t, 7, old, TRACE)  # T_FINISHED
            else:
                scaling = tl.load(scalings_ptr + slot * stride_sl + j)
                offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = offs_n < hi - lo
                cols = lo + offs_n
                if PACKED:
                    b_off = tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + j), B_ALIGN)
                else:
                    b_off = slot.to(tl.int64) * stride_bl
                # independent of the shrink: B's first rank block is loaded before the wait
                bt = _b_tile(b_ptr + b_off, 0, rank, R, offs_n, n_mask, cols, stride_bn, stride_br,
                             PACKED, B_ALIGN, R_SUB)
                out_ptrs = out_ptr + tok[:, None] * stride_os + cols[None, :] * stride_on
                mask = row_mask[:, None] & n_mask[None, :]
                base = tl.load(out_ptrs, mask=mask, other=0.0)
                if TRACE:  # T_FIRST: B's first block and the rows of out arrived
                    _stamp(trace_ptr, t, 4, (tl.sum(bt.to(tl.float32)) + tl.sum(base.to(tl.float32))).to(tl.int32), TRACE)
                t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed")

                # acquire: the splits' adds (released before they counted) are visible after it
                seen = tl.atomic_add(cnt_ptr, 0, sem="acquire") & (_READER - 1)
                spins = 0
                while (seen < NSPLIT) & (spins < MAX_SPIN):
                    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire") & (_READER - 1)
                    spins += 1
                tl.debug_barrier()  # the acquiring thread's view before any thread reads
                _stamp(trace_ptr, t, 5, seen, TRACE)  # T_WAITED
                _note(trace_ptr, t, 8, spins, TRACE)  # T_SPINS
                if seen < NSPLIT:  # the safety net: this item's rows of x @ A.T, computed here
                    tl.atomic_add(sync_ptr + 1, 1, sem="relaxed")
                if R_SUB == BLOCK_R:
                    if seen >= NSPLIT:
                        # .cg: straight from L2, never a line this SM cached before the adds
                        y = tl.load(acc_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0,
                                    cache_modifier=".cg")
                    else:
                        a_base = _a_module(a_ptr, a_rows_ptr, slot, j, R, stride_tl, stride_al, stride_ar, PACKED)
                        y = _shrink_rows(x_ptr, a_base, tok, row_mask, 0, rank, K, stride_xs, stride_xk,
                                         stride_ar, stride_ak, BLOCK_M, BLOCK_R, DOT_PRECISION)
                    # rounded to the input dtype, as the two-kernel path stores the shrink output
                    y = y.to(x_ptr.dtype.element_ty).to(b_ptr.dtype.element_ty)
                    delta = tl.dot(y, bt, input_precision=DOT_PRECISION)
                else:
                    offs_s = tl.arange(0, R_SUB)
                    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for r0 in range(0, rank, R_SUB):
                        rows = r0 + offs_s
                        if seen >= NSPLIT:
                            y = tl.load(acc_ptr + ((chunk * C + j) * BLOCK_M + offs_m[:, None]) * BLOCK_R
                                        + rows[None, :], mask=row_mask[:, None] & (rows < rank)[None, :],
                                        other=0.0, cache_modifier=".cg")
                        else:
                            a_base = _a_module(a_ptr, a_rows_ptr, slot, j, R, stride_tl, stride_al, stride_ar,
                                               PACKED)
                            y = _shrink_rows(x_ptr, a_base, tok, row_mask, r0, rank, K, stride_xs, stride_xk,
                                             stride_ar, stride_ak, BLOCK_M, R_SUB, DOT_PRECISION)
                        if PREFETCH:  # the next rank block's B, loaded before this block's dot
                            bt_next = _b_tile(b_ptr + b_off, r0 + R_SUB, rank, R, offs_n, n_mask, cols,
                                              stride_bn, stride_br, PACKED, B_ALIGN, R_SUB)
                        y = y.to(x_ptr.dtype.element_ty).to(b_ptr.dtype.element_ty)
                        delta = tl.dot(y, bt, delta, input_precision=DOT_PRECISION)
                        if PREFETCH:
                            bt = bt_next
                        else:
                            bt = _b_tile(b_ptr + b_off, r0 + R_SUB, rank, R, offs_n, n_mask, cols,
                                         stride_bn, stride_br, PACKED, B_ALIGN, R_SUB)
                if TRACE:  # T_COMPUTED
                    _stamp(trace_ptr, t, 6, tl.sum(delta).to(tl.int32), TRACE)
                delta = add_bias(delta, bias_ptr + slot.to(tl.int64) * stride_biasl, cols, n_mask, HAS_BIAS)
                res = dora_epilogue(base.to(tl.float32) + delta * scaling, scale_ptr + slot.to(tl.int64) * stride_dl,
                                    shift_ptr + slot.to(tl.int64) * stride_dl, cols, n_mask, HAS_DORA)
                tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)
                old = _finish(cnt_ptr, _READER, total, acc_ptrs, BLOCK_M, BLOCK_R)
                _stamp(trace_ptr, t, 7, old, TRACE)  # T_FINISHED
        else:
            t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        t = t_next
    # every program draws exactly one ticket past the work: the last such draw resets the counter
    if t == n_items + NUM_PROGRAMS - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")


class FusedWorkspace:
    """The fused kernel's scratch on one device: an fp32 accumulator and int32 counters, zero
    between calls (the kernel cleans up after itself). Grows on demand; a grown-out buffer is kept
    alive, since a captured CUDA graph may still point at it."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.acc: Optional[torch.Tensor] = None
        self.sync: Optional[torch.Tensor] = None
        self._retired: list = []

    def reserve(self, max_chunks: int, modules: int, block_r: int, block_m: int = 16):
        n_acc = max_chunks * modules * block_m * block_r
        n_sync = SYNC_HEAD + max_chunks * modules
        if self.acc is None or self.acc.numel() < n_acc or self.sync.numel() < n_sync:
            if self.acc is not None:
                self._retired.append((self.acc, self.sync))
                n_acc = max(n_acc, self.acc.numel())
                n_sync = max(n_sync, self.sync.numel())
            # not inference tensors even when first built under inference_mode (updated in place)
            with torch.inference_mode(False):
                self.acc = torch.zeros(n_acc, dtype=torch.float32, device=self.device)
                self.sync = torch.zeros(n_sync, dtype=torch.int32, device=self.device)
        return self.acc, self.sync

    def timeouts(self) -> int:
        """Readers that gave up waiting, over every buffer's lifetime (host sync: tests only)."""
        bufs = self._retired + ([(self.acc, self.sync)] if self.sync is not None else [])
        return sum(int(s[1]) for _, s in bufs)


def fused_config(rank: int, k: int, widths: Sequence[int], dtype: torch.dtype = torch.bfloat16,
                 rank_block: Optional[int] = None, mixed_ranks: bool = False) -> dict:
    """Launch parameters for Hopper (no autotuning: graphs need a fixed launch).

    Items step through their own rank in blocks of ``r_sub`` rows, and the tiles are sized by that
    block, not by the padded rank: an item's bytes follow the rank of its adapter, so with mixed
    ranks the many small-rank items do not each pay for a tile of the largest rank. Where the
    site's adapters differ in rank (``mixed_ranks``): blocks of ``MIXED_RANK_BLOCK`` rows, one tile
    live at a time and a register cap of 128, which fits 4 programs per SM (more items in flight:
    with many adapters the items are chains of dependent loads). Else blocks of ``RANK_BLOCK``,
    the next block's tile loaded before this block's dot, no cap. ``rank_block`` overrides the
    block (the padded rank's ``block_r``: one step, the kernel before rank blocks).
    16-bit inputs: one shrink step loads a (r_sub x BLOCK_K) tile of A, 16 KB; K is cut in as many
    splits as that takes (Llama 8B at rank 16: 8 for K=4096, 28 for K=14336; at r_sub 32: 16 and
    56). One expand step loads an 8 KB block of B (256 columns at r_sub 16, 128 at 32) besides the
    chunk's rows of ``out``. Four warps: a 16-row tile has no more work to share.
    fp32 (an exact fp32 dot runs on the FMA units, whose operand layouts take many more
    registers) takes smaller tiles.
    """
    block_r = max(16, triton.next_power_of_2(rank))
    mixed = mixed_ranks and block_r > 16
    r_sub = min(block_r, max(16, triton.next_power_of_2(rank_block or (MIXED_RANK_BLOCK if mixed else RANK_BLOCK))))
    if dtype == torch.float32:
        block_k = max(16, min(128, 2048 // r_sub))
        block_n = max(16, min(64, 2048 // r_sub))
    else:
        block_k = max(64, min(512, 8192 // r_sub))
        block_n = max(32, min(256, 4096 // r_sub))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(block_n, max(16, triton.next_power_of_2(max(widths) if widths else 1)))
    # max_registers: a cap for the compiler (None: its own choice), which bounds programs per SM
    return dict(block_r=block_r, r_sub=r_sub, block_k=block_k, block_n=block_n, num_warps=4,
                programs_per_sm=4, prefetch=not mixed, max_registers=128 if mixed else None)


def fused_supported(stack_num: int, rank: int, block_m: int, dtype: torch.dtype) -> bool:
    """Shapes the fused kernel takes (the rest use the shrink and expand kernels): decode-sized
    chunks, up to 4 modules, padded rank up to 128 (64 in fp32, whose tiles would spill)."""
    max_r = MAX_BLOCK_R // 2 if dtype == torch.float32 else MAX_BLOCK_R
    return block_m <= 16 and 1 <= stack_num <= MAX_MODULES and 0 < rank <= max_r


def lora_fused(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    offsets: Sequence[int],
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    workspace: FusedWorkspace,
    *,
    block_m: int,
    num_programs: Optional[int] = None,
    block_k: Optional[int] = None,
    block_n: Optional[int] = None,
    max_spin: Optional[int] = None,
    wait_first: bool = False,
    num_warps: Optional[int] = None,
    check: bool = True,
    a_rows: Optional[torch.Tensor] = None,
    b_offs: Optional[torch.Tensor] = None,
    max_rank: Optional[int] = None,
    b_align: int = 1,
    rank_block: Optional[int] = None,
    mixed_ranks: bool = False,
    trace: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    dora: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Stacked, segmented shrink + expand into ``out`` (in place), one launch.

    Args:
        x: (s, K).
        lora_a: (num_slots, c * R, K); lora_b: (num_slots, N_total, R); both in ``x.dtype``. Or
            packed (``a_rows``, ``b_offs``, ``max_rank`` = R and ``b_align`` given, see
            ``lora_shrink`` and ``lora_expand``): A a (rows, K) arena, B a flat one.
        offsets: c + 1 host ints (c <= 4); module j writes columns ``offsets[j]:offsets[j+1]``.
        ranks: (>= num_slots, c) int32; scalings: (>= num_slots, c) float32.
        out: (s, N_total), unit column stride; rows of tokens in no chunk are not touched.
        sorted_token_ids, chunk_slot, chunk_start, chunk_len: the chunk plan (int32).
        workspace: this device's ``FusedWorkspace``.
        block_m: rows per chunk (16: decode-sized batches; see ``fused_supported``).
        num_programs, block_k, block_n, max_spin, num_warps, rank_block: override the
            defaults (``fused_config``); mixed_ranks: the site's adapters differ in rank (chooses
            the launch, see ``fused_config``; any launch is exact for any ranks);
        wait_first: tests only (expand items first: every reader times out).
        trace: probes only (CUDA): int64 (items + programs, TRACE_FIELDS), filled with each
            drawn item's phase clocks in ticket order (fields ``T_*``); a slower variant.
        check: validate the shapes (False: the caller has).
        bias, dora: as ``lora_expand``'s (each slot's LoRA B bias, added before the scaling; DoRA's
            column scale and shift).
    Returns:
        ``out``.
    """
    offsets = [int(o) for o in offsets]
    c = len(offsets) - 1
    s, k = x.shape
    packed = a_rows is not None
    if packed:
        n_total, r, num_slots = offsets[-1], int(max_rank), a_rows.shape[0]
        if check and (b_offs is None or lora_a.dim() != 2 or lora_a.shape[1] != k or lora_b.dim() != 1
                      or tuple(a_rows.shape) != (num_slots, c) or tuple(b_offs.shape) != (num_slots, c)
                      or a_rows.dtype != torch.int32 or b_offs.dtype != torch.int64
                      or a_rows.stride() != b_offs.stride() or a_rows.stride(1) != 1):
            raise ValueError(f"lora_fused: packed A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} and "
                             f"their tables do not agree with x {tuple(x.shape)} and {c} modules")
    else:
        n_total, r = lora_b.shape[1:]
        num_slots = min(lora_a.shape[0], lora_b.shape[0])
    if check:
        if ((not packed and tuple(lora_a.shape) != (lora_a.shape[0], c * r, k)) or offsets[-1] != n_total
                or tuple(out.shape) != (s, n_total)):
            raise ValueError(f"lora_fused: x {tuple(x.shape)}, A {tuple(lora_a.shape)}, B "
                             f"{tuple(lora_b.shape)}, out {tuple(out.shape)} and offsets {offsets} "
                             "do not agree")
        if not fused_supported(c, r, block_m, x.dtype) or out.stride(1) != 1:
            raise ValueError(f"lora_fused: {c} modules of rank {r}, block_m {block_m} (or a strided "
                             "out column) are not supported; use lora_shrink + lora_expand")
        for name, t in (("ranks", ranks), ("scalings", scalings)):
            if t.dim() != 2 or t.shape[1] != c or t.stride(1) != 1:
                raise ValueError(f"lora_fused: {name} must be (num_slots, {c}) with unit column stride")
        check_column_table("lora_fused", bias, num_slots, n_total)
        check_dora("lora_fused", dora, num_slots, n_total)
    max_chunks = chunk_slot.shape[0]
    widths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if s == 0 or max_chunks == 0 or max(widths) == 0:
        return out
    cfg = fused_config(r, k, widths, x.dtype, rank_block, mixed_ranks)
    bk, bn, br = block_k or cfg["block_k"], block_n or cfg["block_n"], cfg["block_r"]
    nsplit = triton.cdiv(k, bk)
    nbs = [triton.cdiv(w, bn) for w in widths] + [0] * (MAX_MODULES - c)
    if max(nbs) >= (1 << 31) // READER:  # readers count in the counter's high 15 bits
        raise ValueError(f"lora_fused: {max(widths)} columns in one module are too many")
    offs = offsets + [offsets[-1]] * (MAX_MODULES + 1 - len(offsets))
    acc, sync = workspace.reserve(max_chunks, c, br, block_m)
    # the grid: every item could be live (capacity, not data), capped at a few programs per SM
    max_items = max_chunks * (c * nsplit + sum(nbs))
    if num_programs is None:
        if x.device.type == "cuda":
            index = x.device.index if x.device.index is not None else torch.cuda.current_device()
            num_programs = cfg["programs_per_sm"] * num_sms(index)
        else:  # the interpreter runs programs one after the other: a few exercise the hand-over
            num_programs = 3
    num_programs = max(1, min(num_programs, max_items))
    if max_spin is None:
        # waits are short (the shrink items are all running); the limit only guards against a hang
        max_spin = 1 << 16 if x.device.type == "cuda" else 2
    if trace is not None and (trace.dtype != torch.int64 or not trace.is_contiguous()
                              or trace.numel() < (max_items + num_programs) * TRACE_FIELDS):
        raise ValueError(f"lora_fused: trace must be contiguous int64 with room for "
                         f"{max_items + num_programs} records of {TRACE_FIELDS}")
    a_strides = (0,) + lora_a.stride() if packed else lora_a.stride()
    b_strides = (0, 0, 0) if packed else lora_b.stride()
    _lora_fused_decode_kernel[(num_programs,)](
        x, lora_a, lora_b, out, a_rows if packed else ranks, b_offs if packed else ranks, acc, sync,
        trace if trace is not None else sync,
        bias if bias is not None else scalings, bias.stride(0) if bias is not None else 0,
        *(dora if dora is not None else (scalings, scalings)), dora[0].stride(0) if dora is not None else 0,
        k, r, num_slots, c, nsplit, *offs, *nbs, num_programs,
        x.stride(0), x.stride(1),
        *a_strides,
        *b_strides,
        out.stride(0), out.stride(1),
        ranks, ranks.stride(0),
        scalings, scalings.stride(0),
        a_rows.stride(0) if packed else 0,
        sorted_token_ids, chunk_slot, chunk_start, chunk_len,
        max_chunks,
        PACKED=packed,
        B_ALIGN=b_align,
        MAX_CHUNKS_P2=max(16, triton.next_power_of_2(max_chunks)),
        BLOCK_M=block_m,
        BLOCK_R=br,
        R_SUB=cfg["r_sub"],
        PREFETCH=cfg["prefetch"],
        BLOCK_K=bk,
        BLOCK_N=bn,
        MAX_SPIN=max_spin,
        WAIT_FIRST=wait_first,
        # fp32 inputs: Triton's default on GPU is tf32, which would not match the reference
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_BIAS=bias is not None,
        HAS_DORA=dora is not None,
        TRACE=trace is not None,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=1,
        **({"maxnreg": cfg["max_registers"]} if cfg["max_registers"] and x.device.type == "cuda" else {}),
    )
    return out
