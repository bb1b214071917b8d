"""Fused decode LoRA with items of a fixed number of tile steps, whatever the adapter's rank.

The same persistent launch, ticket counter, split-K hand-over and clean-up as ``lora_fused``'s
kernel (read its docstring first), with the work cut differently. There, every (chunk, module)
gets the same items: K splits of one K tile for the shrink, one column block for the expand, each
stepping through its own rank. An item is a chain of dependent round trips (ticket, metadata,
tiles, counter), so a rank-8 item pays the chain of a rank-64 one for an eighth of the bytes, and
a rank-64 item waits for its rank blocks one after the other.

Here a *step* is one tile of 16-ish rank rows: a (rank block, K tile) of A for the shrink, a
(column block, rank block) of B for the expand. A (chunk, module) of rank r has
``cdiv(r, R_SUB) * NKT`` shrink steps, and a shrink item takes ``SHRINK_STEPS`` of them; an expand
item takes as many column blocks as fit ``EXPAND_STEPS`` steps at that rank. So the number of items
follows the bytes, and an item's steps are a loop the compiler pipelines (``STAGES``: the next
tiles are in flight while this one is multiplied, through shared memory, not registers).

Items are numbered on the device: each program reads the plan's chunks and the ranks once, and
finds an item's (chunk, module) by a prefix sum of the items each pair has. Shrink items come
first, so a waiting expand item only waits for items running programs hold (no deadlock).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lora_expand import packed_row_stride
from .lora_fused import _READER, _SYNC_HEAD, _a_module, _a_tile, _finish, _note, _shrink_rows, _stamp, _x_tile
from triton.language.extra.cuda import globaltimer, smid

_MODULES = tl.constexpr(4)  # pairs are numbered chunk * 4 + module (modules past C have no items)


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _b_step(b_base, r0, rank, R, offs_n, n_mask, cols, stride_bn, stride_br,
            PACKED: tl.constexpr, B_ALIGN: tl.constexpr, R_SUB: tl.constexpr):
    """Rank rows r0:r0+R_SUB of the module's B, transposed (R_SUB, BLOCK_N), zero past the rank
    (the rows are masked, so padding, maybe NaN, is never read)."""
    offs_r = r0 + tl.arange(0, R_SUB)
    if PACKED:
        rs = packed_row_stride(rank, B_ALIGN)
        return tl.load(b_base + offs_n[None, :] * rs + offs_r[:, None],
                       mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)
    return tl.load(b_base + cols[None, :] * stride_bn + offs_r[:, None] * stride_br,
                   mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def _pair_items(rank, nb_j, NKT, R_SUB: tl.constexpr, SHRINK_STEPS: tl.constexpr, EXPAND_STEPS: tl.constexpr):
    """(rank blocks, shrink items, column blocks per expand item, expand items) of a (chunk,
    module) of this rank (0 where it has no work): one formula for the prefix sums and the items."""
    blocks = _cdiv(rank, R_SUB)
    splits = _cdiv(blocks * NKT, SHRINK_STEPS)
    span = tl.maximum(EXPAND_STEPS // tl.maximum(blocks, 1), 1)
    readers = tl.where(blocks > 0, _cdiv(nb_j, span), 0)
    return blocks, splits, span, readers


@triton.jit
def _lora_fused_steps_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, a_rows_ptr, b_offs_ptr, acc_ptr, sync_ptr, trace_ptr,
    K, R, num_slots, C,
    NKT,  # K tiles of BLOCK_K
    OFF0, OFF1, OFF2, OFF3, OFF4,
    NB0, NB1, NB2, NB3,
    NUM_PROGRAMS,
    stride_xs, stride_xk,
    stride_al, stride_ar, stride_ak,
    stride_bl, stride_bn, stride_br,
    stride_os, stride_on,
    ranks_ptr, stride_rl,
    scalings_ptr, stride_sl,
    stride_tl,
    sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    max_chunks,
    PACKED: tl.constexpr,
    B_ALIGN: tl.constexpr,
    MAX_CHUNKS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # the accumulator's columns (the padded rank's power of two)
    R_SUB: tl.constexpr,  # rank rows per step
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SHRINK_STEPS: tl.constexpr,  # steps per shrink item
    EXPAND_STEPS: tl.constexpr,  # steps per expand item (column blocks x rank blocks)
    STAGES: tl.constexpr,  # software pipeline depth of the step loops
    MAX_SPIN: tl.constexpr,
    WAIT_FIRST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TRACE: tl.constexpr,
):
    # every (chunk, module) pair's item counts, once per program, for the prefix sums
    pidx = tl.arange(0, MAX_CHUNKS_P2 * _MODULES)
    pc = pidx // _MODULES
    pj = pidx % _MODULES
    pmask = (pc < max_chunks) & (pj < C)
    pslot = tl.load(chunk_slot_ptr + pc, mask=pmask, other=-1)
    plen = tl.load(chunk_len_ptr + pc, mask=pmask, other=0)
    pok = pmask & (pslot >= 0) & (pslot < num_slots) & (plen > 0)
    prank = tl.load(ranks_ptr + tl.where(pok, pslot, 0) * stride_rl + pj, mask=pok, other=0)
    pwidth = tl.where(pj == 0, OFF1 - OFF0, tl.where(pj == 1, OFF2 - OFF1, tl.where(pj == 2, OFF3 - OFF2, OFF4 - OFF3)))
    pnb = tl.where(pj == 0, NB0, tl.where(pj == 1, NB1, tl.where(pj == 2, NB2, NB3)))
    prank = tl.where(pok & (pwidth > 0), tl.minimum(prank, R), 0)
    _, psplits, _, preaders = _pair_items(prank, pnb, NKT, R_SUB, SHRINK_STEPS, EXPAND_STEPS)
    cs_shrink = tl.cumsum(psplits, 0)
    cs_expand = tl.cumsum(preaders, 0)
    n_shrink = tl.sum(psplits)
    n_expand = tl.sum(preaders)
    n_items = n_shrink + n_expand

    offs_m = tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, R_SUB)
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while t < n_items:
        if TRACE:
            _note(trace_ptr, t, 0, globaltimer(), TRACE)
            _note(trace_ptr, t, 1, smid() + 256 * tl.program_id(0), TRACE)
            _stamp(trace_ptr, t, 2, t, TRACE)
        if WAIT_FIRST:
            is_shrink = t >= n_expand
            u = tl.where(is_shrink, t - n_expand, t)
        else:
            is_shrink = t < n_shrink
            u = tl.where(is_shrink, t, t - n_shrink)
        cs = tl.where(is_shrink, cs_shrink, cs_expand)
        done = cs <= u
        p = tl.sum(done.to(tl.int32))  # the first pair whose items reach past u
        s = u - tl.max(tl.where(done, cs, 0))  # the item's index within its pair
        chunk = p // _MODULES
        j = p % _MODULES
        slot = tl.load(chunk_slot_ptr + chunk)
        n_rows = tl.load(chunk_len_ptr + chunk)
        start = tl.load(chunk_start_ptr + chunk)
        lo = tl.where(j == 0, OFF0, tl.where(j == 1, OFF1, tl.where(j == 2, OFF2, OFF3)))
        hi = tl.where(j == 0, OFF1, tl.where(j == 1, OFF2, tl.where(j == 2, OFF3, OFF4)))
        nb_j = tl.where(j == 0, NB0, tl.where(j == 1, NB1, tl.where(j == 2, NB2, NB3)))
        rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + j), R)
        row_mask = offs_m < n_rows
        tok = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
        blocks, splits, span, readers = _pair_items(rank, nb_j, NKT, R_SUB, SHRINK_STEPS, EXPAND_STEPS)
        if TRACE:
            _stamp(trace_ptr, t, 3, rank + tl.sum(tok).to(tl.int32), TRACE)
            _note(trace_ptr, t, 9, 1 - is_shrink.to(tl.int32), TRACE)
        pair = chunk * C + j
        cnt_ptr = sync_ptr + _SYNC_HEAD + pair
        acc_rows = acc_ptr + (pair * BLOCK_M + offs_m[:, None]) * BLOCK_R
        total = splits + readers * _READER
        if is_shrink:
            a_base = _a_module(a_ptr, a_rows_ptr, slot, j, R, stride_tl, stride_al, stride_ar, PACKED)
            i0 = s * SHRINK_STEPS
            i1 = tl.minimum(i0 + SHRINK_STEPS, blocks * NKT)
            part = tl.zeros((BLOCK_M, R_SUB), dtype=tl.float32)
            chk = 0.0
            # blocks-major: consecutive steps share a rank block, summed here, added once
            for i in tl.range(i0, i1, num_stages=STAGES):
                r0 = (i // NKT) * R_SUB
                k0 = (i % NKT) * BLOCK_K
                xt = _x_tile(x_ptr, tok, row_mask, k0, K, stride_xs, stride_xk, BLOCK_K)
                at = _a_tile(a_base, r0, rank, k0, K, stride_ar, stride_ak, R_SUB, BLOCK_K)
                part = tl.dot(xt, at, part, input_precision=DOT_PRECISION)
                flush = ((i % NKT) == NKT - 1) | (i == i1 - 1)
                rows = r0 + offs_s
                # (the flag folded into the bound: masks are tensors of one shape)
                tl.atomic_add(acc_rows + rows[None, :], part,
                              mask=row_mask[:, None] & (rows < tl.where(flush, rank, 0))[None, :], sem="relaxed")
                if TRACE:
                    chk += tl.sum(part)
                part = tl.where(flush, 0.0, part)
            if TRACE:
                _stamp(trace_ptr, t, 6, chk.to(tl.int32), TRACE)
            t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed")
            tl.debug_barrier()  # every thread's adds before the counter's release
            old = _finish(cnt_ptr, 1, total, acc_rows + tl.arange(0, BLOCK_R)[None, :], BLOCK_M, BLOCK_R)
            _stamp(trace_ptr, t, 7, old, TRACE)
        else:
            scaling = tl.load(scalings_ptr + slot * stride_sl + j)
            if PACKED:
                b_base = b_ptr + tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + j), B_ALIGN)
            else:
                b_base = b_ptr + slot.to(tl.int64) * stride_bl
            t_next = tl.atomic_add(sync_ptr, 1, sem="relaxed")
            # acquire: the splits' adds (released before they counted) are visible after it
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire") & (_READER - 1)
            spins = 0
            while (seen < splits) & (spins < MAX_SPIN):
                seen = tl.atomic_add(cnt_ptr, 0, sem="acquire") & (_READER - 1)
                spins += 1
            tl.debug_barrier()  # the acquiring thread's view before any thread reads
            _stamp(trace_ptr, t, 5, seen, TRACE)
            _note(trace_ptr, t, 8, spins, TRACE)
            # column blocks [s * span, ...) of this module, every rank block of each
            i0 = s * span * blocks
            i1 = tl.minimum(i0 + span * blocks, nb_j * blocks)
            delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if seen >= splits:
                for i in tl.range(i0, i1, num_stages=STAGES):
                    blk = i % blocks
                    offs_n = (i // blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < hi - lo
                    cols = lo + offs_n
                    bt = _b_step(b_base, blk * R_SUB, rank, R, offs_n, n_mask, cols, stride_bn, stride_br,
                                 PACKED, B_ALIGN, R_SUB)
                    rows = blk * R_SUB + offs_s
                    # .cg: straight from L2, never a line this SM cached before the adds
                    y = tl.load(acc_rows + rows[None, :], mask=row_mask[:, None] & (rows < rank)[None, :],
                                other=0.0, cache_modifier=".cg")
                    last = blk == blocks - 1
                    out_ptrs = out_ptr + tok[:, None] * stride_os + cols[None, :] * stride_on
                    # written after the last rank block only (the flag folded into the bound)
                    mask = row_mask[:, None] & (offs_n < tl.where(last, hi - lo, 0))[None, :]
                    base = tl.load(out_ptrs, mask=mask, other=0.0)
                    # rounded to the input dtype, as the two-kernel path stores the shrink output
                    y = y.to(x_ptr.dtype.element_ty).to(b_ptr.dtype.element_ty)
                    delta = tl.dot(y, bt, tl.where(blk == 0, 0.0, delta), input_precision=DOT_PRECISION)
                    tl.store(out_ptrs, (base.to(tl.float32) + delta * scaling).to(out_ptr.dtype.element_ty),
                             mask=mask)
            else:  # the safety net: this item's rows of x @ A.T computed here (correct, slow)
                tl.atomic_add(sync_ptr + 1, 1, sem="relaxed")
                a_base = _a_module(a_ptr, a_rows_ptr, slot, j, R, stride_tl, stride_al, stride_ar, PACKED)
                for i in range(i0, i1):
                    blk = i % blocks
                    offs_n = (i // blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < hi - lo
                    cols = lo + offs_n
                    bt = _b_step(b_base, blk * R_SUB, rank, R, offs_n, n_mask, cols, stride_bn, stride_br,
                                 PACKED, B_ALIGN, R_SUB)
                    y = _shrink_rows(x_ptr, a_base, tok, row_mask, blk * R_SUB, rank, K, stride_xs, stride_xk,
                                     stride_ar, stride_ak, BLOCK_M, R_SUB, DOT_PRECISION)
                    last = blk == blocks - 1
                    out_ptrs = out_ptr + tok[:, None] * stride_os + cols[None, :] * stride_on
                    # written after the last rank block only (the flag folded into the bound)
                    mask = row_mask[:, None] & (offs_n < tl.where(last, hi - lo, 0))[None, :]
                    base = tl.load(out_ptrs, mask=mask, other=0.0)
                    y = y.to(x_ptr.dtype.element_ty).to(b_ptr.dtype.element_ty)
                    delta = tl.dot(y, bt, tl.where(blk == 0, 0.0, delta), input_precision=DOT_PRECISION)
                    tl.store(out_ptrs, (base.to(tl.float32) + delta * scaling).to(out_ptr.dtype.element_ty),
                             mask=mask)
            if TRACE:
                _stamp(trace_ptr, t, 6, tl.sum(delta).to(tl.int32), TRACE)
            old = _finish(cnt_ptr, _READER, total, acc_rows + tl.arange(0, BLOCK_R)[None, :], BLOCK_M, BLOCK_R)
            _stamp(trace_ptr, t, 7, old, TRACE)
        t = t_next
    # every program draws exactly one ticket past the work: the last such draw resets the counter
    if t == n_items + NUM_PROGRAMS - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")


def steps_config(k: int, widths, dtype, rank: int) -> dict:
    """Launch parameters of the step kernel on Hopper (fixed: graphs need a fixed launch). 16-bit
    inputs: steps of 16 rank rows, an A tile of 16 x 256 (8 KB) and a B tile of 16 x 256; eight
    steps per shrink item, four per expand item, three pipeline stages. fp32 (an exact fp32 dot
    on the FMA units) takes smaller tiles."""
    block_r = max(16, triton.next_power_of_2(rank))
    if dtype.itemsize == 4:
        block_k, block_n = 64, 64
    else:
        block_k, block_n = 256, 256
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(block_n, max(16, triton.next_power_of_2(max(widths) if widths else 1)))
    return dict(block_r=block_r, r_sub=16, block_k=block_k, block_n=block_n, shrink_steps=8, expand_steps=4,
                stages=3, num_warps=4, programs_per_sm=4, max_registers=128)


def max_items(max_chunks: int, rank: int, k: int, widths, cfg: dict) -> int:
    """The most items a launch can have (the grid's cap): every chunk at the padded rank, or,
    for the expand, at one column block per item."""
    nkt = triton.cdiv(k, cfg["block_k"])
    blocks = triton.cdiv(rank, cfg["r_sub"])
    splits = triton.cdiv(blocks * nkt, cfg["shrink_steps"])
    readers = sum(triton.cdiv(w, cfg["block_n"]) for w in widths)
    return max_chunks * (len(widths) * splits + readers)
