"""LoRA of an embedding layer: a per-token column lookup of A, and the rows of added tokens.

Both read each token's slot from ``token_slot`` (-1: no adapter) rather than from the chunk plan:
a lookup has no tile to share between tokens, so one program simply takes a block of tokens. The
lookup's A comes padded, ``(num_slots, rank, vocab)``, or packed (``backend.packed``): a
``(rows, vocab)`` arena with each slot's first row and rank in tables.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernel_support import tl, triton

@triton.jit
def _lora_embedding_a_kernel(
    # pointers
    ids_ptr,  # (s,) int32 / int64
    w_ptr,  # padded: (num_slots, rank, vocab); packed: (rows, vocab)
    extra_ptr,  # (num_slots, n_extra, rank); ignored unless HAS_EXTRA
    out_ptr,  # (s, rank)
    a_rows_ptr, ranks_ptr,  # packed: each slot's first row and rank (column 0 of (num_slots, c) tables)
    # dimensions
    s, rank, vocab, n_extra, num_slots,
    # strides
    stride_wl, stride_wr, stride_wv,
    stride_el, stride_ee, stride_er,
    stride_os, stride_or,
    stride_tl,  # row stride of the packed tables
    # batch info
    token_slot_ptr,  # (s,) int32
    # meta-parameters
    PACKED: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < s
    slot = tl.load(token_slot_ptr + offs_t, mask=t_mask, other=-1)
    ids = tl.load(ids_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
    has = (slot >= 0) & (slot < num_slots)
    slot64 = tl.where(has, slot, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    in_vocab = has & (ids >= 0) & (ids < vocab)
    if PACKED:  # rows past the slot's own rank belong to another block: not read
        row0 = tl.load(a_rows_ptr + slot64 * stride_tl, mask=has, other=0).to(tl.int64)
        rk = tl.load(ranks_ptr + slot64 * stride_tl, mask=has, other=0)
        w = tl.load(w_ptr + (row0[:, None] + offs_r[None, :]) * stride_wr + ids[:, None] * stride_wv,
                    mask=in_vocab[:, None] & r_mask[None, :] & (offs_r[None, :] < rk[:, None]), other=0.0)
    else:
        w = tl.load(w_ptr + slot64[:, None] * stride_wl + offs_r[None, :] * stride_wr
                    + ids[:, None] * stride_wv,
                    mask=in_vocab[:, None] & r_mask[None, :], other=0.0)
    if HAS_EXTRA:
        e_idx = ids - vocab
        is_extra = has & (e_idx >= 0) & (e_idx < n_extra)
        e = tl.load(extra_ptr + slot64[:, None] * stride_el + e_idx[:, None] * stride_ee
                    + offs_r[None, :] * stride_er,
                    mask=is_extra[:, None] & r_mask[None, :], other=0.0)
        w = tl.where(is_extra[:, None], e, w)
    # every row is written: rows with no adapter (or an id out of range) get zeros
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_os + offs_r[None, :] * stride_or, w,
             mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_extra_token_kernel(
    # pointers
    ids_ptr,  # (s,)
    extra_ptr,  # (num_slots, n_extra, D)
    out_ptr,  # (s, D)
    # dimensions
    D, vocab, n_extra, num_slots,
    # strides
    stride_el, stride_ee, stride_ed,
    stride_os, stride_od,
    # batch info
    token_slot_ptr,  # (s,) int32
    # meta-parameters
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(token_slot_ptr + t)
    e_idx = tl.load(ids_ptr + t).to(tl.int64) - vocab
    if slot < 0:
        return
    if slot >= num_slots:
        return
    if e_idx < 0:  # a token of the base vocabulary: the base embedding already holds it
        return
    if e_idx >= n_extra:
        return
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    row = tl.load(extra_ptr + slot.to(tl.int64) * stride_el + e_idx * stride_ee + offs_d * stride_ed,
                  mask=d_mask)
    tl.store(out_ptr + t.to(tl.int64) * stride_os + offs_d * stride_od, row, mask=d_mask)


def lora_embedding_a(
    input_ids: torch.Tensor,
    weights: torch.Tensor,
    token_slot: torch.Tensor,
    vocab_size: int,
    extra_embeddings: Optional[torch.Tensor] = None,
    *,
    block_t: Optional[int] = None,
    num_warps: int = 4,
    check: bool = True,
    a_rows: Optional[torch.Tensor] = None,
    ranks: Optional[torch.Tensor] = None,
    max_rank: Optional[int] = None,
) -> torch.Tensor:
    """``out[t] = weights[slot_t, :, id_t]`` (or ``extra_embeddings[slot_t, id_t - vocab_size]``).

    Args:
        input_ids: (s,) int32 or int64.
        weights: (num_slots, rank, vocab_size); or packed, (rows, vocab_size) with ``a_rows`` and
            ``ranks`` ((num_slots, c) tables, column 0 read: int32 first rows and ranks; columns
            past a slot's rank are zero) and ``max_rank`` (the output's width).
        token_slot: (s,) int32, -1 for tokens with no adapter.
        vocab_size: ids at or past it are added tokens.
        extra_embeddings: (num_slots, n_extra, rank) or None.
    Returns:
        (s, rank) in ``weights.dtype``; zero for tokens with no adapter and for ids that are in
        neither table (the kernel cannot raise without a host sync).
    """
    s = input_ids.shape[0]
    packed = a_rows is not None
    if packed:
        num_slots, rank, vocab = a_rows.shape[0], int(max_rank), weights.shape[1]
        if check and (weights.dim() != 2 or ranks is None or a_rows.stride() != ranks.stride()
                      or a_rows.dtype != torch.int32 or ranks.dtype != torch.int32):
            raise ValueError("lora_embedding_a: packed A must be (rows, vocab) with int32 row and rank "
                             "tables of one layout")
    else:
        num_slots, rank, vocab = weights.shape
    if check and (vocab != vocab_size or token_slot.shape[0] < s):
        raise ValueError(f"lora_embedding_a: weights {tuple(weights.shape)}, vocab_size {vocab_size}"
                         f" and token_slot {tuple(token_slot.shape)} do not agree")
    out = torch.empty(s, rank, dtype=weights.dtype, device=weights.device)
    if s == 0 or rank == 0:
        return out.zero_()
    has_extra = extra_embeddings is not None
    extra = extra_embeddings if has_extra else weights  # a valid pointer the kernel never reads
    n_extra = extra_embeddings.shape[1] if has_extra else 0
    es = extra.stride() if has_extra else (0, 0, 0)
    block_t = block_t or (16 if s <= 256 else 64)
    ws = (0,) + weights.stride() if packed else weights.stride()
    _lora_embedding_a_kernel[(triton.cdiv(s, block_t),)](
        input_ids, weights, extra, out, a_rows if packed else token_slot, ranks if packed else token_slot,
        s, rank, vocab, n_extra, num_slots,
        *ws,
        es[0], es[1], es[2],
        out.stride(0), out.stride(1),
        a_rows.stride(0) if packed else 0,
        token_slot,
        PACKED=packed,
        HAS_EXTRA=has_extra,
        BLOCK_T=block_t,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=num_warps,
    )
    return out


def lora_extra_token_embedding(
    input_ids: torch.Tensor,
    output: torch.Tensor,
    extra_embeddings: torch.Tensor,
    token_slot: torch.Tensor,
    vocab_size: int,
    *,
    block_d: Optional[int] = None,
    num_warps: int = 4,
    check: bool = True,
) -> torch.Tensor:
    """``output[t] = extra_embeddings[slot_t, id_t - vocab_size]`` for added tokens of rows with an
    adapter, in place; every other row of ``output`` is left untouched.

    Args:
        input_ids: (s,); output: (s, D); extra_embeddings: (num_slots, n_extra, D);
        token_slot: (s,) int32.
    Returns:
        ``output``.
    """
    s = input_ids.shape[0]
    num_slots, n_extra, d = extra_embeddings.shape
    if check and (tuple(output.shape) != (s, d) or token_slot.shape[0] < s):
        raise ValueError(f"lora_extra_token_embedding: output {tuple(output.shape)}, extra "
                         f"{tuple(extra_embeddings.shape)} and {s} ids do not agree")
    if s == 0 or d == 0 or n_extra == 0:
        return output
    block_d = block_d or min(1024, max(16, triton.next_power_of_2(d)))
    _lora_extra_token_kernel[(s, triton.cdiv(d, block_d))](
        input_ids, extra_embeddings, output,
        d, vocab_size, n_extra, num_slots,
        extra_embeddings.stride(0), extra_embeddings.stride(1), extra_embeddings.stride(2),
        output.stride(0), output.stride(1),
        token_slot,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return output
