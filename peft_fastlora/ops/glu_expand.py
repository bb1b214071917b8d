"""A gate/up site's LoRA expand and the gated activation in one launch, for prefill-sized batches:

``h[t] = act(gate[t] + s_g(t) * y[t, 0:r] @ B_g(t).T) * (up[t] + s_u(t) * y[t, R:R + r] @ B_u(t).T)``

where ``gate | up`` is the site's fused base output ``(s, 2n)``, ``y`` the shrink of the packed
weights ``(s, 2R)`` and ``(t)`` the token's adapter slot. The expand adds the deltas into the
projection's output (one read and one write of it) and the activation then reads it again; here
each program owns a tile of consecutive tokens and a block of columns, reads the base gate and up
once, adds the delta of every adapter present in its rows (one in most prefill tiles, none for
rows without an adapter) and writes only the activation's output, half as wide. The roundings are
those of the two launches it replaces: the projection's output rounded to the input dtype after
the delta is added, then ``ops.act_mul``'s.
"""

from __future__ import annotations

import torch

from ..kernel_support import interpreting, tl, triton
from . import pdl
from .expand_common import packed_row_stride
from .silu_mul import ACTIVATIONS, act_mul_reference, act_mul_rounded

# the launch taken unless a caller gives another (``benchmarks/sweep_expand.py`` marks it "chosen")
LAUNCH = dict(block_m=64, block_n=64, block_r=16, num_warps=8, num_stages=2)


@triton.jit
def _delta(y_ptr, b_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, slot, j, rows, sel, cols, col_ok, R,
           stride_ys, stride_rl, stride_sl, stride_tl,
           B_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
           DOT_PRECISION: tl.constexpr):
    """Module ``j``'s scaled delta of ``slot`` for the rows in ``sel`` (zeros elsewhere), float32."""
    rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rl + j), R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if rank > 0:
        b_off = tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + j), B_ALIGN)
        b_n = packed_row_stride(rank, B_ALIGN)  # B block (width, rank): rows one padded rank apart
        y_rows = y_ptr + rows[:, None] * stride_ys + j * R
        b_cols = b_ptr + b_off + cols[None, :].to(tl.int64) * b_n
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            yt = tl.load(y_rows + offs_r[None, :], mask=sel[:, None] & (offs_r < rank)[None, :], other=0.0)
            bt = tl.load(b_cols + offs_r[:, None], mask=(offs_r < b_n)[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(yt, bt, acc, input_precision=DOT_PRECISION)
        acc = acc * tl.load(scalings_ptr + slot * stride_sl + j)
    return acc


@triton.jit
def _glu_expand_kernel(
    # pointers
    y_ptr,  # (s, 2R) the shrink: gate's rank columns from 0, up's from R
    b_ptr,  # the packed B arena
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
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py
):
    pdl.launch_dependents(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < S
    col_ok = cols < N
    rows = rows.to(tl.int64)
    slots = tl.load(token_slot_ptr + rows, mask=row_ok, other=-1)
    pdl.wait(USE_PDL)
    mask = row_ok[:, None] & col_ok[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_gs + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    # each adapter of the tile in turn (rows are disjoint: a row gets its own adapter's delta alone)
    pending = row_ok & (slots >= 0) & (slots < num_slots)
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        slot = tl.min(tl.where(pending, slots, num_slots), axis=0)
        sel = pending & (slots == slot)
        pending = pending & (slots != slot)
        g += _delta(y_ptr, b_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, slot, 0, rows, sel, cols, col_ok, R,
                    stride_ys, stride_rl, stride_sl, stride_tl, B_ALIGN, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
        u += _delta(y_ptr, b_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, slot, 1, rows, sel, cols, col_ok, R,
                    stride_ys, stride_rl, stride_sl, stride_tl, B_ALIGN, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
    dt = out_ptr.dtype.element_ty
    # the projection's output as the expand stores it, then the activation's roundings
    h = act_mul_rounded(g.to(dt).to(tl.float32), u.to(dt).to(tl.float32), dt, GELU_TANH, LIBDEVICE)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], h.to(dt), mask=mask)


def glu_expand(y: torch.Tensor, b: torch.Tensor, b_offs: torch.Tensor, ranks: torch.Tensor,
               scalings: torch.Tensor, token_slot: torch.Tensor, gate_up: torch.Tensor, act: str = "silu", *,
               max_rank: int, b_align: int = 1, **launch) -> torch.Tensor:
    """``act(gate + dg) * (up + du)`` of a packed gate/up site (module doc).

    Args:
        y: (s, 2 * max_rank), the packed shrink's output (``ops.lora_shrink`` of the site's two
            modules): gate's columns from 0, up's from ``max_rank``; rows without an adapter unread.
        b: the packed B arena; ``b_offs``: (>= num_slots, 2) int64, unit column stride, where each
            (slot, module) block ``(n, rank)`` starts; ``b_align``: 8 where every offset and rank
            is a multiple of 8, else 1.
        ranks, scalings: (>= num_slots, 2) int32 / float32 with unit column stride.
        token_slot: (>= s,) int32, each token's slot (-1: no adapter).
        gate_up: (s, 2n) the base output, gate's columns then up's, unit column stride.
        act: one of ``ops.silu_mul.ACTIVATIONS``.
        launch: ``LAUNCH``'s fields to override (benchmarks).
    Returns:
        (s, n), contiguous, ``gate_up``'s dtype.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"glu_expand: unknown gated activation {act!r}; the kernel takes {ACTIVATIONS}")
    s, width = gate_up.shape if gate_up.dim() == 2 else (None, None)
    if s is None or width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"glu_expand: gate_up must be (s, 2n) with unit column stride, got {tuple(gate_up.shape)}")
    n = width // 2
    if max_rank < 1:
        raise ValueError(f"glu_expand: max_rank must be positive, got {max_rank}")
    if y.dim() != 2 or y.shape[0] != s or y.shape[1] != 2 * max_rank or y.stride(1) != 1 or y.dtype != gate_up.dtype:
        raise ValueError(f"glu_expand: y must be ({s}, {2 * max_rank}) of gate_up's dtype with unit column stride, "
                         f"got {tuple(y.shape)} {y.dtype}")
    num_slots = b_offs.shape[0] if b_offs.dim() == 2 else -1
    for name, t, dtype in (("b_offs", b_offs, torch.int64), ("ranks", ranks, torch.int32),
                           ("scalings", scalings, torch.float32)):
        if t.dim() != 2 or t.shape[1] != 2 or t.shape[0] < num_slots or t.stride(1) != 1 or t.dtype != dtype:
            raise ValueError(f"glu_expand: {name} must be {dtype} (>= {num_slots}, 2) with unit column stride")
    if token_slot.dim() != 1 or token_slot.shape[0] < s or token_slot.dtype != torch.int32:
        raise ValueError(f"glu_expand: token_slot must be int32 with at least {s} entries")
    if b.dim() != 1 or b.dtype != gate_up.dtype or b_align not in (1, 8):
        raise ValueError("glu_expand: B must be a flat arena of gate_up's dtype, b_align 1 or 8")
    unknown = set(launch) - set(LAUNCH)
    if unknown:
        raise ValueError(f"glu_expand: unknown launch fields {sorted(unknown)}; it takes {sorted(LAUNCH)}")
    cfg = dict(LAUNCH, **launch)
    out = torch.empty(s, n, dtype=gate_up.dtype, device=gate_up.device)
    if s == 0 or n == 0:
        return out
    use_pdl = pdl.mode(out)
    grid = (triton.cdiv(s, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]))
    _glu_expand_kernel[grid](
        y, b, b_offs, ranks, scalings, token_slot, gate_up, out,
        s, n, max_rank, num_slots,
        y.stride(0), gate_up.stride(0),
        ranks.stride(0), scalings.stride(0), b_offs.stride(0),
        GELU_TANH=act == "gelu_tanh", LIBDEVICE=not interpreting(), B_ALIGN=b_align,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_R=cfg["block_r"],
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        USE_PDL=use_pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=use_pdl > 0)
    return out


def glu_expand_reference(y, b, b_offs, ranks, scalings, token_slot, gate_up, act: str = "silu", *,
                         max_rank: int, b_align: int = 1) -> torch.Tensor:
    """torch's own, token by token: the delta added and rounded as the expand stores it, then
    ``act(gate) * up`` in ``act_mul_reference``'s order."""
    n = gate_up.shape[1] // 2
    gu = gate_up.float().clone()
    slots = token_slot[: gate_up.shape[0]].tolist()
    for t, slot in enumerate(slots):
        if slot < 0 or slot >= b_offs.shape[0]:
            continue
        for j in range(2):
            rank = min(int(ranks[slot, j]), max_rank)
            if rank == 0:
                continue
            stride = -(-rank // b_align) * b_align  # the block's rows: one padded rank apart
            off = int(b_offs[slot, j])
            bj = b[off: off + n * stride].view(n, stride)[:, :rank].float()
            delta = y[t, j * max_rank: j * max_rank + rank].float() @ bj.T
            gu[t, j * n:(j + 1) * n] += float(scalings[slot, j]) * delta
    gu = gu.to(gate_up.dtype)
    return act_mul_reference(gu[:, :n], gu[:, n:], act)
