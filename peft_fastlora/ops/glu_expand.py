"""A gate/up site's LoRA expand and the gated activation in one launch, for prefill:

``h[t] = act(gate[t] + s_g * y[t, 0:r_g] @ B_g.T) * (up[t] + s_u * y[t, R:R + r_u] @ B_u.T)``

where ``gate | up`` is the site's fused base output ``(s, 2n)``, ``y`` the packed shrink's output
``(s, 2R)`` and ``s``, ``r``, ``B`` those of the token's adapter slot. The two launches this
replaces (``lora_expand`` into the projection's output, then ``act_mul``) move the ``(s, 2n)``
output three times (read, written, read again); here it is read once and only the activation's
``(s, n)`` is written, so the launch is a stream whose speed is the memory's.

Each program owns ``BLOCK_M`` consecutive tokens by ``BLOCK_N`` columns of gate and of up. It
loads its tokens' slots, then the base gate and up (which need no slot) before anything that
depends on a slot, so those loads are in flight while the slot's operands are fetched. At prefill
every token of a tile has one slot (a sequence's rows are consecutive and long), and the tile's
first slot is served by straight-line code: one scalar slot, its ranks, scalings and B blocks,
one product per module (a loop over rank blocks only past ``BLOCK_R``), no branch (with the
base tiles yielded by a branch, the compiler changed their layout right after their loads, so
waited for them before fetching anything else). A tile of no adapter masks every operand: the
activation alone. The tile's other slots, where it has any (rows of several sequences), follow
in a loop over the distinct slots, each slot's delta in its own rows: correct, and slower the
more slots a tile holds (an engine step's mix of sequences; callers keep such batches on the two
launches).

The roundings are the two launches': the projection's output plus the delta in float32, rounded
to the dtype as the expand stores it, then ``act_mul``'s (``silu_mul.act_mul_rounded``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..kernel_support import interpreting, tl, triton
from . import pdl
from .expand_common import packed_row_stride
from .silu_mul import ACTIVATIONS, act_mul_rounded

# the launch taken unless a caller passes another (``benchmarks/sweep_expand.py --kernels glu``
# marks it "chosen"); callers that need uniform tiles read BLOCK_M
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 128, 4, 1
MAX_BLOCK_R = 64  # the largest rank block: ranks up to it take one product per module
MAX_ROW_TILES = 65535  # row tiles are the grid's second dimension, which CUDA bounds


def rank_block(max_rank: int) -> int:
    """The rank block of a site whose largest rank is ``max_rank``: one block for ranks up to
    ``MAX_BLOCK_R`` (no loop), the tensor cores' smallest depth (16) at least."""
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(max_rank)))


@triton.jit
def _dot(yt, bt, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + yt @ bt``; ``UPCAST``: in float32 (float32 operands, or the interpreter, whose
    16-bit dot is wrong)."""
    if UPCAST:
        return tl.dot(yt.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(yt, bt, acc, input_precision=DOT_PRECISION)


@triton.jit
def _rank_blocks(acc, y_rows, b_cols, rank, b_n, sel, col_ok,
                 BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc`` plus the products of one module's rank blocks past the first."""
    for r0 in range(BLOCK_R, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        yt = tl.load(y_rows + offs_r[None, :], mask=sel[:, None] & (offs_r < rank)[None, :], other=0.0)
        bt = tl.load(b_cols + offs_r[:, None], mask=(offs_r < b_n)[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(yt, bt, acc, UPCAST, DOT_PRECISION)
    return acc


@triton.jit
def _slot_deltas(g, u, y_rows, b_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, slot, sel, cols, col_ok, R, num_slots,
                 stride_rl, stride_sl, stride_tl,
                 B_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 MULTI_RB: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``g`` and ``u`` (tiles of the output's dtype) plus ``slot``'s scaled gate and up deltas in
    the rows of ``sel``, rounded to that dtype as the expand stores them (other rows: unchanged,
    their ``y`` reads as zeros). Both modules' operands are loaded before either product, so
    their loads overlap; the modules are then finished one after the other, so that one float32
    tile at a time is live."""
    ok = slot < num_slots
    rank_g = tl.minimum(tl.load(ranks_ptr + slot * stride_rl, mask=ok, other=0), R)
    rank_u = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + 1, mask=ok, other=0), R)
    # a module of rank 0 reads nothing (every operand masked); its scaling may be anything
    scale_g = tl.where(rank_g > 0, tl.load(scalings_ptr + slot * stride_sl, mask=ok, other=0.0), 0.0)
    scale_u = tl.where(rank_u > 0, tl.load(scalings_ptr + slot * stride_sl + 1, mask=ok, other=0.0), 0.0)
    # B blocks (n, rank): rows one padded rank apart, a multiple of B_ALIGN the compiler can see
    # (16-byte loads along the rank where it is 8)
    n_g = packed_row_stride(rank_g, B_ALIGN)
    n_u = packed_row_stride(rank_u, B_ALIGN)
    b_g = b_ptr + tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl, mask=ok, other=0), B_ALIGN)
    b_u = b_ptr + tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + 1, mask=ok, other=0), B_ALIGN)
    bg_cols = b_g + cols[None, :] * n_g  # (offsets within a block, width x rank, in 32 bits)
    bu_cols = b_u + cols[None, :] * n_u
    offs_r = tl.arange(0, BLOCK_R)
    # y's columns past a rank are undefined (the shrink never writes them): masked by the rank
    yg = tl.load(y_rows + offs_r[None, :], mask=sel[:, None] & (offs_r < rank_g)[None, :], other=0.0)
    yu = tl.load(y_rows + R + offs_r[None, :], mask=sel[:, None] & (offs_r < rank_u)[None, :], other=0.0)
    btg = tl.load(bg_cols + offs_r[:, None], mask=(offs_r < n_g)[:, None] & col_ok[None, :], other=0.0)
    btu = tl.load(bu_cols + offs_r[:, None], mask=(offs_r < n_u)[:, None] & col_ok[None, :], other=0.0)
    dt = g.dtype
    acc = _dot(yg, btg, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST, DOT_PRECISION)
    if MULTI_RB:  # ranks past one block (compiled in only where the site has one)
        acc = _rank_blocks(acc, y_rows, bg_cols, rank_g, n_g, sel, col_ok, BLOCK_R, UPCAST, DOT_PRECISION)
    # the expand's sum, base + delta * scaling in float32, rounded as it stores it
    g = (g.to(tl.float32) + acc * scale_g).to(dt)
    acc = _dot(yu, btu, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST, DOT_PRECISION)
    if MULTI_RB:
        acc = _rank_blocks(acc, y_rows + R, bu_cols, rank_u, n_u, sel, col_ok, BLOCK_R, UPCAST, DOT_PRECISION)
    u = (u.to(tl.float32) + acc * scale_u).to(dt)
    return g, u


@triton.jit
def _glu_expand_kernel(
    # pointers
    y_ptr,  # (s, 2R) the packed shrink: gate's rank columns from 0, up's from R
    b_ptr,  # the packed B arena, flat
    b_offs_ptr,  # (>= num_slots, 2) int64 element offset of each (slot, module) B block
    ranks_ptr, scalings_ptr,  # (>= num_slots, 2) int32 / float32
    token_slot_ptr,  # (>= s,) int32 slot of each token, -1 for none
    gu_ptr,  # (s, 2n) the base gate | up, any row stride
    out_ptr,  # (s, n), contiguous
    # dimensions and strides
    S, N, R, num_slots,
    stride_ys, stride_gs,
    stride_rl, stride_sl, stride_tl,
    # meta-parameters
    GELU_TANH: tl.constexpr,  # False: SiLU
    LIBDEVICE: tl.constexpr,  # False under Triton's interpreter
    B_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MULTI_RB: tl.constexpr,  # some rank is past BLOCK_R: the rank loop is compiled in
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py: the slots (the batch plan) are read before the wait
):
    pdl.launch_dependents(USE_PDL)
    # column blocks vary fastest: the programs in flight together cover a few row tiles end to end
    # (long runs of each row's gate | up) and share those rows' slots and y in L2
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    # offsets within the tile in 32 bits, from base pointers moved to its first row in 64
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = row0 + offs_m < S
    col_ok = cols < N
    slots = tl.load(token_slot_ptr + row0 + offs_m, mask=row_ok, other=-1)
    slots = tl.where((slots >= 0) & (slots < num_slots), slots, -1)  # none, or a stale plan's: no delta
    pdl.wait(USE_PDL)
    # the base tiles first (no slot needed); in their dtype, as the expand leaves the projection
    mask = row_ok[:, None] & col_ok[None, :]
    g_ptrs = gu_ptr + row0 * stride_gs + (offs_m[:, None] * stride_gs + cols[None, :])
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + N, mask=mask, other=0.0)
    y_rows = y_ptr + row0 * stride_ys + offs_m[:, None] * stride_ys
    # the tile's first slot (num_slots: none) in straight-line code: at prefill the tile's only one
    first = tl.min(tl.where(slots >= 0, slots, num_slots), axis=0)
    g, u = _slot_deltas(g, u, y_rows, b_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, first, slots == first, cols, col_ok,
                        R, num_slots, stride_rl, stride_sl, stride_tl, B_ALIGN, BLOCK_M, BLOCK_N, BLOCK_R, MULTI_RB,
                        UPCAST, DOT_PRECISION)
    # the tile's other slots, if any (rows of several sequences): each one's delta in its own rows
    pending = (slots >= 0) & (slots != first)
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        slot = tl.min(tl.where(pending, slots, num_slots), axis=0)
        sel = pending & (slots == slot)
        pending = pending & (slots != slot)
        g, u = _slot_deltas(g, u, y_rows, b_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, slot, sel, cols, col_ok,
                            R, num_slots, stride_rl, stride_sl, stride_tl, B_ALIGN, BLOCK_M, BLOCK_N, BLOCK_R, MULTI_RB,
                            UPCAST, DOT_PRECISION)
    dt = out_ptr.dtype.element_ty
    h = act_mul_rounded(g.to(tl.float32), u.to(tl.float32), dt, GELU_TANH, LIBDEVICE)
    tl.store(out_ptr + row0 * N + (offs_m[:, None] * N + cols[None, :]), h.to(dt), mask=mask)


def _power_of_two(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"glu_expand: {name} must be a power of 2 of at least {least}, got {value!r}")


def glu_expand(y: torch.Tensor, b: torch.Tensor, b_offs: torch.Tensor, ranks: torch.Tensor,
               scalings: torch.Tensor, token_slot: torch.Tensor, gate_up: torch.Tensor, act: str = "silu", *,
               max_rank: int, b_align: int = 1, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
               block_r: Optional[int] = None, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
               check: bool = True) -> torch.Tensor:
    """``act(gate + dg) * (up + du)`` of a packed gate/up site (module doc).

    Args:
        y: (s, 2 * max_rank), the packed shrink's output (``ops.lora_shrink`` of the site's two
            modules): gate's columns from 0, up's from ``max_rank``; only each token's slot's
            first rank columns are read (none in rows without an adapter).
        b: the packed B arena, flat; ``b_offs``: (>= num_slots, 2) int64, unit column stride,
            where each (slot, module) block ``(n, rank)`` starts; ``b_align``: 8 where every
            offset and rank is a multiple of 8, else 1.
        ranks, scalings: (>= num_slots, 2) int32 / float32, unit column stride.
        token_slot: (>= s,) int32, each token's slot (-1, or ``num_slots`` and past: no adapter).
        gate_up: (s, 2n) the base output, gate's columns then up's, unit column stride.
        act: one of ``ops.silu_mul.ACTIVATIONS``.
        block_m, block_n: the tile (tokens, columns); block_r: the rank block (None:
            ``rank_block(max_rank)``); num_warps, num_stages: the launch's.
        check: validate the operands (False: the caller, a backend, has).
    Returns:
        (s, n), contiguous, ``gate_up``'s dtype.
    """
    if check:
        _check(y, b, b_offs, ranks, scalings, token_slot, gate_up, act, max_rank, b_align)
    block_r = rank_block(max_rank) if block_r is None else block_r
    if check:
        for name, value, least in (("block_m", block_m, 16), ("block_n", block_n, 16), ("block_r", block_r, 16),
                                   ("num_warps", num_warps, 1)):
            _power_of_two(name, value, least)
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"glu_expand: num_stages must be a positive int, got {num_stages!r}")
    s, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(s, n, dtype=gate_up.dtype, device=gate_up.device)
    if s == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, block_n), triton.cdiv(s, block_m))
    if grid[1] > MAX_ROW_TILES:
        raise ValueError(f"glu_expand: {s} tokens make {grid[1]} row tiles of {block_m}; a launch takes at most "
                         f"{MAX_ROW_TILES} (the grid's second dimension)")
    use_pdl = pdl.mode(out)
    _glu_expand_kernel[grid](
        y, b, b_offs, ranks, scalings, token_slot, gate_up, out,
        s, n, max_rank, b_offs.shape[0],
        y.stride(0), gate_up.stride(0),
        ranks.stride(0), scalings.stride(0), b_offs.stride(0),
        GELU_TANH=act == "gelu_tanh", LIBDEVICE=not interpreting(), B_ALIGN=b_align,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, MULTI_RB=max_rank > block_r,
        UPCAST=y.dtype == torch.float32 or interpreting(),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl > 0)
    return out


def _check(y, b, b_offs, ranks, scalings, token_slot, gate_up, act, max_rank, b_align) -> None:
    """The launcher's operands (``glu_expand``'s Args), each refusal saying what was expected."""
    if act not in ACTIVATIONS:
        raise ValueError(f"glu_expand: unknown gated activation {act!r}; the kernel takes {ACTIVATIONS}")
    if (gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1
            or gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
        raise ValueError(f"glu_expand: gate_up must be a float (s, 2n) tensor with unit column stride, got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")
    s = gate_up.shape[0]
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"glu_expand: max_rank must be a positive int, got {max_rank!r}")
    if y.dim() != 2 or y.shape != (s, 2 * max_rank) or y.stride(1) != 1 or y.dtype != gate_up.dtype:
        raise ValueError(f"glu_expand: y must be ({s}, {2 * max_rank}) {gate_up.dtype} with unit column stride "
                         f"(the shrink of max_rank {max_rank}), got {tuple(y.shape)} {y.dtype}")
    if b_offs.dim() != 2 or b_offs.shape[1] != 2:
        raise ValueError(f"glu_expand: b_offs must be (num_slots, 2), got {tuple(b_offs.shape)}")
    num_slots = b_offs.shape[0]
    for name, t, dtype in (("b_offs", b_offs, torch.int64), ("ranks", ranks, torch.int32),
                           ("scalings", scalings, torch.float32)):
        if t.dim() != 2 or t.shape[1] != 2 or t.shape[0] < num_slots or t.stride(1) != 1 or t.dtype != dtype:
            raise ValueError(f"glu_expand: {name} must be {dtype} (>= {num_slots}, 2) with unit column stride, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if token_slot.dim() != 1 or token_slot.shape[0] < s or token_slot.dtype != torch.int32:
        raise ValueError(f"glu_expand: token_slot must be int32 with at least {s} entries, got "
                         f"{tuple(token_slot.shape)} {token_slot.dtype}")
    if b.dim() != 1 or b.stride(0) != 1 or b.dtype != gate_up.dtype:
        raise ValueError(f"glu_expand: b must be a flat contiguous {gate_up.dtype} arena, got {tuple(b.shape)} "
                         f"{b.dtype}")
    if b_align not in (1, 8):
        raise ValueError(f"glu_expand: b_align must be 1 or 8, got {b_align!r}")
    devices = {t.device for t in (y, b, b_offs, ranks, scalings, token_slot, gate_up)}
    if len(devices) > 1:
        raise ValueError(f"glu_expand: the operands must share one device, got {sorted(map(str, devices))}")


def glu_expand_reference(y: torch.Tensor, b: torch.Tensor, b_offs: torch.Tensor, ranks: torch.Tensor,
                         scalings: torch.Tensor, token_slot: torch.Tensor, gate_up: torch.Tensor, act: str = "silu",
                         *, max_rank: int, b_align: int = 1,
                         rounding: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """torch's own, slot by slot: each module's delta in float32 added to the base output and
    rounded as the expand stores it, then the activation rounded and the product rounded as
    ``act_mul`` rounds them. ``rounding``: a float32 tensor to the dtype's values (default: to
    nearest; Triton's interpreter truncates to bfloat16, and its tests say so)."""
    dt = gate_up.dtype
    rnd = rounding or (lambda t: t.to(dt).float())
    s, n = gate_up.shape[0], gate_up.shape[1] // 2
    gu = gate_up.float().clone()
    slots = token_slot[:s].long()
    for slot in slots.unique().tolist():
        if slot < 0 or slot >= b_offs.shape[0]:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        for j in range(2):
            rank = min(int(ranks[slot, j]), max_rank)
            if rank == 0:
                continue
            stride = -(-rank // b_align) * b_align  # the block's rows: one padded rank apart
            off = int(b_offs[slot, j])
            bj = b[off: off + n * stride].view(n, stride)[:, :rank].float()
            delta = y[rows, j * max_rank: j * max_rank + rank].float() @ bj.T
            cols = slice(j * n, (j + 1) * n)
            gu[rows, cols] = rnd(gu[rows, cols] + delta * float(scalings[slot, j]))
    f = torch.nn.functional
    gate, up = gu[:, :n], gu[:, n:]
    activated = f.silu(gate) if act == "silu" else f.gelu(gate, approximate="tanh")
    return rnd(rnd(activated) * up).to(dt)
