"""A step's rotary cos and sin read from a table of every position, in one launch.

transformers' rotary embedding modules compute cos and sin for a step's positions from scratch:
about ten small kernels a step (the positions to float, the outer product with the inverse
frequencies, a concatenation, cos, sin, their scaling and casts) before the first layer. A table of
the module's own outputs for positions ``0 .. L-1`` (``base_ops.rotary_tables`` builds it with the
module's forward) gives the same values: each position's row is what the module computes for it.
Here one program copies one token's cos and sin rows.

The callers keep positions below ``L`` (the decode runner sizes the table past its cache). A
position outside ``[0, L)`` is clamped so that no read leaves the table.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..kernel_support import tl, triton

@triton.jit
def _gather_cos_sin_kernel(table_ptr, pos_ptr, out_ptr, n_tokens, length, dim, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    p = tl.load(pos_ptr + token).to(tl.int64)
    p = tl.minimum(tl.maximum(p, 0), length - 1)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    for half in tl.static_range(2):  # 0: cos, 1: sin
        row = tl.load(table_ptr + (half * length + p) * dim + cols, mask=mask)
        tl.store(out_ptr + (half * n_tokens + token) * dim + cols, row, mask=mask)


def _out(table: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    if table.dim() != 3 or table.shape[0] != 2 or not table.is_contiguous():
        raise ValueError(f"the table must be a contiguous (2, positions, dim) tensor, got {tuple(table.shape)}")
    if position_ids.dtype not in (torch.int32, torch.int64) or position_ids.device != table.device:
        raise ValueError("position_ids must be integers on the table's device")
    return torch.empty((2,) + tuple(position_ids.shape) + (table.shape[2],), dtype=table.dtype, device=table.device)


def gather_cos_sin(table: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``position_ids`` (any shape): ``table[0][position_ids]`` and ``table[1][...]``,
    contiguous, in one launch. ``table``: (2, L, dim), cos then sin of positions 0 .. L-1."""
    out = _out(table, position_ids)
    n = position_ids.numel()
    if n:
        pos = position_ids.reshape(-1)
        dim = table.shape[2]
        _gather_cos_sin_kernel[(n,)](table, pos if pos.is_contiguous() else pos.contiguous(), out, n,
                                     table.shape[1], dim, BLOCK_D=triton.next_power_of_2(dim), num_warps=1)
    return out[0], out[1]


def gather_cos_sin_reference(table: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``gather_cos_sin`` in torch ops (the test oracle and the path where the kernel does not run)."""
    out = _out(table, position_ids)
    idx = position_ids.long().clamp(0, table.shape[1] - 1)
    out[0] = table[0][idx]
    out[1] = table[1][idx]
    return out[0], out[1]


__all__ = ["gather_cos_sin", "gather_cos_sin_reference"]
