"""What the expand's two launches (``lora_expand``, ``lora_expand_wide``) and the fused kernel
share: where a program's operands are, once its idle checks have passed."""

import triton
import triton.language as tl


@triton.jit
def packed_row_stride(rank, ALIGN: tl.constexpr):
    """Row stride of a packed B block: its rank, which the site keeps a multiple of ``ALIGN``
    (written so that the compiler knows it, and loads 16 bytes at a time where ALIGN is 8)."""
    return (rank + ALIGN - 1) // ALIGN * ALIGN


@triton.jit
def expand_operands(y_ptr, b_ptr, b_offs_ptr, y_cols_ptr, scalings_ptr, sorted_ids_ptr, chunk_start_ptr,
                    chunk, slot, j, lo, rank, n_rows, R,
                    stride_ys, stride_yr, stride_bl, stride_bn, stride_sl, stride_tl,
                    PACKED: tl.constexpr, B_ALIGN: tl.constexpr, Y_COLS: tl.constexpr, BLOCK_M: tl.constexpr):
    """A (chunk, module j) program's scaling, row mask, token ids, the address of its rows of
    ``y`` (at their first rank column), and where its B block's first row (column ``lo`` of the
    output) starts with that block's row stride. B's rank stride: 1 packed, ``stride_br`` padded."""
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
    else:
        b_rows = b_ptr + slot.to(tl.int64) * stride_bl + lo * stride_bn
        b_nstride = stride_bn
    return scaling, row_mask, tok, y_row, b_rows, b_nstride
