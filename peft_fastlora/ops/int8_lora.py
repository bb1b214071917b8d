"""An 8-bit matmul's int32 product dequantized straight to the model's dtype, each row's LoRA delta
added in the same pass.

bitsandbytes' 8-bit ``Linear`` without outlier columns (``llm_int8_threshold=0``) computes
``x @ W.T`` as: x cast to fp16 and quantized row by row, one int8 GEMM with int32 results, a
dequantization ``acc * row_scale * col_scale / 127^2`` rounded to fp16, then a cast to the model's
dtype; a LoRA layer over it adds its delta in another pass over the output. One launch here takes
the int32 product and writes

    out = round(float(round_fp16(deq(acc))) + scaling * tail[:, the row's A rows] @ B.T)

- ``deq`` in the order and roundings of bitsandbytes' CUDA kernel, ``((acc * row) * col) * c``
  with its constant ``c`` for 1/127^2, so the base part is, bit for bit, what bitsandbytes gives
  on CUDA (``dequantize_reference``);
- ``tail``: ``x @ A.T`` over every row of the site's packed A arena (one GEMM, as a folded site's
  tail is): each row takes the columns of its own adapter's blocks, scaled by its scaling, and
  the product with that adapter's B (read from the packed arena, ``backend.packed``) is added in
  float32 before the one rounding. A program reads a module's slot tables whole (one load each),
  then takes the tail columns of the module's blocks ``TAIL_BLOCK`` at a time: each column's
  block found by comparing it with every block's span, the rows' tail values kept where the column
  is their adapter's, B gathered column by column, one dot (no per-adapter chain of loads and dots).

Rows with no adapter (slot -1) get the base part alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..kernel_support import interpreting, tl, triton

DEQUANT_SCALE = 6.200012e-05  # bitsandbytes' CUDA constant for 1 / (127 * 127), as it writes it
MAX_MODULES = 4  # stacked modules a launch takes (q/k/v: 3)
BLOCK_N = 64
TAIL_BLOCK = 64  # tail columns (over the adapters' blocks) one dot takes


class Int8Lora(NamedTuple):
    """The LoRA part of a launch: a site's packed weights and the batch's slots."""

    tail: torch.Tensor  # (M, R): x @ A.T over every arena row, x's dtype
    b: torch.Tensor  # the flat packed B: slot s, module j's (width_j, rank) block at b_offs[s, j]
    token_slot: torch.Tensor  # (>= M,) int32, each row's slot (-1: none)
    ranks: torch.Tensor  # (num_slots, c) int32 (0: the slot's adapter has no block there)
    scalings: torch.Tensor  # (num_slots, c) float32
    a_rows: torch.Tensor  # (num_slots, c): each block's first arena row (its first tail column)
    b_offs: torch.Tensor  # (num_slots, c) int64
    offsets: Sequence[int]  # c + 1 column offsets of the stacked modules in the output


@triton.jit
def _int8_dequant_lora_kernel(
    acc_ptr, stride_am, row_ptr, col_ptr, out_ptr, stride_om,
    tail_ptr, stride_tm, b_ptr, slot_ptr,
    ranks_ptr, stride_rl, scal_ptr, stride_sl, a_rows_ptr, stride_al, b_offs_ptr, stride_bl,
    M, N, num_slots,
    OFF0, OFF1, OFF2, OFF3, OFF4,  # module column offsets; unused ones repeat the end
    SCALE: tl.constexpr,
    C: tl.constexpr,  # stacked modules (0: no LoRA)
    KB: tl.constexpr,  # tail columns a dot takes
    SLOTS: tl.constexpr,  # num_slots' power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # float32 dots with no TF32 rounding (float32 inputs; the interpreter)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    prod = tl.load(acc_ptr + rows64[:, None] * stride_am + cols[None, :], mask=mask, other=0)
    rscale = tl.load(row_ptr + rows, mask=row_ok, other=0.0)
    cscale = tl.load(col_ptr + cols, mask=col_ok, other=0.0)
    deq = (prod.to(tl.float32) * rscale[:, None]) * cscale[None, :] * SCALE
    out_ty = out_ptr.dtype.element_ty
    res = deq.to(tl.float16).to(tl.float32).to(out_ty).to(tl.float32)
    if C > 0:
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
        has_slot = row_ok & (slot >= 0)
        safe_slot = tl.where(has_slot, slot, 0)
        ks0 = tl.arange(0, KB)
        for j in tl.static_range(C):
            lo = tl.where(j == 0, OFF0, tl.where(j == 1, OFF1, tl.where(j == 2, OFF2, OFF3)))
            hi = tl.where(j == 0, OFF1, tl.where(j == 1, OFF2, tl.where(j == 2, OFF3, OFF4)))
            in_module = col_ok & (cols >= lo) & (cols < hi)
            if tl.max(in_module.to(tl.int32)) > 0:
                # every slot's block of module j in one load of each table
                sl = tl.arange(0, SLOTS)
                sl_ok = sl < num_slots
                r_s = tl.load(ranks_ptr + sl * stride_rl + j, mask=sl_ok, other=0)
                a_s = tl.load(a_rows_ptr + sl * stride_al + j, mask=sl_ok, other=0).to(tl.int32)
                b_s = tl.load(b_offs_ptr + sl * stride_bl + j, mask=sl_ok, other=0)
                live = r_s > 0
                k_lo = tl.min(tl.where(live, a_s, 2147483647))
                k_hi = tl.max(tl.where(live, a_s + r_s, 0))
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, KB):
                    ks = k0 + ks0
                    # each column's block: its slot, first column, B offset and rank (-1: free)
                    hit = (ks[:, None] >= a_s[None, :]) & (ks[:, None] < (a_s + r_s)[None, :])
                    owner = tl.max(tl.where(hit, sl[None, :], -1), axis=1)
                    first = tl.sum(tl.where(hit, a_s[None, :], 0), axis=1)
                    rank = tl.sum(tl.where(hit, r_s[None, :], 0), axis=1)
                    boff = tl.sum(tl.where(hit, b_s[None, :], 0), axis=1)
                    used = owner >= 0
                    keep = (owner[None, :] == slot[:, None]) & used[None, :] & has_slot[:, None]
                    t = tl.load(tail_ptr + rows64[:, None] * stride_tm + ks[None, :], mask=keep, other=0.0)
                    bt = tl.load(b_ptr + boff[:, None] + (cols - lo)[None, :].to(tl.int64) * rank[:, None]
                                 + (ks - first)[:, None], mask=used[:, None] & in_module[None, :], other=0.0)
                    if UPCAST:
                        part = tl.dot(t.to(tl.float32), bt.to(tl.float32), part, input_precision="ieee")
                    else:
                        part = tl.dot(t, bt, part)
                scaling = tl.load(scal_ptr + safe_slot * stride_sl + j, mask=has_slot, other=0.0)
                res += part * scaling[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], res.to(out_ty), mask=mask)


def dequantize_reference(acc: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' CUDA dequantization in torch: ``((acc * row) * col) * c`` in float32, rounded
    to fp16, then cast to ``dtype``."""
    deq = (acc.float() * row_stats.float()[:, None]) * col_stats.float()[None, :] * DEQUANT_SCALE
    return deq.to(torch.float16).to(dtype)


def int8_dequant_lora_reference(acc, row_stats, col_stats, dtype, lora: Optional[Int8Lora] = None):
    """The launch's result in torch (the tests' oracle): the dequantized base, then each row's delta
    in float32 (its adapter's tail columns, scaled, times B) and one rounding."""
    out = dequantize_reference(acc, row_stats, col_stats, dtype)
    if lora is None:
        return out
    res = out.float()
    slots = lora.token_slot[: acc.shape[0]].long().tolist()
    ranks, scal = lora.ranks.tolist(), lora.scalings.tolist()
    a_rows, b_offs = lora.a_rows.tolist(), lora.b_offs.tolist()
    for m, s in enumerate(slots):
        if s < 0:
            continue
        for j, (lo, hi) in enumerate(zip(lora.offsets[:-1], lora.offsets[1:])):
            r = ranks[s][j]
            if r == 0 or hi == lo:
                continue
            t = lora.tail[m, a_rows[s][j]: a_rows[s][j] + r].float()
            b = lora.b[b_offs[s][j]: b_offs[s][j] + (hi - lo) * r].view(hi - lo, r).float()
            res[m, lo:hi] += (t @ b.T) * scal[s][j]
    return res.to(dtype)


def int8_dequant_lora(acc: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
                      dtype: torch.dtype, lora: Optional[Int8Lora] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``acc`` (M, N) int32 (unit column stride), ``row_stats`` (M,) and ``col_stats`` (N,) float32:
    the dequantized (M, N) output in ``dtype`` with ``lora``'s deltas added (module doc)."""
    m, n = acc.shape
    if acc.dtype != torch.int32 or acc.stride(1) != 1:
        raise ValueError(f"int8_dequant_lora: acc must be int32 with unit column stride, got {acc.dtype} "
                         f"strides {acc.stride()}")
    if row_stats.shape != (m,) or col_stats.shape != (n,):
        raise ValueError(f"int8_dequant_lora: scales {tuple(row_stats.shape)} / {tuple(col_stats.shape)} "
                         f"do not fit a product of {(m, n)}")
    out = torch.empty(m, n, dtype=dtype, device=acc.device) if out is None else out
    if m == 0 or n == 0:
        return out
    row_stats, col_stats = row_stats.float().contiguous(), col_stats.float().contiguous()
    c = 0 if lora is None else len(lora.offsets) - 1
    if c > MAX_MODULES:
        raise ValueError(f"int8_dequant_lora: {c} stacked modules; a launch takes {MAX_MODULES}")
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m))
    if lora is None:
        tail = b = slot = ranks = scal = a_rows = b_offs = acc
        strides, offs, num_slots = (0, 0, 0, 0, 0), (n,) * 5, 0
    else:
        tail, b, slot = lora.tail, lora.b, lora.token_slot
        ranks, scal, a_rows, b_offs = lora.ranks, lora.scalings, lora.a_rows, lora.b_offs
        if tail.shape[0] < m or tail.stride(1) != 1 or slot.shape[0] < m:
            raise ValueError("int8_dequant_lora: the tail and the token slots must cover every row "
                             "(the tail with unit column stride)")
        strides = (tail.stride(0), ranks.stride(0), scal.stride(0), a_rows.stride(0), b_offs.stride(0))
        offs = tuple(lora.offsets) + (lora.offsets[-1],) * (5 - len(lora.offsets))
        num_slots = ranks.shape[0]
    _int8_dequant_lora_kernel[grid](
        acc, acc.stride(0), row_stats, col_stats, out, out.stride(0),
        tail, strides[0], b, slot,
        ranks, strides[1], scal, strides[2], a_rows, strides[3], b_offs, strides[4],
        m, n, num_slots, *offs,
        SCALE=DEQUANT_SCALE, C=c, KB=TAIL_BLOCK, SLOTS=triton.next_power_of_2(max(num_slots, 2)),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        UPCAST=interpreting() or dtype == torch.float32,
        num_warps=4,
    )
    return out
