"""What the expand's two launches (``lora_expand``, ``lora_expand_wide``) and the fused kernel
share: where a program's operands are, once its idle checks have passed."""

from ..kernel_support import tl, triton


def check_column_table(who: str, table, num_slots: int, n_total: int, name: str = "bias") -> None:
    """A per-slot column table (a LoRA B bias, DoRA's scale or shift): (>= num_slots, N_total),
    unit column stride (None: none)."""
    if table is not None and (table.dim() != 2 or table.shape[0] < num_slots or table.shape[1] != n_total
                              or table.stride(1) != 1):
        raise ValueError(f"{who}: {name} must be (>= {num_slots}, {n_total}) with unit column stride, "
                         f"got {tuple(table.shape)}")


def check_dora(who: str, dora, num_slots: int, n_total: int) -> None:
    """DoRA's (scale, shift) tables: each as ``check_column_table``, with one row stride (None: no DoRA)."""
    if dora is None:
        return
    scale, shift = dora
    check_column_table(who, scale, num_slots, n_total, "dora scale")
    check_column_table(who, shift, num_slots, n_total, "dora shift")
    if scale.stride(0) != shift.stride(0):
        raise ValueError(f"{who}: the DoRA scale and shift tables must share a row stride")


@triton.jit
def add_bias(acc, bias_row, cols, n_mask, HAS_BIAS: tl.constexpr):
    """``acc`` (a tile's delta before the scaling, float32) plus the slot's LoRA B bias in ``cols``."""
    if HAS_BIAS:
        acc += tl.load(bias_row + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def dora_epilogue(res, scale_row, shift_row, cols, n_mask, HAS_DORA: tl.constexpr):
    """DoRA: ``res`` (the base output plus the scaled delta, float32) times the slot's column
    scale plus its shift (``(1 - scale) * base bias``): ``scale * (W x + s B A x) + bias``."""
    if HAS_DORA:
        g = tl.load(scale_row + cols, mask=n_mask, other=1.0).to(tl.float32)
        h = tl.load(shift_row + cols, mask=n_mask, other=0.0).to(tl.float32)
        res = res * g[None, :] + h[None, :]
    return res


@triton.jit
def packed_row_stride(rank, ALIGN: tl.constexpr):
    """Row stride of a packed B block: its rank, which the site keeps a multiple of ``ALIGN``
    (written so that the compiler knows it, and loads 16 bytes at a time where ALIGN is 8)."""
    return (rank + ALIGN - 1) // ALIGN * ALIGN


@triton.jit
def module_span(jl, OFF0, OFF1, OFF2, OFF3, OFF4):
    """Output columns ``[lo, hi)`` of the launch's module ``jl`` (0-3) from its column offsets."""
    lo = tl.where(jl == 0, OFF0, tl.where(jl == 1, OFF1, tl.where(jl == 2, OFF2, OFF3)))
    hi = tl.where(jl == 0, OFF1, tl.where(jl == 1, OFF2, tl.where(jl == 2, OFF3, OFF4)))
    return lo, hi


@triton.jit
def chunk_rank(chunk_slot_ptr, chunk_len_ptr, ranks_ptr, stride_rl, chunk, j, num_slots, R, active):
    """(slot, rows, rank) of a chunk's module ``j``; rank 0 where its program has nothing to do:
    not ``active``, no adapter, a stale plan (its slot is never read past the weights), no rows,
    or rank 0. A rank table larger than the buffer's padded rank ``R`` never spills past it."""
    slot = tl.load(chunk_slot_ptr + chunk)
    n_rows = tl.load(chunk_len_ptr + chunk)
    ok = active & (slot >= 0) & (slot < num_slots) & (n_rows > 0)
    rank = tl.load(ranks_ptr + slot * stride_rl + j, mask=ok, other=0)
    return slot, n_rows, tl.minimum(rank, R)


@triton.jit
def expand_operands(y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr,
                    chunk, slot, j, lo, rank, n_rows, R,
                    stride_ys, stride_yr, stride_bl, stride_bn, stride_br, stride_sl, stride_tl,
                    PACKED: tl.constexpr, B_ALIGN: tl.constexpr, Y_COLS: tl.constexpr, BLOCK_M: tl.constexpr):
    """A (chunk, module j) program's scaling, row mask, token ids, the address of its rows of
    ``y`` (at their first rank column), where its B block's first row (column ``lo`` of the
    output) starts, that block's row stride, its rank stride, and the rank B's rows are masked
    by. Packed, (width, rank): rank stride 1 and the rank rows masked by the row stride (the same
    rows, in a form the compiler knows to be a multiple of B_ALIGN: 16-byte loads)."""
    scaling = tl.load(scalings_ptr + slot * stride_sl + j)
    start = tl.load(chunk_start_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < n_rows
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    if Y_COLS:
        y_col = tl.load(y_cols_ptr + slot * stride_tl + j).to(tl.int64)
    else:
        y_col = j * R
    y_row = y_ptr + tok[:, None] * stride_ys + y_col * stride_yr
    if PACKED:  # (width, rank)
        b_off = tl.multiple_of(tl.load(b_offs_ptr + slot * stride_tl + j), B_ALIGN)
        b_rows = b_ptr + b_off
        b_nstride = packed_row_stride(rank, B_ALIGN)
        b_rstride = 1
        b_rank = b_nstride
    else:
        b_rows = b_ptr + slot.to(tl.int64) * stride_bl + lo * stride_bn
        b_nstride = stride_bn
        b_rstride = stride_br
        b_rank = rank
    return scaling, row_mask, tok, y_row, b_rows, b_nstride, b_rstride, b_rank
