"""Segment copy: many contiguous runs of one source buffer into places anywhere on the device,
``dst_j[0:n_j] = src[src_off_j : src_off_j + n_j]`` for every segment j, in one launch.

A slot load fills hundreds of views per adapter (one per site, module, A or B), each a
contiguous run of the adapter's staged bytes into a contiguous block of some site's arena. Made
as tensor views and batched copies, every run costs the host a few tensor objects; here it
costs three integers (the destination's address, the run's offset in ``src`` and its length),
and the device reads them from a small table.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import torch

from ..kernel_support import tl, triton
SEGMENT_BLOCK = 2048  # elements a program moves per step (4 KB of 16-bit values)


@triton.jit
def _segment_copy_kernel(src_ptr, seg_ptr, n_segments, BLOCK: tl.constexpr):
    # one program per segment at a time, persistent over the table
    for s in range(tl.program_id(0), n_segments, tl.num_programs(0)):
        dst = tl.load(seg_ptr + 3 * s).to(tl.pointer_type(src_ptr.dtype.element_ty))
        src = src_ptr + tl.load(seg_ptr + 3 * s + 1)
        n = tl.load(seg_ptr + 3 * s + 2)
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def segment_table(segments: Sequence[int], device: torch.device) -> torch.Tensor:
    """The flat (address, source offset, length, ...) integers as an int64 table on ``device``;
    from pinned memory on CUDA (queued: the host does not wait)."""
    host = torch.frombuffer(bytearray(array("q", segments).tobytes()), dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def segment_copy(src: torch.Tensor, segments: Sequence[int], dst_dtype: torch.dtype,
                 max_programs: int = 1024) -> None:
    """Copy runs of the 1-D contiguous ``src`` into device memory: ``segments`` holds, per run, the
    destination's address (``tensor.data_ptr()`` of a contiguous block of ``src.dtype`` that
    outlives the copy), the run's first element in ``src`` and its length. The caller vouches for
    the addresses; ``dst_dtype`` (the destinations' dtype) must equal ``src.dtype``."""
    if len(segments) % 3:
        raise ValueError(f"segment_copy: {len(segments)} integers are not whole (address, offset, length) triples")
    if dst_dtype != src.dtype or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"segment_copy: src must be 1-D, contiguous and of the destinations' dtype "
                         f"({dst_dtype}); got {tuple(src.shape)} {src.dtype}")
    n = len(segments) // 3
    if n == 0:
        return
    table = segment_table(segments, src.device)
    _segment_copy_kernel[(min(n, max_programs),)](src, table, n, BLOCK=SEGMENT_BLOCK, num_warps=4)
