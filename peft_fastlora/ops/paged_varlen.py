"""Variable-length attention that reads keys and values from a paged cache in place.

A continuous-batching step packs many requests' queries into one row: request i has the queries
``q[cu_q[i]:cu_q[i+1]]`` (the last ones of its sequence) and ``cu_k[i+1] - cu_k[i]`` keys (its whole
sequence, new tokens included, written to the cache before). The cache holds them in pages of
``pages.size`` slots: key ``j`` of request i sits at slot ``pages.starts[pages.cu[i] + j // size] + j %
size``. Reading them in place saves the copy of every key and value a gather makes first, and the
page table is what the engine's host builds per step, a few entries a request where a slot index
per key (a list of every key's slot, made in Python) costs the host time in the context's length.

One program per (query block, kv head, split). A query block holds the queries of one request
times the ``G`` query heads that share the kv head, as the rows of one tile, so that a request's
keys are read once for all ``G`` heads. Two launches: requests with one query (decode rows) take
one program each with ``G`` rows (padded to 16); requests with more take blocks of ``BLOCK_Q``
queries filling 64 rows (a step without them launches only the first). The keys a block attends
(causal, aligned to the end of the request's keys; an optional left window) are cut into ``S``
contiguous ranges, one per split, so that long contexts spread over the GPU; each split writes
(log2-sum-exp, normalised output) to an fp32 workspace and a second kernel merges them in a fixed
order. With one split the first kernel writes the output.

Program ids map to requests without the host: in the blocks' launch, block ``p`` belongs to the
request ``i`` with ``cu_q[i] // BLOCK_Q + i <= p < cu_q[i+1] // BLOCK_Q + i + 1`` (a binary search
over ``cu_q``); both grids are sized from static shapes (``B``; ``Tq // BLOCK_Q + B``) and
programs with nothing to do return at once. Nothing syncs with the host: safe to capture in a
CUDA graph. A query with no key to attend gets zeros. ``paged_varlen_reference`` is the torch
reference.
"""

from __future__ import annotations

import torch

from typing import NamedTuple, Optional

from ..kernel_support import interpreting, num_sms, tl, triton


class Pages(NamedTuple):
    """Where each request's keys sit in a paged cache: request i's pages are the slots
    ``starts[cu[i]:cu[i+1]]`` (int32: the slot of each page's first key), of ``size`` keys each."""

    starts: torch.Tensor
    cu: torch.Tensor
    size: int

    def slots(self, request: int, keys: int) -> torch.Tensor:
        """The cache slots of request ``request``'s first ``keys`` keys, in order (host side)."""
        first = int(self.cu[request])
        j = torch.arange(keys, device=self.starts.device)
        return self.starts[first + j // self.size].long() + j % self.size

_LOG2E = 1.4426950408889634


@triton.jit
def _request_of(cu_q_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold block ``pid`` (binary search over ``cu_q``)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_varlen_kernel(
    q_ptr, k_ptr, v_ptr, page_ptr, cu_page_ptr, cu_q_ptr, cu_k_ptr, out_ptr, ws_o_ptr, ws_lse_ptr,
    num_seqs, page_size, scale_log2, window_left,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ws_s, stride_ws_t, stride_ws_h, stride_lse_s, stride_lse_t,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, SINGLES: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if SINGLES == 1:  # one program a request, for the requests with one query (decode rows)
        seq = pid
    else:
        seq = _request_of(cu_q_ptr, pid, num_seqs, BLOCK_Q)
    q0 = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q0
    k0 = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k0
    first = 0
    if SINGLES == 1:
        if q_len != 1:
            return
    else:
        first = (pid - (q0 // BLOCK_Q + seq)) * BLOCK_Q  # the block's first query within its request
        if SINGLES == 2:  # the singles' launch serves those
            if q_len == 1:
                return
        if first >= q_len:
            return
    rows = tl.arange(0, BLOCK_M)
    t = first + rows // G_PAD  # query within the request
    head = rows % G_PAD
    row_ok = (rows < BLOCK_Q * G_PAD) & (t < q_len) & (head < G)
    pos = k_len - q_len + t  # the query's position: the keys it sees end here
    pages = page_ptr + tl.load(cu_page_ptr + seq)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    h = kvh * G + head
    q = tl.load(q_ptr + (q0 + t)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # the keys this block attends, and this split's share of them
    last_q = tl.minimum(first + BLOCK_Q, q_len) - 1
    k_end = tl.minimum(k_len - q_len + last_q + 1, k_len)
    k_begin = tl.where(window_left >= 0, tl.maximum(k_len - q_len + first - window_left, 0), 0)
    n_blocks = tl.cdiv(k_end - k_begin, BLOCK_N)
    per_split = tl.cdiv(n_blocks, SPLITS)
    lo = k_begin + split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, k_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < hi
        slot = tl.load(pages + n // page_size, mask=n_ok, other=0).to(tl.int64) + n % page_size
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2
        seen = n_ok[None, :] & (n[None, :] <= pos[:, None])
        seen = seen & ((window_left < 0) | (n[None, :] >= pos[:, None] - window_left))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tok = q0 + t
    if SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(ws_lse_ptr + split * stride_lse_s + tok * stride_lse_t + h, lse, mask=row_ok)
        tl.store(ws_o_ptr + split * stride_ws_s + tok[:, None] * stride_ws_t + h[:, None] * stride_ws_h
                 + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(ws_o_ptr, ws_lse_ptr, out_ptr, num_tokens_ptr,
                         stride_ws_s, stride_ws_t, stride_ws_h, stride_lse_s, stride_lse_t,
                         stride_ot, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr):
    tok = tl.program_id(0)
    h = tl.program_id(1)
    if tok >= tl.load(num_tokens_ptr):
        return
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    m = tl.full([1], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(ws_lse_ptr + s * stride_lse_s + tok * stride_lse_t + h + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(ws_lse_ptr + s * stride_lse_s + tok * stride_lse_t + h + tl.zeros([1], tl.int32))
        w = tl.exp2(lse - m_safe)
        part = tl.load(ws_o_ptr + s * stride_ws_s + tok * stride_ws_t + h * stride_ws_h + offs_d, mask=d_ok, other=0.0)
        acc += w * part
        total += w
    o = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_varlen_config(num_tokens: int, num_seqs: int, kv_heads: int, groups: int, max_q: int, max_k: int,
                        device: torch.device, head_dim: int = 128) -> dict:
    """Tiles and splits for a step (host ints only: the same for every replay of a shape).

    Requests with one query (decode rows) take one program each, its rows the group's query heads
    (``SINGLES`` launch). Where a request may have more (``max_q > 1``; a graphed step's bound is its
    padded token count, so decode-only steps count here too), a second launch takes the others in
    blocks of queries that fill 64 rows (``BLOCK_Q``). Key tiles of 64 (32 past head dim 128, so
    that a head dim of 256 neither spills nor outgrows an sm80's shared memory). Splits spread the
    keys until the singles' grid covers the GPU twice."""
    g_pad = triton.next_power_of_2(groups)
    block_q = max(1, 64 // g_pad)
    block_n = 16 if interpreting() else (64 if head_dim <= 128 else 32)
    key_blocks = max(1, triton.cdiv(max(max_k, 1), block_n))
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    splits = max(1, min(16, key_blocks, triton.cdiv(2 * sms, max(1, num_seqs * kv_heads))))
    return dict(G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=max(16, block_q * g_pad), SINGLE_M=max(16, g_pad),
                BLOCK_N=block_n, SPLITS=splits, blocks=num_tokens // block_q + num_seqs if max_q > 1 else 0)


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: Pages,
                           cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                           window_left: int = -1) -> torch.Tensor:
    """Attention of each request's queries to its own keys, causal and aligned to the end of its keys.

    q: (Tq, H, D); k_cache / v_cache: (slots, KVH, D), last dim contiguous; pages: where each
    request's keys sit (``Pages``: int32 starts and (B + 1,) int32 offsets, covering every request
    with queries); cu_q / cu_k: (B + 1,) int32 (a request past the last real one has no queries);
    max_q / max_k: bounds of the per-request lengths (host ints). Queries past ``cu_q[-1]`` are
    left zero. Returns (Tq, H, D) in q's dtype."""
    num_tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the head dimension of q and of the cache must be contiguous")
    groups = heads // kv_heads
    num_seqs = cu_q.shape[0] - 1
    cfg = paged_varlen_config(num_tokens, num_seqs, kv_heads, groups, max_q, max_k, q.device, dim)
    splits = cfg["SPLITS"]
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(dim))
    if splits > 1:
        ws_o = torch.empty(splits, num_tokens, heads, dim, dtype=torch.float32, device=q.device)
        # every split program writes each of its rows (an empty range: -inf), the merge reads real rows only
        ws_lse = torch.empty(splits, num_tokens, heads, dtype=torch.float32, device=q.device)
    else:
        ws_o = ws_lse = out  # unused
    if pages.size < 1:
        raise ValueError(f"pages of {pages.size} slots")
    args = (q, k_cache, v_cache, pages.starts, pages.cu, cu_q, cu_k, out, ws_o, ws_lse, num_seqs, pages.size,
            scale * _LOG2E, window_left,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), *(ws_o.stride()[:3] if splits > 1 else (0, 0, 0)),
            *(ws_lse.stride()[:2] if splits > 1 else (0, 0)))
    meta = dict(G=groups, G_PAD=cfg["G_PAD"], BLOCK_N=cfg["BLOCK_N"], D=dim, D_PAD=d_pad, SPLITS=splits,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    _paged_varlen_kernel[(num_seqs, kv_heads, splits)](*args, **meta, BLOCK_Q=1, BLOCK_M=cfg["SINGLE_M"], SINGLES=1,
                                                       num_warps=4)
    if cfg["blocks"]:
        _paged_varlen_kernel[(cfg["blocks"], kv_heads, splits)](
            *args, **meta, BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=cfg["BLOCK_M"], SINGLES=2,
            num_warps=8 if cfg["BLOCK_M"] >= 128 else 4)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, heads)](
            ws_o, ws_lse, out, cu_q[num_seqs:], ws_o.stride(0), ws_o.stride(1), ws_o.stride(2),
            ws_lse.stride(0), ws_lse.stride(1), out.stride(0), out.stride(1), D=dim, D_PAD=d_pad, SPLITS=splits)
    return out


def paged_varlen_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: Optional[Pages],
                           cu_q, cu_k, scale: float, window_left: int = -1) -> torch.Tensor:
    """``paged_varlen_attention`` in torch, request by request (syncs with the host): the keys of
    request i are ``k_cache[pages.slots(i, keys)]`` (``pages`` None: the rows ``cu_k[i]:cu_k[i+1]``
    themselves). Rows past ``cu_q[-1]`` are zero."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k_cache.shape[1]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq == 0:
            continue
        rows = slice(ck[i], ck[i + 1]) if pages is None else pages.slots(i, lk)
        k, v = (t[rows].repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k_cache, v_cache))
        pos_q = torch.arange(lk - lq, lk, device=q.device)[:, None]
        pos_k = torch.arange(lk, device=q.device)[None, :]
        allowed = pos_k <= pos_q
        if window_left >= 0:
            allowed &= pos_k >= pos_q - window_left
        o = torch.nn.functional.scaled_dot_product_attention(q[cq[i]:cq[i + 1]].transpose(0, 1), k, v,
                                                             attn_mask=allowed, scale=scale)
        out[cq[i]:cq[i + 1]] = o.transpose(0, 1)
    return out
