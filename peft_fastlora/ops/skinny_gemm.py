"""``y = x @ w.T`` for decode-sized ``x`` (a few rows) and a large weight, streaming the weight once.

A decode step's GEMMs read megabytes of weight for a handful of rows: their time is the weight's
bytes over the copy bandwidth, if the whole chip streams it. Each program here owns ``BLOCK_N``
output columns (rows of ``w``) for every row of ``x`` (up to ``BLOCK_M``) and walks the whole
reduction, so nothing is reduced twice and there is no second kernel (cuBLAS picks split-K for
these shapes, with a separate reduction launch). The product is computed as
``w_tile @ x_tile.T`` so that the weight's many columns, not the few rows, fill the tensor core's
M side.

Accumulation is float32, rounded once to the output dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(
    # pointers
    x_ptr, w_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides (unit stride on K for x and w, on N for y)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


class SkinnyConfig(NamedTuple):
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


MAX_ROWS = 128  # one program covers every row of x up to here; more rows tile over the grid's y


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                config: SkinnyConfig = SkinnyConfig()) -> torch.Tensor:
    """``x @ w.T``.

    Args:
        x: (M, K), unit stride on K.
        w: (N, K), unit stride on K (an ``nn.Linear`` weight, or rows of one).
        out: optional (M, N) output, unit stride on N; allocated when None.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: expected (M, K) and (N, K)")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) differ")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need unit stride on K")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected ({m}, {n}) {x.dtype}, unit stride on N")
    if m == 0 or n == 0:
        return out
    block_m = max(16, min(MAX_ROWS, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
    _skinny_gemm_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                              BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                              EVEN_K=k % config.block_k == 0,
                              num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(x.dtype)
