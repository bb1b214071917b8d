"""The row stride of a packed B block, shared by the kernels that read packed B."""

import triton
import triton.language as tl


@triton.jit
def packed_row_stride(rank, ALIGN: tl.constexpr):
    """Row stride of a packed B block: its rank, which the site keeps a multiple of ``ALIGN``
    (written so that the compiler knows it, and loads 16 bytes at a time where ALIGN is 8)."""
    return (rank + ALIGN - 1) // ALIGN * ALIGN
