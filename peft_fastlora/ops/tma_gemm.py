"""``x @ w.T (+ bias)`` for a decode step of 65-128 rows: tensor-core tiles fed by TMA.

At a few rows a decode GEMM only streams its weight (``ops.stream_gemm``). At 65-128 rows the
arithmetic is no longer small beside the bytes (an 8B layer's gate/up at 128 rows needs about two
thirds of the H200's tensor-core rate to keep up with its weight's bytes), and ``stream_gemm``'s
pointer loads and ``BLOCK_N x 128`` tiles fall behind cuBLAS there. This kernel gives each program
all the step's rows (one ``BLOCK_M`` block) and ``BLOCK_N`` output columns over one of ``SPLIT_K``
ranges of the reduction. Its tiles of x and w come from tensor descriptors (the Hopper copy engine
moves them into shared memory: no address arithmetic in the warps, rows past the end read as
zeros), and Triton pipelines them ``num_stages`` deep into the tensor cores (wgmma). float32
accumulation.

Split-K partials, tickets and epilogues follow ``ops.stream_gemm``: with ``SPLIT_K > 1`` the ranges
write float32 partials to the caller's ``StreamWorkspace`` and the last range of a column block to
take its ticket (acquire-release) sums them in range order, adds the epilogue, stores, and puts the
ticket back to zero; ``add`` is a residual on the first columns, added before the one rounding;
``glu`` computes a fused [gate; up] weight's ``act(gate) * up`` in ``ops.silu_mul``'s roundings.
The caller picks the tiles per shape (``base_ops.stream_linears``: a table of the tiles that beat
cuBLAS on an H200).

Under PDL (``ops.pdl``) every program waits before its first load: the preamble is addresses only.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..kernel_support import AVAILABLE, tl, triton
from ..kernel_support import interpreting
from . import pdl
from .silu_mul import ACTIVATIONS
from . import stream_gemm as _stream
from .stream_gemm import (StreamWorkspace, _tile_dot, check_operands, checked_output, split_plan, store_output,
                          stream_gemm_reference)

if AVAILABLE:
    from triton.tools.tensor_descriptor import TensorDescriptor

MAX_ROWS = _stream.MAX_ROWS  # rows one program covers (split_plan's blocks); more take more row blocks


@triton.jit
def _tma_gemm_kernel(
    # tensor descriptors: x (M, K) in (BLOCK_M, BLOCK_K) tiles, w (N or 2N with GLU, K) in (BLOCK_N, BLOCK_K)
    x_desc, w_desc,
    # pointers
    bias_ptr, add_ptr, y_ptr, part_ptr, ticket_ptr,
    # dimensions (N: output columns; N_ADD: the first ones ``add`` covers)
    M, N, K, K_PER_SPLIT, N_ADD,
    # strides (unit stride on N for y and add)
    stride_ym, stride_am,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    GLU: tl.constexpr,  # 0: x @ w.T; 1 / 2: silu / gelu_tanh(x @ gate.T) * (x @ up.T), w = [gate; up]
    LIBDEVICE: tl.constexpr,  # GELU-tanh's tanh from libdevice (not under the interpreter)
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UPCAST: tl.constexpr,  # the dot in float32 ("ieee"): float32 inputs, or the interpreter
    USE_PDL: tl.constexpr,
):
    pdl.launch_dependents(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pdl.wait(USE_PDL)
    # the descriptors read zeros past K and past the last row of x or w: no masks in the loop
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([m0, k])
        acc = _tile_dot(x, w_desc.load([n0, k]), acc, UPCAST)  # x @ w.T
        if GLU:
            acc_up = _tile_dot(x, w_desc.load([N + n0, k]), acc_up, UPCAST)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if not GLU:
        acc_up = acc  # (unused)
    store_output(acc, acc_up, y_ptr, bias_ptr, add_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok,
                 m_ok, M, N, N_ADD, stride_ym, stride_am, pid_n, pid_k, pid_m, HAS_BIAS, HAS_ADD, GLU, LIBDEVICE,
                 SPLIT_K, False)


class TmaConfig(NamedTuple):
    block_n: int = 128
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 4


SHARED_BYTES = 220 * 1024  # what the pipeline's buffers may take of an SM's shared memory


def shared_bytes(config: TmaConfig, block_m: int, elem_bytes: int, glu: bool = False) -> int:
    """Shared memory of the config's pipeline: a tile of x and one (two with ``glu``) of w a stage."""
    return (block_m + config.block_n * (2 if glu else 1)) * config.block_k * elem_bytes * config.num_stages


def tma_aligned(t: torch.Tensor) -> bool:
    """A tensor descriptor can address ``t`` (2-D): unit stride on its columns, 16-byte aligned start
    and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def tma_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, config: TmaConfig = TmaConfig(),
             workspace: Optional[StreamWorkspace] = None, check: bool = True,
             add: Optional[torch.Tensor] = None, glu: Optional[str] = None) -> torch.Tensor:
    """``x @ w.T + bias`` (``F.linear``) through the TMA-fed kernel, plus ``add`` on the first
    columns when given. The arguments are ``ops.stream_gemm.stream_gemm``'s:

    Args:
        x: (M, K), unit stride on K, 16-byte aligned start and row stride (``tma_aligned``).
        w: (N, K), likewise: an ``nn.Linear`` weight, or rows of one.
        bias: optional (N,).
        out: optional (M, N) output, unit stride on N; allocated when None.
        config: tiles, split-K, warps and stages (``TmaConfig``).
        workspace: where a split-K launch keeps its partials (``StreamWorkspace``).
        add: optional (M, N_add <= N), unit stride on N_add, not overlapping ``out``: added to the
            first N_add output columns before the one rounding.
        glu: optional activation of ``ops.silu_mul.ACTIVATIONS``: ``w`` (and ``bias``) stack gate's
            rows over up's, and the output is ``act(x @ gate.T) * (x @ up.T)``, (M, N / 2). One K
            range, no ``add``.
    """
    if check:
        check_operands(x, w, bias)
        if x.numel() and w.numel() and not (tma_aligned(x) and tma_aligned(w)):  # empty: nothing read
            raise ValueError("x and w need unit stride on K and 16-byte aligned starts and row strides")
        if config.block_k % 16 or config.block_n < 16 or config.split_k < 1 or config.num_stages < 1:
            raise ValueError(f"config {config}: block_k a multiple of 16, block_n >= 16, split_k and stages >= 1")
    out, m, n, k = checked_output(x, w, out, add, glu, check, glu_takes=config.split_k == 1,
                                  glu_needs="split_k 1 and no add")
    if m == 0 or n == 0:
        return out
    if k == 0:  # nothing for a descriptor to read
        return out.copy_(stream_gemm_reference(x, w, bias, add=add, glu=glu))
    block_m, k_per, split, grid, part, ticket = split_plan(config, m, n, k, workspace, out)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [config.block_n, config.block_k])
    use_pdl = pdl.mode(x)
    _tma_gemm_kernel[grid](
        x_desc, w_desc, bias if bias is not None else w, add if add is not None else w, out, part, ticket,
        m, n, k, k_per, add.shape[1] if add is not None else 0,
        out.stride(0), add.stride(0) if add is not None else 0,
        HAS_BIAS=bias is not None, HAS_ADD=add is not None, GLU=0 if glu is None else 1 + ACTIVATIONS.index(glu),
        LIBDEVICE=not interpreting(), SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        UPCAST=x.dtype == torch.float32 or interpreting(), USE_PDL=use_pdl,
        num_warps=config.num_warps, launch_pdl=use_pdl > 0)
    return out
