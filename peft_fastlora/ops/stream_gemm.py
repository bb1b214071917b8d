"""``x @ w.T (+ bias)`` for the few rows of a decode step: a GEMM that streams the weight.

With a handful of rows the GEMM reads its weight once and does little else, so its time is the
weight's bytes over the memory bandwidth, plus how long the kernel takes to reach full bandwidth
and to drain. cuBLAS covers these shapes with few tiles along the output and a split-K reduction
in a second kernel. Here each program owns ``BLOCK_N`` output columns (rows of ``w``) and one of
``SPLIT_K`` ranges of the reduction, streaming its tiles through a deep pipeline, and
``w_tile @ x_tile.T`` puts the weight's rows, not the few rows of ``x``, on the tensor core's M
side. float32 accumulation. The caller picks the tiles per shape (``base_ops.stream_linears``, the
best measured on an H200).

With ``SPLIT_K > 1`` the ranges' partial sums go to a float32 workspace; the last program of a
column block to finish (a ticket per block, taken with an acquire-release atomic) adds them in
range order, so the result does not depend on which program finished first, writes the output and
puts the ticket back to zero for the next launch. The workspace (``StreamWorkspace``) is the
caller's: launches that share one run one after another (under programmatic dependent launch every
program waits for the previous kernel before it touches it).

Two epilogues take a small kernel's work: ``add`` (a residual added to the first columns in
float32 before the one rounding), and ``glu``, where the weight is a fused [gate; up] projection
and each program computes both halves of its columns and stores ``act(gate) * up`` in
``ops.silu_mul``'s roundings (no gate/up output, no activation kernel).

Under PDL (``ops.pdl``) a program may run its preamble while the kernel before it finishes. Weights
are never written during a step, so the preamble may read them: with ``PRELOAD`` the range's first
weight tile, with ``PREFETCH`` a hint to the L2 for the first ``PREFETCH`` bytes of each weight
row (``cp.async.bulk.prefetch.L2``: no registers held). Everything else waits.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..kernel_support import tl, triton
from ..kernel_support import interpreting
from . import pdl
from .silu_mul import act_mul_reference, act_mul_rounded, ACTIVATIONS


@triton.jit
def _bulk_prefetch(addr, size):
    return tl.inline_asm_elementwise(
        "{ cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_tile(ptrs, row_ok, cols, k_hi, EVEN_K: tl.constexpr):
    """A (rows, BLOCK_K) tile at columns ``cols``; rows past the end and, unless ``EVEN_K``,
    columns at ``k_hi`` or past read as zeros."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & (cols < k_hi)[None, :], other=0.0)


@triton.jit
def _tile_dot(w, x, acc, UPCAST: tl.constexpr):
    """``acc + w @ x.T``. ``UPCAST``: in float32 with no TF32 rounding (float32 inputs; the
    interpreter, whose bfloat16 dot is wrong)."""
    if UPCAST:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _n_side(v, N_FIRST: tl.constexpr):
    """An output-column vector as the tile's rows (``N_FIRST``: tiles (BLOCK_N, BLOCK_M), the
    streaming kernel's) or its columns (tiles (BLOCK_M, BLOCK_N), the TMA kernel's)."""
    return tl.expand_dims(v, 1 if N_FIRST else 0)


@triton.jit
def _m_side(v, N_FIRST: tl.constexpr):
    """An output-row vector along the tile's other axis (``_n_side``)."""
    return tl.expand_dims(v, 0 if N_FIRST else 1)


@triton.jit
def _epilogue(acc, bias_ptr, add_ptr, offs_n, offs_m, n_ok, m_ok, N_ADD, stride_am,
              HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, N_FIRST: tl.constexpr):
    """``acc`` (float32, oriented as ``N_FIRST`` says) plus the bias and, on the first ``N_ADD``
    columns, ``add`` (a residual): in float32, rounded once when stored."""
    if HAS_BIAS:
        acc += _n_side(tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32), N_FIRST)
    if HAS_ADD:
        a_ptrs = add_ptr + _m_side(offs_m.to(tl.int64), N_FIRST) * stride_am + _n_side(offs_n, N_FIRST)
        acc += tl.load(a_ptrs, mask=_n_side(offs_n < N_ADD, N_FIRST) & _m_side(m_ok, N_FIRST),
                       other=0.0).to(tl.float32)
    return acc


@triton.jit
def store_output(acc, acc_up, y_ptr, bias_ptr, add_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok, m_ok,
                 M, N, N_ADD, stride_ym, stride_am, pid_n, pid_k, pid_m,
                 HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, GLU: tl.constexpr, LIBDEVICE: tl.constexpr,
                 SPLIT_K: tl.constexpr, N_FIRST: tl.constexpr):
    """A program's output tile, the GEMMs' shared end (``N_FIRST``: the tile's orientation, see
    ``_n_side``): ``act(gate) * up`` with GLU; else the bias and residual added and stored, in one
    K range; else its partial stored, and the last of the tile's ranges to arrive (its ticket)
    sums them all, finishes and stores, then resets the ticket."""
    out_mask = _n_side(n_ok, N_FIRST) & _m_side(m_ok, N_FIRST)
    y_ptrs = y_ptr + _m_side(offs_m.to(tl.int64), N_FIRST) * stride_ym + _n_side(offs_n, N_FIRST)
    if GLU:
        dt = y_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += _n_side(tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32), N_FIRST)
            acc_up += _n_side(tl.load(bias_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32), N_FIRST)
        gate = acc.to(dt).to(tl.float32)  # the gate and up outputs, rounded as the GEMM would store them
        up = acc_up.to(dt).to(tl.float32)
        tl.store(y_ptrs, act_mul_rounded(gate, up, dt, GLU == 2, LIBDEVICE).to(dt), mask=out_mask)
    elif SPLIT_K == 1:
        acc = _epilogue(acc, bias_ptr, add_ptr, offs_n, offs_m, n_ok, m_ok, N_ADD, stride_am, HAS_BIAS, HAS_ADD,
                        N_FIRST)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials laid out (SPLIT_K, M, N); the last of the block's ranges to finish sums them
        part = part_ptr + _m_side(offs_m.to(tl.int64), N_FIRST) * N + _n_side(offs_n, N_FIRST)
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        ticket = ticket_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(ticket, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            total = _epilogue(total, bias_ptr, add_ptr, offs_n, offs_m, n_ok, m_ok, N_ADD, stride_am, HAS_BIAS,
                              HAS_ADD, N_FIRST)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(ticket, 0)


@triton.jit
def _stream_gemm_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, add_ptr, y_ptr, part_ptr, ticket_ptr,
    # dimensions (N_ADD: the output columns ``add`` covers, the first ones)
    M, N, K, K_PER_SPLIT, N_ADD,
    # strides (unit stride on K for x and w, on N for y and add)
    stride_xm, stride_wn, stride_ym, stride_am,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    GLU: tl.constexpr,  # 0: x @ w.T; 1 / 2: silu / gelu_tanh(x @ gate.T) * (x @ up.T), w = [gate; up], N rows each
    LIBDEVICE: tl.constexpr,  # GELU-tanh's tanh from libdevice (not under the interpreter)
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K_PER_SPLIT and K multiples of BLOCK_K: no mask along K
    PREFETCH: tl.constexpr,  # bytes of each weight row asked into L2 before the wait (0: none)
    PRELOAD: tl.constexpr,  # read the first weight tile before the wait
    UPCAST: tl.constexpr,  # the dot in float32 ("ieee", no TF32): float32 inputs, or the interpreter
    USE_PDL: tl.constexpr,
):
    pdl.launch_dependents(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    if PREFETCH > 0:
        row_start = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn + k_lo
        _bulk_prefetch(row_start.to(tl.pointer_type(tl.int8)),
                       tl.full((BLOCK_N,), PREFETCH, tl.int32))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GLU:  # up's rows, N below gate's (no split, no preload: the wrapper's rule)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up_ptrs = w_ptrs + N * stride_wn
    k_start = k_lo
    if PRELOAD:  # the range's first weight tile, read before the wait (weights: no kernel writes them)
        w_first = _load_tile(w_ptrs, n_ok, offs_k, k_hi, EVEN_K)
    pdl.wait(USE_PDL)
    if PRELOAD:
        acc = _tile_dot(w_first, _load_tile(x_ptrs, m_ok, offs_k, k_hi, EVEN_K), acc, UPCAST)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_start += BLOCK_K
    for k in range(k_start, k_hi, BLOCK_K):
        w = _load_tile(w_ptrs, n_ok, offs_k + (k - k_lo), k_hi, EVEN_K)
        x = _load_tile(x_ptrs, m_ok, offs_k + (k - k_lo), k_hi, EVEN_K)
        acc = _tile_dot(w, x, acc, UPCAST)
        if GLU:
            acc_up = _tile_dot(_load_tile(up_ptrs, n_ok, offs_k + (k - k_lo), k_hi, EVEN_K), x, acc_up, UPCAST)
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not GLU:
        acc_up = acc  # (unused)
    store_output(acc, acc_up, y_ptr, bias_ptr, add_ptr, part_ptr, ticket_ptr, offs_n, offs_m, n_ok,
                 m_ok, M, N, N_ADD, stride_ym, stride_am, pid_n, pid_k, pid_m, HAS_BIAS, HAS_ADD, GLU, LIBDEVICE,
                 SPLIT_K, True)


class StreamConfig(NamedTuple):
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    prefetch: int = 0  # bytes of each weight row asked into L2 before the PDL wait
    preload: bool = False  # the first weight tile read before the PDL wait


MAX_ROWS = 128  # rows of x one program covers (each row block reads the whole weight again)

class StreamWorkspace:
    """float32 partials and per-block tickets for split-K launches on one device. The tickets start
    at zero and every launch leaves them so; launches that share a workspace must run one after
    another (one stream, or one model's forwards), and a captured graph keeps its addresses."""

    def __init__(self, device, max_part_elems: int, max_tickets: int):
        self.part = torch.empty(max(max_part_elems, 1), dtype=torch.float32, device=device)
        self.tickets = torch.zeros(max(max_tickets, 1), dtype=torch.int32, device=device)

    def fits(self, part_elems: int, tickets: int, device: torch.device) -> bool:
        return (part_elems <= self.part.numel() and tickets <= self.tickets.numel()
                and self.part.device == device)


SHARED_BYTES = 220 * 1024  # what the pipeline's buffers may take of an SM's shared memory


def _stages(config: StreamConfig, block_m: int, elem_bytes: int, glu: bool = False) -> int:
    """The config's stages, fewer where its tiles of x and w (two of w with ``glu``; and the
    preloaded tile) would not fit ``SHARED_BYTES``."""
    per_stage = (block_m + config.block_n * (2 if glu else 1)) * config.block_k * elem_bytes
    return max(1, min(config.num_stages, SHARED_BYTES // per_stage - config.preload))


def check_operands(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """The decode GEMM launchers' (``stream_gemm``'s, ``ops.tma_gemm``'s) checks of x, w and the
    bias; each launcher adds its own of strides and config."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: expected (M, K) and (N, K)")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) differ")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != w.dtype or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype}: expected ({w.shape[0]},) {w.dtype}, contiguous")


def checked_output(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor], add: Optional[torch.Tensor],
                   glu: Optional[str], check: bool, glu_takes: bool, glu_needs: str):
    """The output of a decode GEMM launcher, allocated where None, and (M, N, K), N halved with
    ``glu``; ``glu``, ``add`` and ``out`` checked (``glu_takes``: the launcher's config allows
    ``glu``, which ``glu_needs`` says how)."""
    m, k = x.shape
    n = w.shape[0]
    if glu is not None:
        if glu not in ACTIVATIONS or n % 2 or not glu_takes or add is not None:
            raise ValueError(f"glu={glu!r} takes one of {ACTIVATIONS}, an even number of weight rows "
                             f"({n}), {glu_needs}")
        n //= 2
    if check and add is not None and (add.dim() != 2 or add.shape[0] != m or add.shape[1] > n
                                      or add.stride(1) != 1 or add.dtype != x.dtype or add.device != x.device):
        raise ValueError(f"add {tuple(add.shape)} {add.dtype}: expected ({m}, <= {n}) {x.dtype} on {x.device}, "
                         "unit stride on its columns")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif check and (out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected ({m}, {n}) {x.dtype}, unit stride on N")
    return out, m, n, k


def split_plan(config, m: int, n: int, k: int, workspace: Optional[StreamWorkspace], out: torch.Tensor):
    """A decode GEMM's launch over K ranges: (block_m, the range, the ranges, the grid, the partials
    and tickets, or ``out`` where one range needs neither). Each range is a whole number of
    ``config.block_k`` tiles, so ranges past K would be empty and fewer are launched."""
    block_m = max(16, min(MAX_ROWS, triton.next_power_of_2(m)))
    k_per = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per)
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, block_m))
    if split == 1:
        return block_m, k_per, split, grid, out, out  # not read
    if workspace is None or not workspace.fits(split * m * n, grid[0] * grid[2], out.device):
        raise ValueError(f"a split-K launch ({split} ranges, {m} x {n}) needs a StreamWorkspace on {out.device} "
                         f"of at least {split * m * n} partials and {grid[0] * grid[2]} tickets")
    return block_m, k_per, split, grid, workspace.part, workspace.tickets


def stream_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None, config: StreamConfig = StreamConfig(),
                workspace: Optional[StreamWorkspace] = None, check: bool = True,
                add: Optional[torch.Tensor] = None, glu: Optional[str] = None) -> torch.Tensor:
    """``x @ w.T + bias`` (``F.linear``) through the weight-streaming kernel, plus ``add`` on the
    first columns when given.

    Args:
        x: (M, K), unit stride on K.
        w: (N, K), unit stride on K: an ``nn.Linear`` weight, or rows of one.
        bias: optional (N,).
        out: optional (M, N) output, unit stride on N; allocated when None.
        config: tiles, split-K, warps, stages and prefetch (``StreamConfig``).
        workspace: where a split-K launch keeps its partials (needed when ``config.split_k > 1``
            splits this K; ``StreamWorkspace``).
        add: optional (M, N_add <= N), unit stride on N_add, not overlapping ``out``: added to the
            first N_add output columns before the one rounding (a residual folded into the GEMM).
        glu: optional activation of ``ops.silu_mul.ACTIVATIONS``: ``w`` (and ``bias``) stack gate's
            rows over up's, 2 x N in all, and the output is ``act(x @ gate.T) * (x @ up.T)``, (M, N).
            One K range, no preload, no ``add``.
    """
    if check:
        check_operands(x, w, bias)
        if x.stride(1) != 1 or w.stride(1) != 1:
            raise ValueError("x and w need unit stride on K")
        if config.block_k % 16 or config.block_n < 16 or config.split_k < 1:
            raise ValueError(f"config {config}: block_k a multiple of 16, block_n >= 16, split_k >= 1")
    out, m, n, k = checked_output(x, w, out, add, glu, check, glu_takes=config.split_k == 1 and not config.preload,
                                  glu_needs="split_k 1, no preload and no add")
    if m == 0 or n == 0:
        return out
    if k == 0 and glu is not None:
        return out.copy_(stream_gemm_reference(x, w, bias, glu=glu))
    if k == 0:
        if bias is not None:
            out.copy_(bias.expand(m, n))
        else:
            out.zero_()
        if add is not None:
            out[:, : add.shape[1]] += add
        return out
    block_m, k_per, split, grid, part, ticket = split_plan(config, m, n, k, workspace, out)
    # whole ranges only (k a multiple of the range), 16-byte aligned rows: the hint stays inside w
    aligned = w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % 16 == 0 and k % k_per == 0
    prefetch = (min(config.prefetch, k_per * w.element_size()) // 16 * 16
                if aligned and x.is_cuda and not interpreting() else 0)
    use_pdl = pdl.mode(x)
    _stream_gemm_kernel[grid](
        x, w, bias if bias is not None else w, add if add is not None else w, out, part, ticket,
        m, n, k, k_per, add.shape[1] if add is not None else 0,
        x.stride(0), w.stride(0), out.stride(0), add.stride(0) if add is not None else 0,
        HAS_BIAS=bias is not None, HAS_ADD=add is not None, GLU=0 if glu is None else 1 + ACTIVATIONS.index(glu),
        LIBDEVICE=not interpreting(), SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0 and k_per % config.block_k == 0,
        PREFETCH=prefetch, PRELOAD=config.preload, UPCAST=x.dtype == torch.float32 or interpreting(),
        USE_PDL=use_pdl,
        num_warps=config.num_warps, num_stages=_stages(config, block_m, x.element_size(), glu is not None),
        launch_pdl=use_pdl > 0)
    return out


def stream_gemm_reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                          add: Optional[torch.Tensor] = None, glu: Optional[str] = None) -> torch.Tensor:
    """float32 ``x @ w.T + bias (+ add on the first columns)``, rounded once to x's dtype; with
    ``glu``, torch's ``act(gate) * up`` of those (``ops.silu_mul.act_mul_reference``)."""
    if glu is not None:

        both = stream_gemm_reference(x, w, bias)
        n = both.shape[1] // 2
        return act_mul_reference(both[:, :n], both[:, n:], glu)
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    if add is not None:
        y[:, : add.shape[1]] += add.float()
    return y.to(x.dtype)
