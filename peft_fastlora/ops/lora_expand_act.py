"""A folded gate/up site's LoRA expand and the gated MLP's ``act(gate) * up`` in one launch.

After the folded GEMM ``x @ [W_gate; W_up; A].T`` the decode path used to run the expand (adding
each row's gate and up deltas into the GEMM's output, a read and a write of both halves) and then
the act-mul (a second read of both halves, a write of the product). Here one program owns a
(row tile, column block): it reads the block of gate and of up once, adds the tile's deltas from
the shrink columns and B, and writes ``act(gate) * up`` only. Numerics are the two launches':
each delta added in float32 to the base value and rounded to the output dtype, then the act-mul's
roundings (``silu_mul.act_mul_rounded``).

The grid has two kinds of row tile: the plan's chunks (the rows of one adapter, gathered through
``sorted_token_ids``) and, after them, every ``BLOCK_M`` consecutive tokens, of which a program
takes only the rows of no adapter (``token_slot`` -1). Every row is written once: the plan puts
each row with a slot into exactly one chunk. A chunk whose slot is stale (past the weights) or
whose module has rank 0 adds no delta there but still writes its rows.

Weights are packed (``backend.packed``) and the shrink is read from the folded GEMM's columns
(``y_cols``: where each slot's A rows are). PDL as the expand's: the plan and the first B block
before the wait, the GEMM's output after it; but a program with no rows leaves before the wait
(the grid is sized for the fullest plan, and waiting programs would hold SM slots), except
program (0, 0), whose wait keeps the kernel from completing before the one it follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_support import interpreting
from . import pdl
from .expand_common import packed_row_stride
from .silu_mul import ACTIVATIONS, act_mul_rounded

BLOCK_K = 16  # rank columns per dot (the smallest tensor-core K); larger ranks loop
MAX_BLOCK_M = 16  # decode row tiles


@triton.jit
def _module(slot, valid, j, R, ranks_ptr, stride_rl, scalings_ptr, stride_sl, b_ptr, b_offs_ptr, y_cols_ptr,
            stride_tl, B_ALIGN: tl.constexpr):
    """(rank, scaling, first B element, B row stride, first shrink column) of module ``j`` of
    ``slot``; rank 0 where the program adds nothing (``valid`` False or the module untargeted)."""
    rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + j, mask=valid, other=0), R)
    used = rank > 0
    scaling = tl.load(scalings_ptr + slot * stride_sl + j, mask=used, other=0.0)
    b_off = tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + j, mask=used, other=0), B_ALIGN)
    y_col = tl.load(y_cols_ptr + slot * stride_tl + j, mask=used, other=0).to(tl.int64)
    return rank, scaling, b_ptr + b_off, packed_row_stride(rank, B_ALIGN), y_col


@triton.jit
def _b_block(b_rows, b_nstride, k, cols, col_mask, BLOCK_K: tl.constexpr):
    """B rows ``k .. k + BLOCK_K`` (rank) of columns ``cols``: (BLOCK_K, BLOCK_N), zeros past the
    packed row stride (the rank rounded up to the site's alignment; the shrink is masked by the
    rank itself, so the rows between are multiplied by zeros)."""
    offs_k = k + tl.arange(0, BLOCK_K)
    return tl.load(b_rows + cols[None, :] * b_nstride + offs_k[:, None],
                   mask=(offs_k < b_nstride)[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _delta(y_rows, row_mask, b_rows, b_nstride, rank, b_first, cols, col_mask,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The tile's unscaled delta ``y[:, :rank] @ B[:rank, cols]`` in float32 (zeros for rank 0);
    ``b_first`` is B's first block, loaded before the PDL wait."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if rank > 0:
        offs_k = tl.arange(0, BLOCK_K)
        yt = tl.load(y_rows + offs_k[None, :], mask=row_mask[:, None] & (offs_k < rank)[None, :], other=0.0)
        acc = tl.dot(yt, b_first, acc, input_precision=DOT_PRECISION)
        for k in range(BLOCK_K, rank, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            yt = tl.load(y_rows + offs_k[None, :], mask=row_mask[:, None] & (offs_k < rank)[None, :], other=0.0)
            bt = _b_block(b_rows, b_nstride, k, cols, col_mask, BLOCK_K)
            acc = tl.dot(yt, bt, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _lora_expand_act_kernel(
    y_ptr, b_ptr, gu_ptr, h_ptr,
    b_offs_ptr, y_cols_ptr, ranks_ptr, scalings_ptr, token_slot_ptr,
    sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    S, WIDTH, R, num_slots, MAX_CHUNKS,
    stride_ys, stride_gs, stride_hs,
    stride_rl, stride_sl, stride_tl,
    B_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GELU_TANH: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < WIDTH
    offs_m = tl.arange(0, BLOCK_M)
    # a chunk (one adapter's rows) or, past the plan, consecutive tokens (those of no adapter);
    # every load masked, so a plan of no chunks reads nothing
    is_chunk = pid < MAX_CHUNKS
    c = tl.minimum(pid, MAX_CHUNKS - 1)
    n_rows = tl.load(chunk_len_ptr + c, mask=is_chunk, other=0)
    start = tl.load(chunk_start_ptr + c, mask=is_chunk, other=0)
    chunk_rows = offs_m < n_rows
    chunk_tok = tl.load(sorted_ids_ptr + start + offs_m, mask=chunk_rows, other=0)
    slot = tl.load(chunk_slot_ptr + c, mask=is_chunk, other=-1)
    seq_tok = (pid - MAX_CHUNKS) * BLOCK_M + offs_m
    in_range = (seq_tok < S) & (seq_tok >= 0)
    seq_rows = in_range & (tl.load(token_slot_ptr + seq_tok, mask=in_range, other=0) == -1)
    tok = tl.where(is_chunk, chunk_tok, seq_tok)
    row_mask = tl.where(is_chunk, chunk_rows, seq_rows)
    tok = tok.to(tl.int64)
    idle = tl.max(row_mask.to(tl.int32), axis=0) == 0  # an unused chunk, or tokens that all have adapters
    if idle & ((pid > 0) | (tl.program_id(1) > 0)):
        # nothing to write: it leaves before the PDL wait, so its SM slot is free at once (the grid
        # is sized for the fullest plan). Program (0, 0) always waits, which is what keeps the
        # kernel from completing before the one it follows (pdl.py's rule, kept by one program).
        return
    valid = is_chunk & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    rank_g, scale_g, b_g, ns_g, ycol_g = _module(slot, valid, 0, R, ranks_ptr, stride_rl, scalings_ptr, stride_sl,
                                                 b_ptr, b_offs_ptr, y_cols_ptr, stride_tl, B_ALIGN)
    rank_u, scale_u, b_u, ns_u, ycol_u = _module(slot, valid, 1, R, ranks_ptr, stride_rl, scalings_ptr, stride_sl,
                                                 b_ptr, b_offs_ptr, y_cols_ptr, stride_tl, B_ALIGN)
    # B's first blocks before the wait (no kernel of the step writes them); empty for rank 0 (row
    # stride 0)
    bg0 = _b_block(b_g, ns_g, 0, cols, col_mask, BLOCK_K)
    bu0 = _b_block(b_u, ns_u, 0, cols, col_mask, BLOCK_K)
    pdl.wait(USE_PDL)
    if idle:
        return
    rows = gu_ptr + tok[:, None] * stride_gs
    mask = row_mask[:, None] & col_mask[None, :]
    dt = h_ptr.dtype.element_ty
    g = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(rows + (WIDTH + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
    y_rows = y_ptr + tok[:, None] * stride_ys
    dg = _delta(y_rows + ycol_g, row_mask, b_g, ns_g, rank_g, bg0, cols, col_mask,
                BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    du = _delta(y_rows + ycol_u, row_mask, b_u, ns_u, rank_u, bu0, cols, col_mask,
                BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    # the expand's rounding (the delta added in float32, the sum stored in the output dtype)
    g = (g + dg * scale_g).to(dt).to(tl.float32)
    u = (u + du * scale_u).to(dt).to(tl.float32)
    h = act_mul_rounded(g, u, dt, GELU_TANH, LIBDEVICE)
    tl.store(h_ptr + tok[:, None] * stride_hs + cols[None, :], h.to(dt), mask=mask)


def expand_act_config(width: int) -> dict:
    """Column block and warps: 128 columns (a 16-row tile of gate, up, their two B blocks and two
    accumulators fits four warps' registers), fewer for a narrow module."""
    return dict(block_n=min(128, max(16, triton.next_power_of_2(width))), num_warps=4)


def lora_expand_act(
    y: torch.Tensor,
    b: torch.Tensor,
    b_offs: torch.Tensor,
    y_cols: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    gate_up: torch.Tensor,
    token_slot: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    *,
    act: str,
    block_m: int,
    max_rank: int,
    b_align: int = 1,
    check: bool = True,
    block_n: int | None = None,
) -> torch.Tensor:
    """``act(gate + delta_gate) * (up + delta_up)`` for the rows of a folded gate/up GEMM.

    Args:
        y: (s, arena rows), the shrink: the GEMM's columns past ``gate_up``'s (unit column stride).
        b, b_offs, y_cols: a packed site of two modules (gate, up): the flat B arena, where each
            (slot, module)'s ``(width, rank)`` block starts (int64), where its shrink columns start
            in ``y`` (int32); ``b_align`` the site's block alignment (8 or 1).
        ranks, scalings: (>= num_slots, 2) int32 / float32, unit column stride.
        gate_up: (s, 2 * width): gate's columns then up's, the GEMM's base output (not written).
        token_slot: (>= s,) int32, each row's slot, -1 for none (the rows no chunk holds).
        sorted_token_ids, chunk_slot, chunk_start, chunk_len: the chunk plan.
        act: one of ``silu_mul.ACTIVATIONS``.
        block_m: the plan's row tile (at most ``MAX_BLOCK_M``); max_rank: the site's largest rank.
    Returns:
        a new (s, width) tensor.
    """
    s, width = gate_up.shape[0], gate_up.shape[1] // 2
    if check:
        if act not in ACTIVATIONS:
            raise ValueError(f"lora_expand_act: unknown activation {act!r}; the kernel takes {ACTIVATIONS}")
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
            raise ValueError(f"lora_expand_act: gate_up {tuple(gate_up.shape)} must be (s, 2 * width), unit "
                             "column stride")
        if y.dim() != 2 or y.shape[0] != s or y.stride(1) != 1 or y.dtype != gate_up.dtype or b.dtype != y.dtype:
            raise ValueError(f"lora_expand_act: y {tuple(y.shape)} {y.dtype} must hold one {gate_up.dtype} row per "
                             f"row of gate_up ({s}), unit column stride, B of its dtype")
        for name, t, dtype in (("b_offs", b_offs, torch.int64), ("y_cols", y_cols, torch.int32),
                               ("ranks", ranks, torch.int32), ("scalings", scalings, torch.float32)):
            if t.dim() != 2 or t.shape[1] != 2 or t.stride(1) != 1 or t.dtype != dtype:
                raise ValueError(f"lora_expand_act: {name} must be a (num_slots, 2) {dtype} table")
        if y_cols.stride() != b_offs.stride() or y_cols.shape != b_offs.shape:
            raise ValueError("lora_expand_act: y_cols must have b_offs' shape and strides")
        if block_m > MAX_BLOCK_M or token_slot.shape[0] < s:
            raise ValueError(f"lora_expand_act: row tiles of up to {MAX_BLOCK_M} (got {block_m}) and a slot per "
                             f"row ({token_slot.shape[0]} for {s})")
    h = torch.empty(s, width, dtype=gate_up.dtype, device=gate_up.device)
    if s == 0 or width == 0:
        return h
    max_chunks = chunk_slot.shape[0]
    cfg = expand_act_config(width)
    bn = block_n or cfg["block_n"]
    use_pdl = pdl.mode(gate_up, preamble=True)
    grid = (max_chunks + triton.cdiv(s, block_m), triton.cdiv(width, bn))
    _lora_expand_act_kernel[grid](
        y, b, gate_up, h,
        b_offs, y_cols, ranks, scalings, token_slot,
        sorted_token_ids, chunk_slot, chunk_start, chunk_len,
        s, width, max_rank, b_offs.shape[0], max_chunks,
        y.stride(0), gate_up.stride(0), h.stride(0),
        ranks.stride(0), scalings.stride(0), b_offs.stride(0),
        B_ALIGN=b_align,
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=BLOCK_K,
        GELU_TANH=act == "gelu_tanh",
        LIBDEVICE=not interpreting(),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl,
        num_warps=cfg["num_warps"],
        launch_pdl=use_pdl > 0,
    )
    return h


def lora_expand_act_reference(y, b, b_offs, y_cols, ranks, scalings, gate_up, token_slot, *, act: str):
    """Row by row in torch: each row's deltas from its slot's blocks (float32), rounded into gate
    and up, then ``silu_mul.act_mul_reference``."""
    from .silu_mul import act_mul_reference

    s, width = gate_up.shape[0], gate_up.shape[1] // 2
    gu = gate_up.float().clone()
    for t in range(s):
        slot = int(token_slot[t])
        if slot < 0 or slot >= b_offs.shape[0]:
            continue
        for j in range(2):
            rank = int(ranks[slot, j])
            if rank <= 0:
                continue
            off, col = int(b_offs[slot, j]), int(y_cols[slot, j])
            blk = b[off:off + width * rank].view(width, rank).float()
            gu[t, j * width:(j + 1) * width] += (y[t, col:col + rank].float() @ blk.T) * float(scalings[slot, j])
    gu = gu.to(gate_up.dtype)
    return act_mul_reference(gu[:, :width], gu[:, width:], act)
