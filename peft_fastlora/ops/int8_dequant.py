"""An 8-bit matmul's int32 product dequantized straight to the model's dtype, optionally with an
addend (a LoRA delta computed beside the matmul) summed in the same pass.

bitsandbytes' 8-bit ``Linear`` without outlier columns (``llm_int8_threshold=0``) computes
``x @ W.T`` as: x cast to fp16 and quantized row by row, one int8 GEMM with int32 results, a
dequantization ``acc * row_scale * col_scale / 127^2`` rounded to fp16, then a cast to the model's
dtype. One launch here takes the int32 product and writes

    out = round(float(round_fp16(deq(acc))) + addend)

with ``deq`` in the order and roundings of bitsandbytes' CUDA kernel, ``((acc * row) * col) * c``
and its constant ``c`` for 1/127^2: without an addend the result is, bit for bit, what
bitsandbytes gives on CUDA (``dequantize_reference``), in one launch where it has two; with one it
is that output plus the addend, rounded once, as adding the two tensors rounds.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernel_support import tl, triton

DEQUANT_SCALE = 6.200012e-05  # bitsandbytes' CUDA constant for 1 / (127 * 127), as it writes it
BLOCK_N = 64


@triton.jit
def _int8_dequant_kernel(
    acc_ptr, stride_am, row_ptr, col_ptr, out_ptr, stride_om, add_ptr, stride_dm,
    M, N,
    SCALE: tl.constexpr,
    ADD: tl.constexpr,  # whether add_ptr holds an addend
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    res = deq.to(tl.float16).to(tl.float32).to(out_ty)
    if ADD:
        extra = tl.load(add_ptr + rows64[:, None] * stride_dm + cols[None, :], mask=mask, other=0.0)
        res = (res.to(tl.float32) + extra.to(tl.float32)).to(out_ty)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], res, mask=mask)


def dequantize_reference(acc: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
                         dtype: torch.dtype, addend: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bitsandbytes' CUDA dequantization in torch: ``((acc * row) * col) * c`` in float32, rounded
    to fp16, then cast to ``dtype``; plus ``addend`` where given."""
    deq = (acc.float() * row_stats.float()[:, None]) * col_stats.float()[None, :] * DEQUANT_SCALE
    out = deq.to(torch.float16).to(dtype)
    return out if addend is None else out + addend


def int8_dequant(acc: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, dtype: torch.dtype,
                 addend: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``acc`` (M, N) int32 (unit column stride), ``row_stats`` (M,) and ``col_stats`` (N,) float32,
    ``addend`` (M, N) in ``dtype`` (unit column stride) or None: the (M, N) output in ``dtype``
    (module doc)."""
    m, n = acc.shape
    if acc.dtype != torch.int32 or acc.stride(1) != 1:
        raise ValueError(f"int8_dequant: acc must be int32 with unit column stride, got {acc.dtype} "
                         f"strides {acc.stride()}")
    if row_stats.shape != (m,) or col_stats.shape != (n,):
        raise ValueError(f"int8_dequant: scales {tuple(row_stats.shape)} / {tuple(col_stats.shape)} "
                         f"do not fit a product of {(m, n)}")
    if addend is not None and (addend.shape != (m, n) or addend.dtype != dtype or addend.stride(1) != 1
                               or addend.device != acc.device):
        raise ValueError(f"int8_dequant: the addend must be ({m}, {n}) {dtype} with unit column stride on "
                         f"{acc.device}, got {tuple(addend.shape)} {addend.dtype} strides {addend.stride()} on "
                         f"{addend.device}")
    out = torch.empty(m, n, dtype=dtype, device=acc.device) if out is None else out
    if m == 0 or n == 0:
        return out
    row_stats, col_stats = row_stats.float().contiguous(), col_stats.float().contiguous()
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m))
    add = addend if addend is not None else acc
    _int8_dequant_kernel[grid](
        acc, acc.stride(0), row_stats, col_stats, out, out.stride(0), add, add.stride(0) if addend is not None else 0,
        m, n, SCALE=DEQUANT_SCALE, ADD=addend is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, num_warps=4,
    )
    return out
