"""The decode-sized expand with rank-sized column spans (``lora_expand``'s launch for row tiles of
up to 16).

``lora_expand``'s own grid gives every program one column block of a fixed width, sized for the
largest rank of the launch: with mixed ranks a rank-8 program then reads a few hundred bytes of B
after its chain of metadata loads, and a batch of many one-row chunks is thousands of such
programs. Here every program owns ``SPAN = TILE // 16`` columns of one (chunk, module) and reads
them as tiles of ``TILE`` elements shaped by its rank's class (16, 32, 64 or 128 rank columns):
one tile for ranks up to 16, two for 32, four for 64, eight for 128, the next tile's load issued
before this one's output is written. The grid enumerates only the spans each module has (no
programs past a narrower module's width).

Same arguments, same result and the same PDL rules as ``lora_expand``'s kernel (B and the plan
before the wait, ``y`` and ``out`` after).
"""

from __future__ import annotations

from . import pdl
from ..kernel_support import tl, triton
from .expand_common import add_bias, chunk_rank, dora_epilogue, expand_operands, module_span

WIDE_MAX_RANK = 128  # the largest rank class
WIDE_MAX_BLOCK_M = 16  # decode-sized row tiles: the accumulator is (BLOCK_M, TILE // rank class)


@triton.jit
def _wide_tile(y_row, stride_yr, row_mask, b_rows, b_nstride, b_rstride, b_rank, out_rows, stride_on,
               lo, width, rank, scaling, n0, bias_row, scale_row, shift_row,
               RC: tl.constexpr, TC: tl.constexpr, NT: tl.constexpr,
               DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_DORA: tl.constexpr):
    """``NT`` tiles of ``TC`` columns x ``RC`` rank columns from column ``n0`` of the module
    (``bias_row``, ``scale_row``, ``shift_row``: the slot's rows of the bias and DoRA tables)."""
    offs_r = tl.arange(0, RC)
    r_mask = offs_r < rank
    b_rmask = offs_r < b_rank  # the same rows; in a form the compiler can load 16 bytes at a time
    offs_c = tl.arange(0, TC)
    cols = n0 + offs_c
    bt = tl.load(b_rows + cols[None, :] * b_nstride + offs_r[:, None] * b_rstride,
                 mask=b_rmask[:, None] & (cols < width)[None, :], other=0.0)
    pdl.wait(USE_PDL)
    yt = tl.load(y_row + offs_r[None, :] * stride_yr, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    for t in tl.static_range(NT):
        cols = n0 + t * TC + offs_c
        n_mask = cols < width
        if t + 1 < NT:  # the next tile in flight while this one is added to the output
            nxt = cols + TC
            bt_next = tl.load(b_rows + nxt[None, :] * b_nstride + offs_r[:, None] * b_rstride,
                              mask=b_rmask[:, None] & (nxt < width)[None, :], other=0.0)
        acc = tl.dot(yt, bt, tl.zeros((yt.shape[0], TC), dtype=tl.float32), input_precision=DOT_PRECISION)
        acc = add_bias(acc, bias_row, lo + cols, n_mask, HAS_BIAS)
        out_ptrs = out_rows + (lo + cols)[None, :] * stride_on
        mask = row_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        res = dora_epilogue(base + acc * scaling, scale_row, shift_row, lo + cols, n_mask, HAS_DORA)
        tl.store(out_ptrs, res.to(out_rows.dtype.element_ty), mask=mask)
        if t + 1 < NT:
            bt = bt_next


@triton.jit
def _lora_expand_wide_kernel(
    y_ptr, b_ptr, out_ptr, b_offs_ptr, y_cols_ptr,
    bias_ptr, stride_biasl,  # HAS_BIAS: (>= num_slots, N_total)
    scale_ptr, shift_ptr, stride_dl,  # HAS_DORA: (>= num_slots, N_total) each
    R, num_slots, J0,
    OFF0, OFF1, OFF2, OFF3, OFF4,  # column offsets of this launch's modules; unused ones repeat the end
    NB1, NB2, NB3,  # first span index of modules 1..3 in grid axis 1 (unused ones: the total)
    stride_ys, stride_yr,
    stride_bl, stride_bn, stride_br,
    stride_os, stride_on,
    ranks_ptr, stride_rl,
    scalings_ptr, stride_sl,
    stride_tl,
    sorted_ids_ptr, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr,
    PACKED: tl.constexpr,
    B_ALIGN: tl.constexpr,
    Y_COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DORA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,  # elements of B a tile holds; a program's span is TILE // 16 columns
    MAX_RC: tl.constexpr,  # rank class of the launch's largest rank (16, 32, 64 or 128)
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_dependents(USE_PDL)
    chunk = tl.program_id(0)
    p = tl.program_id(1)
    jl = (p >= NB1).to(tl.int32) + (p >= NB2).to(tl.int32) + (p >= NB3).to(tl.int32)
    nb = p - tl.where(jl == 0, 0, tl.where(jl == 1, NB1, tl.where(jl == 2, NB2, NB3)))
    j = J0 + jl
    lo, hi = module_span(jl, OFF0, OFF1, OFF2, OFF3, OFF4)
    SPAN: tl.constexpr = TILE // 16
    n0 = nb * SPAN
    slot, n_rows, rank = chunk_rank(chunk_slot_ptr, chunk_len_ptr, ranks_ptr, stride_rl, chunk, j, num_slots, R, True)
    if rank <= 0:  # idle; it still waits (pdl.py)
        pdl.wait(USE_PDL)
        return
    scaling, row_mask, tok, y_row, b_rows, b_nstride, b_rstride, b_rank = expand_operands(
        y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr,
        chunk, slot, j, lo, rank, n_rows, R, stride_ys, stride_yr, stride_bl, stride_bn, stride_br, stride_sl,
        stride_tl, PACKED, B_ALIGN, Y_COLS, BLOCK_M)
    out_rows = out_ptr + tok[:, None] * stride_os
    width = hi - lo
    args = (y_row, stride_yr, row_mask, b_rows, b_nstride, b_rstride, b_rank, out_rows, stride_on,
            lo, width, rank, scaling, n0, bias_ptr + slot.to(tl.int64) * stride_biasl,
            scale_ptr + slot.to(tl.int64) * stride_dl, shift_ptr + slot.to(tl.int64) * stride_dl)
    # the rank's class; a class past the launch's largest rank's is never compiled (and never
    # taken: rank <= R <= MAX_RC)
    if rank <= 16:
        _wide_tile(*args, 16, TILE // 16, 1, DOT_PRECISION, USE_PDL, HAS_BIAS, HAS_DORA)
    elif rank <= 32:
        if MAX_RC >= 32:
            _wide_tile(*args, 32, TILE // 32, 2, DOT_PRECISION, USE_PDL, HAS_BIAS, HAS_DORA)
    elif rank <= 64:
        if MAX_RC >= 64:
            _wide_tile(*args, 64, TILE // 64, 4, DOT_PRECISION, USE_PDL, HAS_BIAS, HAS_DORA)
    elif MAX_RC >= 128:
        _wide_tile(*args, 128, TILE // 128, 8, DOT_PRECISION, USE_PDL, HAS_BIAS, HAS_DORA)

def wide_config(rank: int, max_width: int) -> dict:
    """Tile size and warps: tiles of 4K elements (8 KB of bf16; spans of 256 columns), smaller
    for narrow modules."""
    tile = 4096
    while tile > 2048 and tile // 16 > max(16, triton.next_power_of_2(max_width)):
        tile //= 2
    return dict(tile=tile, num_warps=4)


def rank_class(rank: int) -> int:
    return max(16, triton.next_power_of_2(max(1, rank)))


def launch_wide(y, weights, out, b_offs, y_cols, ranks, scalings, plan, r, num_slots, j0, offs, *,
                block_m, b_align, dot_precision, use_pdl, tile=None, num_warps=None, bias=None, dora=None):
    """One launch over the modules of ``offs`` (at most 4: ``offs`` their 5 column offsets, unused
    ones repeating the end), arguments as ``lora_expand``'s kernel."""
    widths = [b - a for a, b in zip(offs[:-1], offs[1:])]
    cfg = wide_config(r, max(widths))
    tile = tile or cfg["tile"]
    span = tile // 16
    starts, total = [], 0
    for w in widths:
        starts.append(total)
        total += triton.cdiv(w, span)
    if total == 0:
        return
    packed = b_offs is not None
    b_strides = (0, 0, 0) if packed else weights.stride()
    grid = (plan[1].shape[0], total)
    _lora_expand_wide_kernel[grid](
        y, weights, out, b_offs if packed else ranks, y_cols if y_cols is not None else ranks,
        bias if bias is not None else scalings, bias.stride(0) if bias is not None else 0,
        *(dora if dora is not None else (scalings, scalings)), dora[0].stride(0) if dora is not None else 0,
        r, num_slots, j0, *offs, *starts[1:],
        y.stride(0), y.stride(1),
        *b_strides,
        out.stride(0), out.stride(1),
        ranks, ranks.stride(0),
        scalings, scalings.stride(0),
        b_offs.stride(0) if packed else 0,
        *plan,
        PACKED=packed,
        B_ALIGN=b_align,
        Y_COLS=y_cols is not None,
        HAS_BIAS=bias is not None,
        HAS_DORA=dora is not None,
        BLOCK_M=block_m,
        TILE=tile,
        MAX_RC=rank_class(r),
        DOT_PRECISION=dot_precision,
        USE_PDL=use_pdl,
        num_warps=num_warps or cfg["num_warps"],
        launch_pdl=use_pdl > 0,
    )
