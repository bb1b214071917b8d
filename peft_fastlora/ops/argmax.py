"""``torch.argmax(x, dim=-1)`` of a 2-D float tensor with many columns (a decode step's logits),
spread over the GPU.

torch reduces each row of the logits in one block: at a vocabulary of 128k and a few rows, one or
a few SMs read half a megabyte each, a round trip at a time, while the rest of the GPU idles
between two decode steps. Here each program takes ``BLOCK`` columns of one row and writes the
chunk's maximum and the column of its first occurrence; ``torch.argmax`` over the few chunk maxima
of each row picks the chunk, and the chunk's column is gathered.

The answer is torch's, bit for bit: NaN counts as larger than every number (a chunk with a NaN
reports its first NaN, and torch's argmax over the chunks takes the first chunk with one); of
equal maxima the first column wins (the first in its chunk, then the first chunk, since chunks
are in column order); -0.0 equals 0.0; a row of -inf gives column 0. float16 and bfloat16 are
compared in float32, which orders them exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns a program reads
MIN_COLS = 4 * BLOCK  # narrower rows keep torch.argmax (too few chunks to be worth a second kernel)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _argmax_chunks_kernel(
    # pointers: x (rows, n_cols); per (row, chunk): the chunk's maximum (float32), its column (int64)
    x_ptr, val_ptr, col_ptr,
    # dimensions and strides
    n_cols, n_chunks, stride_row,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    nan = (x != x) & ok
    none = n_cols  # past every column: "no such column"
    first_nan = tl.min(tl.where(nan, cols, none))
    top = tl.max(tl.where(nan, float("-inf"), x))
    first_top = tl.min(tl.where((x == top) & ok & ~nan, cols, none))
    has_nan = first_nan < none
    out = row * n_chunks + chunk
    tl.store(val_ptr + out, tl.where(has_nan, float("nan"), top))
    tl.store(col_ptr + out, tl.where(has_nan, first_nan, first_top).to(tl.int64))


def takes(x: torch.Tensor, dim, keepdim: bool) -> bool:
    """Whether ``argmax_rows`` gives ``torch.argmax(x, dim, keepdim)``'s answer for these arguments
    (and is worth its launch): a 2-D float tensor of at least ``MIN_COLS`` columns with unit
    stride on them, reduced over its last dimension, no gradient."""
    return (isinstance(x, torch.Tensor) and x.dim() == 2 and dim in (-1, 1) and not keepdim
            and x.dtype in _DTYPES and x.shape[1] >= MIN_COLS and x.stride(1) == 1 and x.shape[0] > 0
            and not x.requires_grad)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for a (rows, cols) tensor ``takes`` accepts: int64, (rows,)."""
    if not takes(x, -1, False):
        raise ValueError(f"argmax_rows takes a 2-D {_DTYPES} tensor of >= {MIN_COLS} columns with unit "
                         f"stride on them and no gradient, not {tuple(x.shape)} {x.dtype}")
    rows, n_cols = x.shape
    n_chunks = triton.cdiv(n_cols, BLOCK)
    vals = torch.empty(rows, n_chunks, dtype=torch.float32, device=x.device)
    cols = torch.empty(rows, n_chunks, dtype=torch.int64, device=x.device)
    _argmax_chunks_kernel[(n_chunks, rows)](x, vals, cols, n_cols, n_chunks, x.stride(0), BLOCK=BLOCK,
                                            num_warps=8)
    return cols.gather(1, torch.argmax(vals, dim=1, keepdim=True)).squeeze(1)
