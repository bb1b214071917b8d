"""A gated MLP's gate/up with every row's LoRA deltas, for a decode step of 65-128 rows, in one launch.

A folded gate/up site stores its adapters' A arena as rows under the fused ``[gate; up]`` weight
(``lora.fusion``): ``w`` is ``[gate (N); up (N); A arena (R)]``. Without this kernel a step runs a
GEMM over all of ``w`` (the base outputs and every arena row's shrink), the expand into the base
columns, and the act-mul: three launches and two round trips of the (M, 2N) outputs. Here one
launch gives ``act(gate(x) + dg) * (up(x) + du)``:

- its first ``NS`` programs compute the shrink, ``SB`` arena rows each: ``x @ A.T``, kept only
  where a row's adapter owns the column (``col_slot``) and scaled by that adapter's scaling, into a
  small scratch; each then counts itself done on ``counters[0]`` (release);
- the other programs are the gated tiles of ``ops.tma_gemm`` (all rows, ``BLOCK_N`` columns of
  gate and the same of up). Once their K loop has streamed the weight they wait for the count
  (acquire) and add the deltas as a few more K blocks of the scratch's columns against B's. With
  ``bt`` (what the model path passes: B's columns laid out as the arena's rows, kept by the site
  with ``b_columns``) those come through a tensor descriptor, ``TAIL_BLOCK`` columns a block;
  without, from the pool's flat packed B (``backend.packed``), ``G`` slots of ``RB`` columns a
  block, each row's part of a slot one contiguous load (16 bytes where every rank and place is a
  multiple of 8): measured slower. Then the act-mul
  epilogue in ``ops.silu_mul``'s roundings;
- the last program to finish puts both counters back to zero (``counters[1]`` is its ticket), so the
  launch can be captured in a CUDA graph and replayed.

The shrink programs have the lowest ids and the hardware dispatches programs in id order, so a
tile waits only on programs already running. That order is how GPUs behave, not a CUDA promise: a
tile that has polled ``SPIN_LIMIT`` times computes the whole shrink and writes it to the scratch
itself (the bits the shrink programs write), so the launch can neither hang nor read a shrink not
yet written.

The arena's rows are gate's region (``t0`` rows) then up's, as ``lora.pool`` lays them out;
``col_slot`` names the slot whose block holds each row (-1: free), which the shrink masks by. The
tables ``ranks``, ``scalings``, ``a_rows`` and ``b_offs`` are the pool's (num_slots, 2) ones.

Every resident adapter's columns enter each row's dot (times a zero shrink where the row is not
its adapter's): an adapter whose B holds inf or NaN makes every row's gate/up non-finite here,
where PEFT's path would spoil its own rows only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..kernel_support import AVAILABLE, tl, triton
from ..kernel_support import interpreting
from . import pdl
from .silu_mul import ACTIVATIONS, act_mul_rounded
from .stream_gemm import _tile_dot
from .tma_gemm import MAX_ROWS, TmaConfig, tma_aligned

if AVAILABLE:
    from triton.tools.tensor_descriptor import TensorDescriptor

SHRINK_COLUMNS = 16  # arena rows a shrink program computes (more programs, each shorter)
TAIL_BLOCK = 64  # columns of a tail K block (G slots of RB columns, RB the largest rank's power of 2)
MAX_RANK = 64  # the largest rank a slot may hold here (one slot's block in one tail K block), and how far
# past their ends the tail may read the scratch's rows and B
SPIN_LIMIT = 1 << 20  # polls of the count before a tile computes the shrink itself


class GluLora(NamedTuple):
    """What the kernel reads beside x and w: the batch's slots and the site's packed LoRA."""

    token_slot: torch.Tensor  # (>= M,) int32, each row's slot (-1: none)
    col_slot: torch.Tensor  # (R,) int32, the slot whose block holds each arena row (-1: free)
    t0: int  # arena rows of gate's region (up's follow)
    b: torch.Tensor  # flat packed B: slot s, module j's (N, rank) block at b_offs[s, j]; readable MAX_RANK
    # elements past its end (the tail's loads run past a block's last row: a padded buffer's view)
    ranks: torch.Tensor  # (num_slots, 2) int32
    scalings: torch.Tensor  # (num_slots, 2) float32
    a_rows: torch.Tensor  # (num_slots, 2) int32, each block's first arena row (from the arena's start)
    b_offs: torch.Tensor  # (num_slots, 2) int64
    scratch: torch.Tensor  # (>= M, >= R + MAX_RANK) of x's dtype, unit column stride: the masked, scaled shrink
    counters: torch.Tensor  # (2,) int32, zeros (done count, ticket); zeros again after each launch
    max_rank: int  # the largest rank a slot may hold
    align: int = 1  # 8: every rank and block place is a multiple of 8 (``backend.packed``'s align)
    # optional (N, >= t0_pad + R - t0): B's columns laid out as the arena's rows, gate's region from
    # column 0, up's from ``t0_pad`` (a multiple of TAIL_BLOCK past t0), zeros in free and padding
    # columns; the tail then reads it through a descriptor instead of gathering B's blocks
    bt: Optional[torch.Tensor] = None
    t0_pad: int = 0


@triton.jit
def gated_k_loop(x_desc, w_desc, n0, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """A gated tile's reduction: ``x @ gate.T`` and ``x @ up.T`` over columns ``[n0, n0 + BLOCK_N)`` of
    each (w = ``[gate (N); up (N); ...]``), float32, x's tile loaded once for both."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        xk = x_desc.load([0, k])
        acc = _tile_dot(xk, w_desc.load([n0, k]), acc, UPCAST)
        acc_up = _tile_dot(xk, w_desc.load([N + n0, k]), acc_up, UPCAST)
    return acc, acc_up


@triton.jit
def _store_shrink(x_desc, a_desc, s_ptr, stride_s, row_slot, offs_m, m_ok, c0, col_slot_ptr, scal_ptr, N2, K, T0, R,
                  BLOCK_M: tl.constexpr, SB: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Arena columns ``[c0, c0 + SB)`` of the shrink into the scratch: ``x @ A.T`` where the row's
    slot owns the column, times that slot's scaling, zeros elsewhere; rounded to the scratch's dtype."""
    acc = tl.zeros((BLOCK_M, SB), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = _tile_dot(x_desc.load([0, k]), a_desc.load([N2 + c0, k]), acc, UPCAST)
    cols = c0 + tl.arange(0, SB)
    ok = cols < R
    slot = tl.load(col_slot_ptr + cols, mask=ok, other=-1)
    module = (cols >= T0).to(tl.int32)
    scale = tl.load(scal_ptr + slot * 2 + module, mask=slot >= 0, other=0.0)
    keep = (row_slot[:, None] == slot[None, :]) & (slot[None, :] >= 0)
    s = tl.where(keep, acc * scale[None, :], 0.0)
    tl.store(s_ptr + offs_m[:, None] * stride_s + cols[None, :], s.to(s_ptr.dtype.element_ty),
             mask=m_ok[:, None] & ok[None, :])


@triton.jit
def _lora_tail(acc, s_ptr, b_ptr, offs_m, m_ok, offs_n, n_ok, ranks_ptr, a_rows_ptr, b_offs_ptr, S,
               MODULE: tl.constexpr, stride_s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
               RB: tl.constexpr, ALIGNED: tl.constexpr, UPCAST: tl.constexpr):
    """``acc`` plus one module's deltas: K blocks of ``G`` slots, ``RB`` columns each (a slot's
    rank at most ``RB``), the shrink's columns of each slot's block from the scratch against its
    (N, rank) B block. The loads run ``RB`` columns past a rank (into the buffers' padding, or
    another block: zeroed after the load), so that only whole rows are masked; ``ALIGNED`` (ranks
    and places multiples of 8): runs of 8 columns are contiguous, 16 bytes a load."""
    q = tl.arange(0, G * RB)
    jj = q % RB
    offs_n64 = offs_n.to(tl.int64)
    for g0 in range(0, S, G):
        slot = g0 + q // RB
        valid = slot < S
        rank = tl.load(ranks_ptr + slot * 2 + MODULE, mask=valid, other=0)
        first = tl.load(a_rows_ptr + slot * 2 + MODULE, mask=valid, other=0)
        b_off = tl.load(b_offs_ptr + slot * 2 + MODULE, mask=valid, other=0)
        ok = (jj < rank)[None, :]
        s_at = offs_m[:, None] * stride_s + (first + jj)[None, :]
        b_at = (b_off + jj)[None, :] + offs_n64[:, None] * rank[None, :]
        if ALIGNED:
            s_at = tl.max_contiguous(tl.multiple_of(s_at, [1, 8]), [1, 8])
            b_at = tl.max_contiguous(tl.multiple_of(b_at, [1, 8]), [1, 8])
        s = tl.load(s_ptr + s_at, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
        b = tl.load(b_ptr + b_at, mask=n_ok[:, None], other=0.0)
        acc = _tile_dot(tl.where(ok, s, 0.0), tl.where(ok, b, 0.0), acc, UPCAST)
    return acc


@triton.jit
def _lora_tail_bt(acc, bt_desc, s_ptr, offs_m, m_ok, n0, lo, hi, bt_lo, stride_s, BLOCK_T: tl.constexpr,
                  UPCAST: tl.constexpr):
    """``_lora_tail`` from ``bt``, B's columns laid out as the arena's rows (``GluLora.bt``): the
    scratch's columns ``[lo, hi)`` against ``bt``'s from ``bt_lo``, tiles through the descriptor."""
    for t in range(0, hi - lo, BLOCK_T):
        cols = lo + t + tl.arange(0, BLOCK_T)
        s = tl.load(s_ptr + offs_m[:, None] * stride_s + cols[None, :], mask=m_ok[:, None] & (cols < hi)[None, :],
                    other=0.0, cache_modifier=".cg")
        acc = _tile_dot(s, bt_desc.load([n0, bt_lo + t]), acc, UPCAST)
    return acc


@triton.jit
def _glu_lora_kernel(
    # tensor descriptors over x (M, K) and w ([gate; up; arena], K): x's tiles, w's tiles for the
    # gated K loop, the shrink's A tiles
    x_desc, w_desc, a_desc, bt_desc,
    # pointers (the tables are the pool's (S, 2) ones)
    s_ptr, y_ptr, b_ptr, token_slot_ptr, col_slot_ptr, ranks_ptr, scal_ptr, a_rows_ptr, b_offs_ptr, counters_ptr,
    # dimensions: N outputs of gate (and of up); T0 arena rows of gate's region, R in all; S slots
    M, N, K, T0, R, S, T0_PAD,
    stride_s, stride_y,
    # meta-parameters
    NS: tl.constexpr,  # shrink programs, the lowest ids
    SB: tl.constexpr,  # arena rows each computes
    GLU: tl.constexpr,  # 1 / 2: silu / gelu_tanh
    LIBDEVICE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    G: tl.constexpr, RB: tl.constexpr,  # the tail's K blocks: G slots of RB columns
    NUM_STAGES: tl.constexpr,
    ALIGNED: tl.constexpr,  # every rank and block place a multiple of 8
    HAS_BT: tl.constexpr,  # the tail reads B's columns from ``bt_desc`` (``GluLora.bt``)
    UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr,
    SPIN: tl.constexpr,  # polls before a tile computes the shrink itself
    SKIP: tl.constexpr,  # probes only, to split the launch's time (results wrong): 1 no tail; 2 no wait
    # either; 3 the shrink programs idle; 4 no counters touched (no count, no tickets); 5 (no shrink programs
    # in the grid) the bare tiles
):
    pdl.launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    N2 = 2 * N  # w's first arena row
    pdl.wait(USE_PDL)
    row_slot = tl.load(token_slot_ptr + offs_m, mask=m_ok, other=-1)
    if pid < NS:
        if SKIP < 3:
            _store_shrink(x_desc, a_desc, s_ptr, stride_s, row_slot, offs_m, m_ok, pid * SB, col_slot_ptr, scal_ptr,
                          N2, K, T0, R, BLOCK_M, SB, BLOCK_K, NUM_STAGES, UPCAST)
        if SKIP < 4:
            tl.atomic_add(counters_ptr, 1, sem="release")
    else:
        n0 = (pid - NS) * BLOCK_N
        acc, acc_up = gated_k_loop(x_desc, w_desc, n0, N, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, UPCAST)
        if SKIP < 2:
            done = tl.atomic_add(counters_ptr, 0, sem="acquire")
            polls = 0
            while (done < NS) & (polls < SPIN):
                done = tl.atomic_add(counters_ptr, 0, sem="acquire")
                polls += 1
            if done < NS:
                # waited too long: write the whole shrink itself (the same bits the shrink programs
                # write, so a write racing one of theirs is harmless), then read it as the others do
                for c0 in range(0, R, SB):
                    _store_shrink(x_desc, a_desc, s_ptr, stride_s, row_slot, offs_m, m_ok, c0, col_slot_ptr,
                                  scal_ptr, N2, K, T0, R, BLOCK_M, SB, BLOCK_K, NUM_STAGES, UPCAST)
                tl.debug_barrier()  # (the block's stores visible to all its threads)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if SKIP > 0:
            pass
        elif HAS_BT:
            acc = _lora_tail_bt(acc, bt_desc, s_ptr, offs_m, m_ok, n0, 0, T0, 0, stride_s, G * RB, UPCAST)
            acc_up = _lora_tail_bt(acc_up, bt_desc, s_ptr, offs_m, m_ok, n0, T0, R, T0_PAD, stride_s, G * RB, UPCAST)
        else:
            acc = _lora_tail(acc, s_ptr, b_ptr, offs_m, m_ok, offs_n, n_ok, ranks_ptr, a_rows_ptr, b_offs_ptr, S, 0,
                             stride_s, BLOCK_M, BLOCK_N, G, RB, ALIGNED, UPCAST)
            acc_up = _lora_tail(acc_up, s_ptr, b_ptr, offs_m, m_ok, offs_n, n_ok, ranks_ptr, a_rows_ptr, b_offs_ptr,
                                S, 1, stride_s, BLOCK_M, BLOCK_N, G, RB, ALIGNED, UPCAST)
        dt = y_ptr.dtype.element_ty
        out = act_mul_rounded(acc.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt, GLU == 2, LIBDEVICE)
        tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], out.to(dt), mask=m_ok[:, None] & n_ok[None, :])
    # the last program to finish puts the counters back (every tile has read the count by then)
    if SKIP < 4:
        if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(counters_ptr, 0)
            tl.atomic_xchg(counters_ptr + 1, 0)


@triton.jit
def _b_columns_kernel(b_ptr, col_slot_ptr, ranks_ptr, a_rows_ptr, b_offs_ptr, out_ptr, N, T0, R, T0_PAD, W, stride_o,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # columns of out
    n_ok = offs_n < N
    up = cc >= T0_PAD
    c = tl.where(up, T0 + cc - T0_PAD, cc)  # the arena row each holds (none in [T0, T0_PAD))
    ok = (cc < T0) | (up & (c < R))
    slot = tl.load(col_slot_ptr + c, mask=ok, other=-1)
    used = slot >= 0
    module = up.to(tl.int32)
    rank = tl.load(ranks_ptr + slot * 2 + module, mask=used, other=0)
    first = tl.load(a_rows_ptr + slot * 2 + module, mask=used, other=0)
    b_off = tl.load(b_offs_ptr + slot * 2 + module, mask=used, other=0)
    vals = tl.load(b_ptr + (b_off + (c - first))[None, :] + offs_n.to(tl.int64)[:, None] * rank[None, :],
                   mask=n_ok[:, None] & used[None, :], other=0.0)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_o + cc[None, :], vals,
             mask=n_ok[:, None] & (cc < W)[None, :])


def b_columns(b: torch.Tensor, col_slot: torch.Tensor, ranks: torch.Tensor, a_rows: torch.Tensor,
              b_offs: torch.Tensor, t0: int, t0_pad: int, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (N, W), in place, with B's columns laid out as the arena's rows (``GluLora.bt``;
    the arguments are ``GluLora``'s): gate's region from column 0, up's from ``t0_pad``, zeros in
    free and padding columns and past the arena. Run after anything changes the packed B or its tables."""
    n, r = out.shape[0], col_slot.shape[0]
    if out.dim() != 2 or out.shape[1] < t0_pad + r - t0 or out.stride(1) != 1 or out.dtype != b.dtype:
        raise ValueError(f"b_columns: out must be (N, {t0_pad + r - t0}+) of B's dtype with unit column stride")
    grid = (triton.cdiv(n, 64), triton.cdiv(out.shape[1], 64))
    _b_columns_kernel[grid](b, col_slot, ranks, a_rows, b_offs, out, n, t0, r, t0_pad, out.shape[1], out.stride(0),
                            BLOCK_N=64, BLOCK_C=64)
    return out


def check_glu_lora(x: torch.Tensor, w: torch.Tensor, n: int, lora: GluLora) -> None:
    """Why the kernel cannot take these operands, as a ValueError (module doc for their layout)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"glu_lora: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} must be 2-D, "
                         "of one width, dtype and device")
    m, r = x.shape[0], w.shape[0] - 2 * n
    if m > MAX_ROWS or n <= 0 or r <= 0:
        raise ValueError(f"glu_lora: {m} rows (at most {MAX_ROWS}), {n} outputs and {r} arena rows under "
                         f"[gate; up] ({w.shape[0]} rows of w)")
    if not (tma_aligned(x) and tma_aligned(w)):
        raise ValueError("glu_lora: x and w need unit stride on K and 16-byte aligned starts and row strides")
    if not 0 <= lora.t0 <= r or lora.col_slot.shape != (r,) or lora.col_slot.dtype != torch.int32:
        raise ValueError(f"glu_lora: col_slot must be ({r},) int32 and t0 ({lora.t0}) within the arena")
    if lora.token_slot.dim() != 1 or lora.token_slot.shape[0] < m or lora.token_slot.dtype != torch.int32:
        raise ValueError(f"glu_lora: token_slot must be int32 with at least {m} entries")
    tables = (lora.ranks, lora.scalings, lora.a_rows, lora.b_offs)
    if (any(t.dim() != 2 or t.shape[1] != 2 or t.shape[0] != lora.ranks.shape[0] or not t.is_contiguous()
            for t in tables)
            or [t.dtype for t in tables] != [torch.int32, torch.float32, torch.int32, torch.int64]):
        raise ValueError("glu_lora: ranks, scalings, a_rows, b_offs must be contiguous (num_slots, 2) tables of "
                         "int32, float32, int32, int64")
    s = lora.scratch
    if (s.dim() != 2 or s.shape[0] < m or s.shape[1] < r + MAX_RANK or s.stride(1) != 1 or s.dtype != x.dtype
            or (lora.align == 8 and (s.stride(0) % 8 or s.data_ptr() % 16))):
        raise ValueError(f"glu_lora: scratch must be ({m}+, {r + MAX_RANK}+) {x.dtype} with unit column stride "
                         "(align 8: rows 16-byte aligned)")
    if lora.b.untyped_storage().nbytes() - lora.b.storage_offset() * lora.b.element_size() < (
            (lora.b.numel() + MAX_RANK) * lora.b.element_size()):
        raise ValueError(f"glu_lora: b must be readable {MAX_RANK} elements past its end (a padded buffer's view)")
    if lora.counters.shape != (2,) or lora.counters.dtype != torch.int32:
        raise ValueError("glu_lora: counters must be (2,) int32")
    if lora.b.dim() != 1 or lora.b.dtype != x.dtype:
        raise ValueError("glu_lora: b must be the flat packed B arena of x's dtype")
    if lora.align not in (1, 8) or (lora.align == 8 and lora.b.data_ptr() % 16) or not 0 <= lora.max_rank <= MAX_RANK:
        raise ValueError(f"glu_lora: align must be 1 or 8 (8: b 16-byte aligned), max_rank 0-{MAX_RANK}; got "
                         f"{lora.align}, {lora.max_rank}")
    if lora.bt is not None:
        width = lora.t0_pad + r - lora.t0
        if (lora.t0_pad < lora.t0 or lora.t0_pad % TAIL_BLOCK or lora.bt.dim() != 2 or lora.bt.shape[0] != n
                or lora.bt.shape[1] < width or lora.bt.dtype != x.dtype or not tma_aligned(lora.bt)
                or lora.bt.device != x.device):
            raise ValueError(f"glu_lora: bt must be ({n}, {width}+) {x.dtype}, tma_aligned, and t0_pad a multiple "
                             f"of {TAIL_BLOCK} at least t0")
    for t in (lora.token_slot, lora.col_slot, lora.b, s, lora.counters) + tables:
        if t.device != x.device:
            raise ValueError(f"glu_lora: the tables must be on {x.device}, one is on {t.device}")


def glu_lora(x: torch.Tensor, w: torch.Tensor, n: int, lora: GluLora, act: str, config: TmaConfig,
             out: Optional[torch.Tensor] = None, check: bool = True, shrink_columns: int = SHRINK_COLUMNS,
             skip: int = 0, spin_limit: int = SPIN_LIMIT) -> torch.Tensor:
    """``act(x @ gate.T + dg) * (x @ up.T + du)`` (module doc), (M, n) of x's dtype.

    Args:
        x: (M <= 128, K), ``tma_aligned``.
        w: (2n + R, K) ``[gate; up; A arena]``, ``tma_aligned``.
        n: gate's (and up's) outputs.
        lora: the batch's slots and the site's packed LoRA (``GluLora``).
        act: one of ``ops.silu_mul.ACTIVATIONS``.
        config: the gated tile (``TmaConfig``; split_k is ignored).
        out: optional (M, n) output, unit column stride.
        shrink_columns: arena rows a shrink program computes (a power of 2, 16 or more).
        spin_limit: polls of the count before a tile computes the shrink itself.
        skip: for measurements only: leave out part of the work to
            split the launch's time (the kernel's ``SKIP``); the result is then wrong.
    """
    if check:
        check_glu_lora(x, w, n, lora)
        if shrink_columns < 16 or shrink_columns & (shrink_columns - 1):
            raise ValueError(f"glu_lora: shrink_columns must be a power of 2 of 16 or more, got {shrink_columns}")
        if not isinstance(spin_limit, int) or spin_limit < 0:
            raise ValueError(f"glu_lora: spin_limit must be an int of 0 or more, got {spin_limit!r}")
        if act not in ACTIVATIONS:
            raise ValueError(f"glu_lora: activation {act!r} is not one of {ACTIVATIONS}")
    m, k = x.shape
    r = w.shape[0] - 2 * n
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif check and (out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype):
        raise ValueError(f"glu_lora: out must be ({m}, {n}) {x.dtype} with unit column stride")
    if m == 0:
        return out
    block_m = max(16, triton.next_power_of_2(m))
    ns = 0 if skip >= 5 else triton.cdiv(r, shrink_columns)
    rb = max(16, triton.next_power_of_2(lora.max_rank))
    use_pdl = pdl.mode(x)
    upcast = x.dtype == torch.float32 or interpreting()
    _glu_lora_kernel[(ns + triton.cdiv(n, config.block_n),)](
        TensorDescriptor.from_tensor(x, [block_m, config.block_k]),
        TensorDescriptor.from_tensor(w, [config.block_n, config.block_k]),
        TensorDescriptor.from_tensor(w, [shrink_columns, config.block_k]),
        TensorDescriptor.from_tensor(lora.bt if lora.bt is not None else w, [config.block_n, TAIL_BLOCK]),
        lora.scratch, out, lora.b, lora.token_slot, lora.col_slot, lora.ranks, lora.scalings, lora.a_rows,
        lora.b_offs, lora.counters, m, n, k, lora.t0, r, lora.ranks.shape[0], lora.t0_pad, lora.scratch.stride(0),
        out.stride(0),
        NS=ns, SB=shrink_columns, GLU=1 + ACTIVATIONS.index(act), LIBDEVICE=not interpreting(),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, G=max(1, TAIL_BLOCK // rb), RB=rb,
        NUM_STAGES=config.num_stages, ALIGNED=lora.align % 8 == 0, HAS_BT=lora.bt is not None, UPCAST=upcast,
        USE_PDL=use_pdl, SPIN=spin_limit, SKIP=skip,
        num_warps=config.num_warps, launch_pdl=use_pdl > 0)
    return out


def glu_lora_shrink_reference(x: torch.Tensor, w: torch.Tensor, n: int, lora: GluLora,
                              rounding: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """What the shrink programs write to the scratch, (M, R) float32 of x's dtype's values: ``x @ A.T``
    in float32 where the row's slot owns the column, times its scaling, rounded (``glu_lora_reference``)."""
    dt = x.dtype
    rnd = rounding or (lambda t: t.to(dt).float())
    r = w.shape[0] - 2 * n
    slots = lora.col_slot.long()
    module = (torch.arange(r, device=x.device) >= lora.t0).long()
    used = slots >= 0
    scale = torch.where(used, lora.scalings[slots.clamp(min=0), module], 0.0)
    row_slot = lora.token_slot[: x.shape[0]].long()
    keep = (row_slot[:, None] == slots[None, :]) & used[None, :]
    return rnd(torch.where(keep, (x.float() @ w[2 * n:].float().T) * scale[None, :], 0.0))


def glu_lora_reference(x: torch.Tensor, w: torch.Tensor, n: int, lora: GluLora, act: str,
                       rounding: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                       shrink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's result in torch, in its roundings: float32 products; the masked, scaled shrink
    rounded to x's dtype; gate, up, the activation and the product rounded as ``ops.silu_mul``
    rounds them. ``rounding``: a float32 tensor rounded to x's dtype's values (default: to nearest;
    Triton's interpreter truncates, and its tests say so). ``shrink``: the rounded shrink to use
    (say the kernel's own scratch, where a sum landing on the other side of a rounding would
    otherwise move a delta by a unit of the shrink's last place); default
    ``glu_lora_shrink_reference``'s."""
    dt = x.dtype
    rnd = rounding or (lambda t: t.to(dt).float())
    xf, wf = x.float(), w.float()
    r = w.shape[0] - 2 * n
    s = glu_lora_shrink_reference(x, w, n, lora, rounding) if shrink is None else shrink[:, :r].float()
    slots = lora.col_slot.long()
    module = (torch.arange(r, device=x.device) >= lora.t0).long()
    # B's columns as dense (N, R) matrices, one per module (zeros in the other module's columns)
    bt = torch.zeros(2, n, r, dtype=torch.float32, device=x.device)
    for c in (slots >= 0).nonzero().flatten().tolist():
        sl, j = int(slots[c]), int(module[c])
        rank, first, off = int(lora.ranks[sl, j]), int(lora.a_rows[sl, j]), int(lora.b_offs[sl, j])
        bt[j, :, c] = lora.b[off: off + n * rank].view(n, rank)[:, c - first].float()
    gate = rnd(xf @ wf[:n].T + s @ bt[0].T)
    up = rnd(xf @ wf[n: 2 * n].T + s @ bt[1].T)
    f = torch.nn.functional
    activated = f.silu(gate) if act == "silu" else f.gelu(gate, approximate="tanh")
    return rnd(rnd(activated) * up).to(dt)
