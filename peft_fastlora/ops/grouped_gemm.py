"""Grouped gather GEMM for routed experts: ``out[p] (+)= scale[g(p)] * x[p // IN_DIV] @ W[g(p)].T``.

A mixture-of-experts layer sends each token to ``k`` experts: ``p = t * k + j`` is the pair of
token ``t`` and its ``j``-th choice. Each pair belongs to one *group* (its expert for the base
projections; its (adapter slot, expert) for the LoRA factors) or to none (a key of -1: a row
without an adapter, an expert id out of range). ``plan_groups`` sorts the pairs by group and
cuts each group into chunks of at most ``block_m`` pairs, on the device and without reading
anything back (so a decode step with it can be captured in a CUDA graph: routing changes every
step, the grid does not). The kernel computes one (chunk, column block) per program and reads
each group's weight block once per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..kernel_support import tl, triton


@dataclass(frozen=True)
class GroupPlan:
    """Pairs sorted by group, in chunks (all int32 on the pairs' device).

    Attributes:
        sorted_ids: (P,) pair indices, grouped; pairs without a group last.
        chunk_group: (max_chunks,) the group of each chunk, -1 for an unused one.
        chunk_start: (max_chunks,) each chunk's first position in ``sorted_ids``.
        chunk_len: (max_chunks,) pairs in each chunk (0 for an unused one).
        block_m: the most pairs in a chunk.
    """

    sorted_ids: torch.Tensor
    chunk_group: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    block_m: int


def max_chunks_for(pairs: int, groups: int, block_m: int) -> int:
    """The most chunks ``pairs`` pairs over ``groups`` groups can take: one partial chunk per
    group that has pairs, at most ``min(pairs, groups)`` of them, beyond the full ones."""
    return -(-pairs // block_m) + min(pairs, groups) if pairs else 0


def plan_groups(keys: torch.Tensor, num_groups: int, block_m: int) -> GroupPlan:
    """The chunk plan of pairs whose groups are ``keys`` ((P,) integers; outside
    ``[0, num_groups)``: no group). Device work only; the plan's sizes depend on P alone."""
    p = keys.numel()
    dev = keys.device
    keys = keys.reshape(-1).long()
    valid = (keys >= 0) & (keys < num_groups)
    k = torch.where(valid, keys, torch.full_like(keys, num_groups))
    order = torch.argsort(k, stable=True)
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=dev).scatter_add_(0, k, torch.ones_like(k))
    counts = counts[:num_groups]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    group_start = torch.cumsum(counts, 0) - counts
    n_chunks = max_chunks_for(p, num_groups, block_m)
    b = torch.arange(n_chunks, device=dev)
    g = torch.searchsorted(block_end, b, right=True)
    used = g < num_groups
    gc = g.clamp(max=num_groups - 1)
    local = b - (block_end[gc] - blocks[gc])
    length = torch.where(used, (counts[gc] - local * block_m).clamp(0, block_m), torch.zeros_like(b))
    group = torch.where(used & (length > 0), gc, torch.full_like(gc, -1))
    start = torch.where(used, group_start[gc] + local * block_m, torch.zeros_like(b))
    i32 = torch.int32
    return GroupPlan(order.to(i32), group.to(i32), start.to(i32), length.to(i32), block_m)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr,
    sorted_ids_ptr, chunk_group_ptr, chunk_start_ptr, chunk_len_ptr,
    N, K, num_groups,
    stride_xm, stride_xk,
    stride_wg, stride_wn, stride_wk,
    stride_om, stride_on,
    IN_DIV: tl.constexpr,  # the input row of pair p: p // IN_DIV
    SCALE_DIV: tl.constexpr,  # the scale of group g: scale[g // SCALE_DIV]
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.load(chunk_group_ptr + chunk)
    if group < 0:
        return
    if group >= num_groups:  # a stale plan must never read past the weights
        return
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_len_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    pair = tl.load(sorted_ids_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    row = pair // IN_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + group.to(tl.int64) * stride_wg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        a = tl.load(x_ptr + row[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_base + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + group // SCALE_DIV)
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, w, out, plan_pairs: int, in_div: int):
    if w.dim() != 3 or x.dim() != 2 or out.dim() != 2:
        raise ValueError(f"grouped_gemm: x (rows, K), w (groups, N, K) and out (P, N) expected, got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")
    if w.shape[2] != x.shape[1] or out.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_gemm: w {tuple(w.shape)} does not match x {tuple(x.shape)} and "
                         f"out {tuple(out.shape)}")
    if out.shape[0] != plan_pairs or x.shape[0] * in_div != plan_pairs:
        raise ValueError(f"grouped_gemm: {plan_pairs} pairs, but x has {x.shape[0]} rows (x {in_div}) "
                         f"and out {out.shape[0]}")


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, plan: GroupPlan, out: torch.Tensor, *, in_div: int = 1,
                 scale: Optional[torch.Tensor] = None, scale_div: int = 1, accumulate: bool = False) -> torch.Tensor:
    """``out[p] = scale * x[p // in_div] @ w[g].T`` for every pair ``p`` of group ``g`` in ``plan``
    (plus ``out[p]`` when ``accumulate``); rows of pairs without a group are left as they were.

    Args:
        x: (rows, K) inputs; pair ``p`` reads row ``p // in_div``.
        w: (groups, N, K) weights, any strides.
        plan: ``plan_groups`` over the pairs' groups.
        out: (P, N) output, written in place and returned.
        scale: optional float32 table: group ``g`` is scaled by ``scale[g // scale_div]``.
    """
    _check(x, w, out, plan.sorted_ids.numel(), in_div)
    n, k = w.shape[1], w.shape[2]
    chunks = plan.chunk_group.numel()
    if chunks == 0 or n == 0:
        return out
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (chunks, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, w, out, scale if scale is not None else out,
        plan.sorted_ids, plan.chunk_group, plan.chunk_start, plan.chunk_len,
        n, k, w.shape[0],
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        IN_DIV=in_div, SCALE_DIV=scale_div, HAS_SCALE=scale is not None, ACCUMULATE=accumulate,
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, out: torch.Tensor, *,
                           in_div: int = 1, scale: Optional[torch.Tensor] = None, scale_div: int = 1,
                           accumulate: bool = False) -> torch.Tensor:
    """What ``grouped_gemm`` computes, with torch ops and one GEMM per group present (reads the
    groups back: the torch backend's path and the kernel's oracle). ``keys``: (P,) each pair's group."""
    _check(x, w, out, keys.numel(), in_div)
    keys = keys.reshape(-1).long()
    for g in torch.unique(keys).tolist():
        if g < 0 or g >= w.shape[0]:
            continue
        pairs = (keys == g).nonzero().flatten()
        y = x[pairs // in_div].float() @ w[g].float().T
        if scale is not None:
            y = y * scale[g // scale_div].float()
        if accumulate:
            y = y + out[pairs].float()
        out[pairs] = y.to(out.dtype)
    return out
