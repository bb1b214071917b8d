"""Decode attention over a static KV cache: one query token per row, grouped-query heads, split-KV.

``out[b, 0, h] = softmax(scale * q[b, h] . k[b, h // G, :] + mask[b, :]) @ v[b, h // G, :]``
with ``G = H / KVH`` query heads per kv head (the repeated K/V is never materialised).

Stage 1 (``_decode_attention_split_kernel``): one program per (row, kv head, split). It holds the G query heads of
its kv head as the M rows of a tile (padded to 16 for ``tl.dot``). It first reads the row's mask
(L bytes, the same for all programs of the row) to find the span [first, last] of attended
positions; K/V outside the span are never read (in a static cache: the left padding and the slots
not yet filled), so only filled positions cost cache bytes. The span's KV blocks are dealt to the
splits round-robin (``split, split + S, ...``), so the splits share the filled part evenly however
long it is. Inside the span, K/V loads are predicated on the span only, not on the mask values,
so that they need not wait for the mask load and the loop can pipeline; a masked hole inside the
span is read and then masked out of the softmax. Where the scan finds the span dense (every position
attended, none with an additive value other than 0: a static cache's mask), the blocks do not read
the mask again: that load is one a block's scores would otherwise wait on. The program writes
(log2-sum-exp, normalised partial output) per split to a small fp32 workspace, or the final output
when there is one split.

Under PDL the split program may scan the mask before its wait (the config's ``prewait``), so that the scan's
round trip overlaps the kernels before it; q and every load the softmax uses come after the wait.

Stage 2 (``_decode_attention_combine_kernel``): one program per (row, query head) merges the S partials in a fixed
order (deterministic, no atomics).

Everything is sized from static shapes (no host sync, no data-dependent grid): safe to capture in
a CUDA graph. A row with no attended position at all gets a zero output (sdpa would give NaN).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernel_support import tl, triton
from ..env import INTERPRETER_SMS
from ..kernel_support import interpreting, num_sms
from . import pdl

_LOG2E = 1.4426950408889634


@triton.jit
def _attended(m_base, offs, L, stride_ml, mask_min, MASK_IS_BOOL: tl.constexpr):
    """Which positions of ``offs`` the mask row attends (False past L), and which of those add
    nothing to the score (a bool mask's all do; an additive mask's where its value is 0)."""
    in_range = offs < L
    if MASK_IS_BOOL:
        ok = in_range & (tl.load(m_base + offs * stride_ml, mask=in_range, other=0) != 0)
        plain = ok
    else:
        val = tl.load(m_base + offs * stride_ml, mask=in_range, other=float("-inf")).to(tl.float32)
        ok = in_range & (val > mask_min)
        plain = ok & (val == 0.0)
    return ok, plain


@triton.jit
def _load_q(q_ptr, row_offset, heads, stride_qh, offs_d, stride_qd, h_mask, d_mask, dt, UPCAST: tl.constexpr):
    """The (BLOCK_H, BLOCK_D) query tile of one kv head's query heads, in ``dt`` (fp32 with UPCAST:
    the interpreter keeps bf16 as raw uint16, so arithmetic on it is wrong unless upcast)."""
    q = tl.load(q_ptr + row_offset + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    return q.to(tl.float32) if UPCAST else q.to(dt)


@triton.jit
def _decode_attention_split_kernel(
    # pointers
    q_ptr,  # (B, H, D) through strides
    k_ptr,  # (B, KVH, L, D)
    v_ptr,  # (B, KVH, L, D)
    mask_ptr,  # (B, L): uint8 (1 = attend) or float (additive)
    out_ptr,  # (B, H, D): written when NUM_SPLITS == 1
    part_o_ptr,  # (B, H, NUM_SPLITS, D) fp32, contiguous: written when NUM_SPLITS > 1
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32, contiguous
    # dimensions
    L,
    D,
    KVH,
    G,  # query heads per kv head
    qk_scale,  # scaling * log2(e), or scaling alone with a softcap
    softcap,
    mask_min,  # additive mask values <= this are "masked" (finfo(mask dtype).min; -inf too)
    # strides
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_mb, stride_ml,
    stride_ob, stride_oh, stride_od,
    # meta-parameters
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,  # mask positions read per step of the span scan
    MASK_IS_BOOL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (fp32 inputs, or the interpreter)
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py
    EARLY_SPAN: tl.constexpr,  # scan the mask before the PDL wait (no PDL kernel writes it)
    DENSE_SPANS: tl.constexpr = True,  # a dense span's blocks skip the mask (the config's ``dense_spans``)
):
    pdl.launch_dependents(USE_PDL)
    if not EARLY_SPAN:
        pdl.wait(USE_PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // KVH
    kvh = pid % KVH
    b64 = b.to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < G
    d_mask = offs_d < D
    heads = kvh * G + offs_h  # the query heads of this kv head

    if not EARLY_SPAN:  # the q load overlaps the mask scan
        q = _load_q(q_ptr, b64 * stride_qb, heads, stride_qh, offs_d, stride_qd, h_mask, d_mask,
                    k_ptr.dtype.element_ty, UPCAST)
    k_base = k_ptr + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    m_base = mask_ptr + b64 * stride_mb

    # 1. the attended span [lo, hi) of this row, from the mask alone (L bytes per row, L2-hot
    #    for all programs of the row after the first): K/V outside it are never read
    # (int32 tensors from the start: a loop-carried variable may not change type)
    lo = tl.full([], 0, tl.int32) + L
    hi = tl.full([], 0, tl.int32)
    n_plain = tl.full([], 0, tl.int32)
    for c0 in range(0, L, BLOCK_SCAN):
        offs_c = c0 + tl.arange(0, BLOCK_SCAN)
        valid_c, plain_c = _attended(m_base, offs_c, L, stride_ml, mask_min, MASK_IS_BOOL)
        lo = tl.minimum(lo, tl.min(tl.where(valid_c, offs_c, L), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(valid_c, offs_c + 1, 0), axis=0))
        n_plain += tl.sum(plain_c.to(tl.int32), axis=0)
    # a span every position of which is attended and adds nothing (a static cache's usual mask):
    # the blocks need not read the mask again (a dependent load the loop would wait on)
    dense = (n_plain == hi - lo) & DENSE_SPANS
    if EARLY_SPAN:
        pdl.wait(USE_PDL)

        q = _load_q(q_ptr, b64 * stride_qb, heads, stride_qh, offs_d, stride_qd, h_mask, d_mask,
                    k_ptr.dtype.element_ty, UPCAST)

    # 2. this split's blocks of the span: lo_blk + split, + NUM_SPLITS, ... (strided, so the
    #    splits share the span evenly whatever its length)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for blk in range(lo // BLOCK_N + split, tl.cdiv(hi, BLOCK_N), NUM_SPLITS):
        offs = blk * BLOCK_N + offs_n
        span = (offs >= lo) & (offs < hi)
        # K/V predicated on the span only (not on the mask values): the loads do not wait for
        # the mask load, so the loop pipelines; a hole inside the span is read, then masked
        kv_mask = span[:, None] & d_mask[None, :]
        k = tl.load(k_base + offs[:, None] * stride_kl + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs[:, None] * stride_vl + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if dense:
            valid = span
            madd = tl.zeros([BLOCK_N], dtype=tl.float32)
        elif MASK_IS_BOOL:
            valid = span & (tl.load(m_base + offs * stride_ml, mask=span, other=0) != 0)
            madd = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            madd = tl.load(m_base + offs * stride_ml, mask=span, other=float("-inf")).to(tl.float32)
            valid = span & (madd > mask_min)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # fp16/bf16 products, fp32 accumulation
        # scores in the log2 domain: exp2 is the native instruction
        if HAS_SOFTCAP:
            x = s * qk_scale / softcap
            # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) <= 1: no overflow for any x
            e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        if not MASK_IS_BOOL:
            # masked entries may be finfo.min: scaling them would overflow, and they are dropped
            s = s + tl.where(valid, madd, 0.0)[None, :] * 1.4426950408889634
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a block with nothing attended (a hole) keeps m at -inf: exp2(-inf - -inf) would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o = tl.where(has[:, None], o, 0.0)
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        H = KVH * G
        row = (b64 * H + heads) * NUM_SPLITS + split  # (BLOCK_H,)
        tl.store(part_o_ptr + row[:, None] * D + offs_d[None, :], o, mask=hd_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_attention_combine_kernel(
    # pointers
    part_o_ptr,  # (B, H, NUM_SPLITS, D) fp32, contiguous
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32, contiguous
    out_ptr,  # (B, H, D) through strides
    # dimensions
    H,
    D,
    # strides
    stride_ob, stride_oh, stride_od,
    # meta-parameters
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    base = pid.to(tl.int64) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split attended anything: all weights 0
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(w, axis=0)
    res = num / tl.where(den > 0.0, den, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


# the shape classes' launch values, chosen from a sweep of every launch value by shape on an H200
# (``benchmarks/bench_attention.py --grid``); a call may override them (``decode_attention``'s
# keyword arguments)
MID_BLOCK_N = 128  # block_n at one to two programs per SM: fewer, longer trips over each span
# one-warp programs over LEAN_BLOCK_N positions a step where rows x kv heads give LEAN_MIN_PROGRAMS
# or more programs per SM (head dims <= 128): a program's softmax then needs no barrier between
# warps, and several times more programs share an SM; block_n 64 at two to three programs per SM
LEAN_MIN_PROGRAMS = 7
LEAN_BLOCK_N = 16
_PREWAITS = ("off", "span")


def decode_attention_config(batch: int, kv_heads: int, groups: int, kv_len: int, head_dim: int,
                            device: torch.device, sms: Optional[int] = None) -> dict:
    """Launch parameters by shape class (no autotuning: graphs need a fixed launch).

    - ``block_h``: the query heads of one kv head, padded to 16 (the smallest ``tl.dot`` M).
    - ``block_n``, ``num_warps``: 64 cache positions per step and four warps (32 positions for head
      dims over 128, to bound registers); ``MID_BLOCK_N`` positions where rows x kv heads give one
      to two programs per SM and no split; one warp over ``LEAN_BLOCK_N`` positions from
      ``LEAN_MIN_PROGRAMS`` programs per SM.
    - ``num_splits``: enough (row, kv head, split) programs for ~4 per SM; 1 once rows x kv heads
      reach one per SM (then the first kernel writes the output and the combine is skipped).
    - ``prewait``: what a program does before its PDL wait: "span" (the mask scan) where the span
      is split (few programs, each short: the scan's round trip is much of its time), else "off"
      (with one program per (row, kv head) the early scans measured costing more than they hide).
      The mask is safe to read early: no PDL kernel writes one (torch's ops build it, and a kernel
      launched without PDL completes before any later one starts).
    - ``dense_spans``: a dense span's blocks skip the mask, outside the one-to-three-programs-an-SM
      class (there, skipping it measured slower than reading it).

    ``sms``: the device's streaming multiprocessors (default: the device's own; 4 off CUDA).
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(groups))
    sms = sms if sms is not None else _sm_count(device)
    pairs = batch * kv_heads
    block_n = 64 if block_d <= 128 else 32
    mid = block_d <= 128 and sms <= pairs < 3 * sms
    if mid and pairs < 2 * sms:
        block_n = MID_BLOCK_N
    num_blocks = triton.cdiv(kv_len, block_n)
    num_splits = 1 if pairs >= sms else min(num_blocks, triton.cdiv(4 * sms, pairs), 64)
    num_warps = 4
    if block_d <= 128 and pairs >= LEAN_MIN_PROGRAMS * sms:
        block_n, num_warps = LEAN_BLOCK_N, 1
    return dict(block_h=block_h, block_n=block_n, block_d=block_d, num_splits=max(1, num_splits),
                num_warps=num_warps, num_stages=2, prewait="span" if num_splits > 1 else "off",
                dense_spans=not mid)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: Optional[float] = None,
    softcap: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    prewait: Optional[str] = None,
    dense_spans: Optional[bool] = None,
) -> torch.Tensor:
    """Attention of one query token per row over a static KV cache.

    Args:
        q: (B, H, 1, D), any strides.
        k, v: (B, KVH, L, D), any strides (a static cache's buffers or views of them), same dtype
            as ``q``; ``H`` a multiple of ``KVH``.
        mask: (B or 1, 1, 1, L): bool (True = attend) or float, added to the scores (values at the
            dtype's minimum or -inf = masked). Blocks with no attended position are not read. It
            may be read before the PDL wait: no kernel launched with PDL may write it.
        scaling: score scale (default ``D ** -0.5``).
        softcap: logit soft-capping ``softcap * tanh(score / softcap)``, before the mask.
        out: optional (B, 1, H, D) output in ``q.dtype``.
        num_splits, block_n, num_warps, num_stages, prewait, dense_spans: override
            ``decode_attention_config`` (benchmarks compare launch values with them).
    Returns:
        (B, 1, H, D) in ``q.dtype``: the layout ``sdpa_attention_forward`` returns.
    """
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"decode_attention: q must be (B, H, 1, D), got {tuple(q.shape)}")
    bsz, heads, _, dim = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != dim:
        raise ValueError(f"decode_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match "
                         f"q {tuple(q.shape)}")
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads for {kv_heads} kv heads")
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != kv_len \
            or mask.shape[0] not in (1, bsz):
        raise ValueError(f"decode_attention: mask {tuple(mask.shape)} is not (B, 1, 1, {kv_len})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: dtypes q {q.dtype}, k {k.dtype}, v {v.dtype} differ")
    groups = heads // kv_heads
    cfg = decode_attention_config(bsz, kv_heads, groups, kv_len, dim, q.device)
    if block_n is not None:
        cfg["block_n"] = block_n
    if num_splits is not None:
        cfg["num_splits"] = num_splits
    if prewait is not None:
        cfg["prewait"] = prewait
    if dense_spans is not None:
        cfg["dense_spans"] = bool(dense_spans)
    if cfg["prewait"] not in _PREWAITS:
        raise ValueError(f"decode_attention: prewait {cfg['prewait']!r} is not one of {_PREWAITS}")
    cfg["num_splits"] = max(1, min(cfg["num_splits"], triton.cdiv(kv_len, cfg["block_n"])))
    splits = cfg["num_splits"]

    if out is None:
        out = torch.empty(bsz, 1, heads, dim, device=q.device, dtype=q.dtype)
    elif out.shape != (bsz, 1, heads, dim) or out.dtype != q.dtype:
        raise ValueError(f"decode_attention: out {tuple(out.shape)} {out.dtype} is not "
                         f"({bsz}, 1, {heads}, {dim}) {q.dtype}")
    if mask.dtype == torch.bool:
        mask2 = mask.view(torch.uint8)  # same bytes; Triton reads it as plain uint8
        mask_min = 0.0
    elif mask.is_floating_point():
        mask2 = mask
        mask_min = float(torch.finfo(mask.dtype).min)
    else:
        raise ValueError(f"decode_attention: mask dtype {mask.dtype} is neither bool nor float")
    stride_mb = mask2.stride(0) if mask2.shape[0] == bsz and bsz > 1 else 0
    if splits > 1:
        part_o = torch.empty(bsz, heads, splits, dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(bsz, heads, splits, device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused
    scale = float(scaling) if scaling is not None else dim ** -0.5
    has_softcap = softcap is not None and softcap > 0
    upcast = q.dtype == torch.float32 or interpreting()
    use_pdl = pdl.mode(q)

    _decode_attention_split_kernel[(bsz * kv_heads, splits)](
        q, k, v, mask2, out, part_o, part_lse,
        kv_len, dim, kv_heads, groups,
        scale if has_softcap else scale * _LOG2E,
        float(softcap) if has_softcap else 1.0,
        mask_min,
        q.stride(0), q.stride(1), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        stride_mb, mask2.stride(3),
        out.stride(0), out.stride(2), out.stride(3),
        NUM_SPLITS=splits,
        BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], BLOCK_D=cfg["block_d"],
        BLOCK_SCAN=min(2048, max(16, triton.next_power_of_2(kv_len))),
        MASK_IS_BOOL=mask.dtype == torch.bool,
        HAS_SOFTCAP=has_softcap,
        UPCAST=upcast,
        USE_PDL=use_pdl,
        EARLY_SPAN=cfg["prewait"] == "span",
        DENSE_SPANS=cfg["dense_spans"],
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
        launch_pdl=use_pdl > 0,
    )
    if splits > 1:
        _decode_attention_combine_kernel[(bsz * heads,)](
            part_o, part_lse, out,
            heads, dim,
            out.stride(0), out.stride(2), out.stride(3),
            NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
            BLOCK_D=cfg["block_d"],
            USE_PDL=use_pdl,
            num_warps=4 if cfg["block_d"] >= 128 else 2,
            launch_pdl=use_pdl > 0,
        )
    return out


def decode_attention_reference(q, k, v, mask, scaling=None, softcap=None) -> torch.Tensor:
    """Plain torch: repeat K/V to every head, masked softmax in fp32. (B, 1, H, D) in q.dtype.

    Rows with no attended position give zeros, as the kernel does.
    """
    bsz, heads, _, dim = q.shape
    g = heads // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * (scaling if scaling is not None else dim ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask.dtype == torch.bool:
        valid = mask
    else:
        valid = mask > torch.finfo(mask.dtype).min
        s = s + mask.float()
    s = s.masked_fill(~valid, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2).to(q.dtype)


__all__ = ["decode_attention", "decode_attention_config", "decode_attention_reference"]
