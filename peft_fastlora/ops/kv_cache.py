"""Write a step's keys and values into a static KV cache at its device-side fill length, in one launch.

transformers' ``StaticLayer.update`` spends five kernels per layer on this (``arange``, the
position add, two ``index_copy_`` and the length increment). Here one kernel writes both k and v
at ``length + s``, reading ``length`` on the device (no host sync, so CUDA-graph safe). Given a
ticket (a zeroed int32 the caller keeps), the kernel also advances ``length`` by the positions
written: each program takes the ticket with an acquire-release atomic after it has read the length,
and the last one adds ``S`` and puts the ticket back to zero, so no program reads the new length and
no second kernel is needed. Without one, the caller advances it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernel_support import tl, triton
from . import pdl


@triton.jit
def _kv_cache_write_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, length_ptr, ticket_ptr,
    # dimensions
    num_heads, seq_len, max_len, head_dim,
    # strides: new k / v (batch, head, position), cache (batch, head, position); last dims contiguous
    k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, c_sb, c_sh, c_ss,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ADVANCE: tl.constexpr,  # the last program to take the ticket adds seq_len to the length
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py (the fill length is the step's: read after the wait)
):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    bh = tl.program_id(0)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    start = tl.load(length_ptr)
    pos = start.to(tl.int64) + offs_s
    # positions past the cache are dropped, never written out of bounds (the caller sizes caches)
    mask = ((offs_s < seq_len) & (pos < max_len))[:, None] & (offs_d < head_dim)[None, :]
    dst = b * c_sb + h * c_sh + pos[:, None] * c_ss + offs_d[None, :]
    k = tl.load(k_ptr + b * k_sb + h * k_sh + offs_s[:, None] * k_ss + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + b * v_sb + h * v_sh + offs_s[:, None] * v_ss + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)
    if ADVANCE:  # every program has read the length once the count reaches the grid's size
        programs = tl.num_programs(0) * tl.num_programs(1)
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == programs - 1:
            tl.store(length_ptr, start + seq_len)
            tl.atomic_xchg(ticket_ptr, 0)


def check_write_inputs(key, value, k_cache, v_cache, length, ticket) -> None:
    """Raise on inputs ``kv_cache_write`` does not take."""
    if key.shape != value.shape or key.dim() != 4:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be one (B, H, S, D) shape")
    bsz, heads, _, dim = key.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.dim() != 4:
        raise ValueError("the key and value caches must share one 4-D shape and strides")
    if k_cache.shape[0] < bsz or k_cache.shape[1] != heads or k_cache.shape[3] != dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} cannot hold states {tuple(key.shape)}")
    if len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise TypeError("states and caches must share one dtype")
    if any(t.stride(-1) != 1 for t in (key, value, k_cache, v_cache)):
        raise ValueError("the last dimension of the states and caches must be contiguous")
    if length.numel() != 1 or length.is_floating_point() or length.device != key.device:
        raise ValueError("length must be one integer on the states' device")
    if ticket is not None and (ticket.numel() != 1 or ticket.dtype != torch.int32 or ticket.device != key.device):
        raise ValueError("ticket must be one int32 on the states' device")


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   length: torch.Tensor, ticket: Optional[torch.Tensor] = None) -> None:
    """``k_cache[:B, :, length + s] = key[:, :, s]`` (and the same for values), for s < S.

    Args:
        key, value: (B, H, S, D), any strides with a contiguous last dimension.
        k_cache, v_cache: (B_cache >= B, H, L, D), the same dtype, last dimension contiguous, one
            shape and strides.
        length: a one-element integer tensor on the same device: the first position to write.
            Positions at or past L are not written.
        ticket: optional one-element int32 tensor on the same device, zero, that no launch running
            at the same time shares: then ``length`` is advanced by S in this launch (and the ticket
            left at zero); without it, ``length`` is left as it is.
    """
    check_write_inputs(key, value, k_cache, v_cache, length, ticket)
    bsz, heads, seq, dim = key.shape
    block_s = min(16, triton.next_power_of_2(max(seq, 1)))
    if not (bsz * heads and seq):
        if ticket is not None:
            length.add_(seq)  # no program to advance it (nothing to write)
        return
    use_pdl = pdl.mode(key)
    _kv_cache_write_kernel[(bsz * heads, triton.cdiv(seq, block_s))](
        key, value, k_cache, v_cache, length, ticket if ticket is not None else length,
        heads, seq, k_cache.shape[2], dim,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(dim), ADVANCE=ticket is not None, USE_PDL=use_pdl,
        num_warps=1 if dim <= 64 else 2, launch_pdl=use_pdl > 0)
