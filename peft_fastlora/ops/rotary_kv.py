"""Rotary embedding and the KV-cache write of a step in one launch.

A decode step's attention otherwise runs ``ops.rotary`` (q and k rotated into new tensors) and then
``ops.kv_cache`` (the rotated k and v copied into the static cache at its fill length), and the
second reads what the first has just written: one dependent round trip through memory per layer.
Here each program rotates a block of heads of one token and stores query heads to a new q, key
heads (rotated) and the matching value heads straight into the cache. The roundings are
``ops.rotary``'s (compiled without FP contraction, as there), so q and the cache are bit-equal to
the two kernels'. Given a ticket, the last program advances the fill length, as in ``ops.kv_cache``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernel_support import tl, triton
from . import pdl
from .kv_cache import check_write_inputs
from .rotary import check_rotary_inputs, cos_sin_halves, rotate_halves


@triton.jit
def _rotary_kv_write_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, length_ptr, ticket_ptr,
    # dimensions
    seq_len, num_q_heads, num_heads, half, max_len,
    # strides (q, k, v: batch, head, position; cos/sin: batch, position; the caches: batch, head,
    # position, one set for both); last dimensions contiguous
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, c_sb, c_ss, kc_sb, kc_sh, kc_ss,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ADVANCE: tl.constexpr,  # the last program to take the ticket adds seq_len to the length
    USE_PDL: tl.constexpr,  # pdl.mode(); every input is the step's: all read after the wait
):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    s = token % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < half
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, b * c_sb + s * c_ss, half, offs_d, d_mask)
    start = tl.load(length_ptr)
    pos = start.to(tl.int64) + s

    # heads [0, num_q_heads) are query heads, the rest key heads
    is_q = heads < num_q_heads
    kh = tl.where(is_q, 0, heads - num_q_heads).to(tl.int64)
    qh = tl.where(is_q, heads, 0).to(tl.int64)
    src = tl.where(is_q[:, None], q_ptr + b * q_sb + qh[:, None] * q_sh + s * q_ss,
                   k_ptr + b * k_sb + kh[:, None] * k_sh + s * k_ss)
    dim = 2 * half
    cache_at = b * kc_sb + kh[:, None] * kc_sh + pos * kc_ss
    dst = tl.where(is_q[:, None], q_out_ptr + ((b * num_q_heads + qh[:, None]) * seq_len + s) * dim,
                   k_cache_ptr + cache_at)
    # positions past the cache are dropped, as ops.kv_cache does (one flag per head of the block)
    in_cache = (tl.zeros([BLOCK_H], dtype=tl.int64) + pos) < max_len
    mask = ((heads < num_heads) & (is_q | in_cache))[:, None] & d_mask[None, :]
    x1 = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2, q_out_ptr.dtype.element_ty)
    tl.store(dst + offs_d[None, :], y1, mask=mask)
    tl.store(dst + half + offs_d[None, :], y2, mask=mask)
    # the value heads of this block's key heads, copied as they are
    v_mask = ((heads >= num_q_heads) & (heads < num_heads) & in_cache)[:, None] & d_mask[None, :]
    v_src = v_ptr + b * v_sb + kh[:, None] * v_sh + s * v_ss
    v_dst = v_cache_ptr + cache_at
    tl.store(v_dst + offs_d[None, :], tl.load(v_src + offs_d[None, :], mask=v_mask), mask=v_mask)
    tl.store(v_dst + half + offs_d[None, :], tl.load(v_src + half + offs_d[None, :], mask=v_mask), mask=v_mask)
    if ADVANCE:  # every program has read the length once the count reaches the grid's size
        programs = tl.num_programs(0) * tl.num_programs(1)
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == programs - 1:
            tl.store(length_ptr, start + seq_len)
            tl.atomic_xchg(ticket_ptr, 0)


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor,
                    ticket: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ops.rotary.apply_rotary`` and then ``ops.kv_cache.kv_cache_write`` of its keys and ``v``,
    in one launch; the arguments are theirs. Returns the rotated q, a new contiguous tensor."""
    cos, sin, c_sb = check_rotary_inputs(q, k, cos, sin)
    check_write_inputs(k, v, k_cache, v_cache, length, ticket)
    bsz, num_q, seq, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not (bsz * seq):
        if ticket is not None:
            length.add_(seq)  # no program to advance it (nothing to write)
        return q_out
    num_heads = num_q + k.shape[1]
    block_h = min(16, triton.next_power_of_2(num_heads))
    use_pdl = pdl.mode(q)
    _rotary_kv_write_kernel[(bsz * seq, triton.cdiv(num_heads, block_h))](
        q, k, v, cos, sin, q_out, k_cache, v_cache, length, ticket if ticket is not None else length,
        seq, num_q, num_heads, dim // 2, k_cache.shape[2],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), c_sb, cos.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(max(dim // 2, 1)), ADVANCE=ticket is not None,
        USE_PDL=use_pdl, num_warps=4, enable_fp_fusion=False, launch_pdl=use_pdl > 0)
    return q_out


__all__ = ["rotary_kv_write"]
