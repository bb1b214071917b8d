"""Segmented LoRA shrink: ``y[t, j*R : j*R + rank] = x[t] @ A[slot(t), j*R : j*R + rank].T``.

A comes in one of two layouts: *padded* stacks ``(num_slots, c * R, K)`` (the contract's), or a
*packed* arena ``(rows, K)`` with a ``(num_slots, c)`` table of each (slot, module)'s first row, so
each adapter takes its own rank's rows and only for the modules it targets (``lora.packed``).

Tokens arrive grouped by adapter slot in chunks of at most ``block_m`` rows (see the chunk arrays
below); one program computes one (module, rank block) of one chunk, so a tile never mixes two
adapters and each adapter's A is streamed once per chunk. Only the first ``rank(slot, j)`` rows
of a module's A are read and only those columns of ``y`` are written: the rest of ``y`` is left
as it was (the expand never reads it).

Split-K (``split_k`` > 1): a chunk's few programs stream the whole K one tile after the other, so a
step of a few hundred tokens keeps only tens of programs in flight and each waits on its loads. With
``split_k`` programs per (chunk, module, rank block), each over one K range, every program writes
its float32 partial to a workspace and counts itself in on the tile's counter; the last to arrive
sums the partials in split order (the same sum whichever arrives last) and writes ``y``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernel_support import tl, triton

@triton.jit
def _lora_shrink_kernel(
    # pointers
    x_ptr,  # (s, K)
    a_ptr,  # padded: (num_slots, c * R, K); packed: (rows, K)
    y_ptr,  # (s, c * R)
    a_rows_ptr,  # packed: (>= num_slots, c) int32 first row of each (slot, module); unit column stride
    # dimensions
    K,
    R,  # padded rank of one module in A and y
    num_slots,
    # strides
    stride_xs, stride_xk,
    stride_al, stride_ar, stride_ak,
    stride_ys, stride_yr,
    # batch info
    ranks_ptr,  # (>= num_slots, c) int32, unit column stride
    stride_rl,
    stride_tl,  # row stride of the packed row table
    sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    # split-K: (SPLIT_K, s, c * R) float32 partials (unit column stride), a zeroed int32 counter per tile
    part_ptr, count_ptr, stride_ps, stride_pr,
    # meta-parameters
    PACKED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_RB: tl.constexpr,  # rank blocks per module
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # axis 0 walks the (module, rank block, K range) triples of one chunk first, so the programs
    # sharing a chunk's rows of x run side by side and read them from L2 rather than DRAM
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    j = tile // NUM_RB
    rb = tile % NUM_RB
    chunk = tl.program_id(1)
    slot = tl.load(chunk_slot_ptr + chunk)
    n_rows = tl.load(chunk_len_ptr + chunk)
    if slot < 0:
        return
    if slot >= num_slots:  # a stale plan must never read past the weights
        return
    if n_rows <= 0:
        return
    # a rank table larger than the buffer's padded rank must not spill into the next module
    rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + j), R)
    r0 = rb * BLOCK_R
    if r0 >= rank:
        return
    start = tl.load(chunk_start_ptr + chunk)

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < n_rows
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        # this program's K range: whole K tiles, the last range ending at K (empty when the
        # splits outnumber the tiles: its partial is zeros)
        k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = split * k_per
        k_hi = tl.minimum(K, k_lo + k_per)
    offs_k = k_lo + tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tok[:, None] * stride_xs + offs_k[None, :] * stride_xk
    # A is read transposed, (BLOCK_K, BLOCK_R), so the dot needs no permute
    if PACKED:
        row0 = tl.load(a_rows_ptr + slot * stride_tl + j).to(tl.int64)
        a_ptrs = a_ptr + (row0 + offs_r)[None, :] * stride_ar + offs_k[:, None] * stride_ak
    else:
        a_ptrs = (a_ptr + slot.to(tl.int64) * stride_al + (j * R + offs_r)[None, :] * stride_ar
                  + offs_k[:, None] * stride_ak)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[None, :], other=0.0)
        else:
            k_mask = (k0 - k_lo + offs_k) < K
            xt = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    y_mask = row_mask[:, None] & r_mask[None, :]
    y_ptrs = y_ptr + tok[:, None] * stride_ys + (j * R + offs_r)[None, :] * stride_yr
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        p_ptrs = part_ptr + tok[:, None] * stride_pr + (j * R + offs_r)[None, :]
        tl.store(p_ptrs + split * stride_ps, acc, mask=y_mask)
        # every thread's partial stored before the count (a barrier, then the count's release);
        # the count's acquire, and loads past L1 (not coherent across SMs), for the last to read them
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + chunk * (tl.num_programs(0) // SPLIT_K) + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for i in range(SPLIT_K):
                total += tl.load(p_ptrs + i * stride_ps, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


def shrink_config(block_m: int, rank: int, k: int) -> dict:
    """Launch parameters for Hopper, by shape class (no autotuning: graphs need a fixed launch).

    Decode-sized chunks (``block_m`` 16) are memory bound on A: wide K tiles, deep pipelining,
    and ranks split in blocks of 16 for more programs in flight. Prefill chunks re-read x once
    per rank block, so the whole rank is taken in one block. Forwards of 257 to 2,048 tokens (a
    continuous-batching step's, a short prefill's) take 32-row chunks of one adapter each, streamed
    in K tiles of 256. Every shape takes one K range: split K (``split_k`` > 1) was no faster end to
    end and slower launch by launch (``benchmarks/sweep_expand.py --split-k`` times it).
    """
    r_pow2 = max(16, triton.next_power_of_2(rank))
    if block_m <= 16:
        cfg = dict(block_k=256, block_r=16, num_warps=4, num_stages=4)
    elif block_m <= 32:
        cfg = dict(block_k=256, block_r=min(r_pow2, 64), num_warps=4, num_stages=3)
    else:
        cfg = dict(block_k=64, block_r=min(r_pow2, 128), num_warps=8, num_stages=3)
    cfg["block_k"] = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    cfg["block_r"] = min(cfg["block_r"], r_pow2)
    cfg["split_k"] = 1
    return cfg


def lora_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    stack_num: int,
    ranks: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    *,
    block_m: int,
    out: Optional[torch.Tensor] = None,
    block_k: Optional[int] = None,
    block_r: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    split_k: Optional[int] = None,
    check: bool = True,
    a_rows: Optional[torch.Tensor] = None,
    max_rank: Optional[int] = None,
) -> torch.Tensor:
    """Stacked, segmented shrink.

    Args:
        x: (s, K).
        weights: padded (num_slots, stack_num * R, K), same dtype as ``x``; or, with ``a_rows``, a
            packed (rows, K) arena.
        stack_num: c, modules stacked along dim 1 of ``weights``.
        ranks: (>= num_slots, c) int32, rank of each slot in each module (0: nothing to do).
        sorted_token_ids, chunk_slot, chunk_start, chunk_len: the chunk plan (int32); the grid
            is sized from ``chunk_slot``'s length, never from its contents.
        block_m: rows per chunk (a power of two >= 16).
        out: optional (s, c * R) output; allocated (uninitialised) when omitted.
        block_k, block_r, num_warps, num_stages, split_k: override ``shrink_config``; ``split_k``
            > 1 splits K over that many programs per tile (float32 partials, summed in order).
        check: validate the shapes (False: the caller has).
        a_rows: packed layout: (num_slots, c) int32, the first row in ``weights`` of each (slot,
            module) (read only where its rank is not 0); ``max_rank`` then gives R.
    Returns:
        (s, c * R) in ``x.dtype``; defined only where the contract says (own rank, adapter rows).
    """
    s, k = x.shape
    packed = a_rows is not None
    if packed:
        num_slots, cr, kw = a_rows.shape[0], stack_num * int(max_rank), weights.shape[1]
        if check and (weights.dim() != 2 or a_rows.dim() != 2 or a_rows.shape[1] != stack_num
                      or a_rows.stride(1) != 1 or a_rows.dtype != torch.int32):
            raise ValueError(f"lora_shrink: a packed A must be (rows, K) with an int32 (num_slots, "
                             f"{stack_num}) row table")
    else:
        num_slots, cr, kw = weights.shape
    if check and (kw != k or cr % stack_num):
        raise ValueError(f"lora_shrink: weights {tuple(weights.shape)} do not match x {tuple(x.shape)}"
                         f" with stack_num={stack_num}")
    r = cr // stack_num
    if check and (ranks.dim() != 2 or ranks.shape[1] != stack_num or ranks.stride(1) != 1):
        raise ValueError(f"lora_shrink: ranks must be (num_slots, {stack_num}) with unit column stride")
    if out is None:
        out = torch.empty(s, cr, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (s, cr) or out.dtype != x.dtype:
        raise ValueError(f"lora_shrink: out must be ({s}, {cr}) {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    cfg = shrink_config(block_m, r, k)
    block_k = block_k or cfg["block_k"]
    block_r = block_r or cfg["block_r"]
    num_rb = triton.cdiv(r, block_r)
    split_k = cfg["split_k"] if split_k is None else split_k
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"lora_shrink: split_k must be an integer of at least 1, got {split_k!r}")
    max_chunks = chunk_slot.shape[0]
    if s == 0 or max_chunks == 0 or r == 0:
        return out
    grid = (stack_num * num_rb * split_k, max_chunks)
    if split_k > 1:
        partials = torch.empty(split_k, s, cr, dtype=torch.float32, device=x.device)
        counts = torch.zeros(stack_num * num_rb * max_chunks, dtype=torch.int32, device=x.device)
        split_args = (partials, counts, partials.stride(0), partials.stride(1))
    else:
        split_args = (out, ranks, 0, 0)  # never read
    a_strides = (0,) + weights.stride() if packed else weights.stride()
    _lora_shrink_kernel[grid](
        x, weights, out, a_rows if packed else ranks,
        k, r, num_slots,
        x.stride(0), x.stride(1),
        *a_strides,
        out.stride(0), out.stride(1),
        ranks, ranks.stride(0), a_rows.stride(0) if packed else 0,
        sorted_token_ids, chunk_slot, chunk_start, chunk_len,
        *split_args,
        PACKED=packed,
        SPLIT_K=split_k,
        NUM_RB=num_rb,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        EVEN_K=(k % block_k == 0),
        # fp32 inputs: Triton's default on GPU is tf32, which would not match the reference
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out
