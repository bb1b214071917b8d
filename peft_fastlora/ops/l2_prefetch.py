"""Ask the L2 for the first K tiles of a GEMM program's weight before its PDL wait.

Launched with PDL (``ops.pdl``), a decode GEMM's programs may become resident while the kernel
before them still runs, most of all in that kernel's tail, where its last programs leave the
memory system partly idle. The weights are no kernel's output, so a program may start their
stream before its ``wait``: here each program asks the L2 for the first ``PREFETCH`` K tiles of
its rows of the weight, one bulk prefetch (``cp.async.bulk.prefetch.L2``, Hopper) a row, and its
K loop then finds them there. Only the first tiles: the L2 holds a fraction of one layer's
weight, and a program that becomes resident long before its wait ends (beside a long kernel)
would see them evicted again; ``PREFETCH`` is part of the tile config, chosen by measurement
(``benchmarks/probe_tma_gemm.py``).

A prefetch is a hint: it reads nothing into registers and changes no result. Under Triton's
interpreter (``PTX`` false) it is left out. ``FASTLORA_L2_PREFETCH=0`` in the environment (read
at import) or ``ENABLED = False`` turns it off for every launch, for an A/B.
"""

from __future__ import annotations

import os
from typing import Optional

import triton
import triton.language as tl

ENABLED = os.environ.get("FASTLORA_L2_PREFETCH", "1").strip().lower() not in ("0", "off", "false")
OVERRIDE: Optional[int] = None  # benchmarks' A/B: these tiles for every launch, whatever its config says


def tiles(prefetch: int) -> int:
    """The ``PREFETCH`` a launch takes: the config's tiles (or ``OVERRIDE``) while the switch is on,
    else 0. The kernels prefetch only when launched with PDL (only then can they run before the
    previous kernel ends)."""
    if not ENABLED:
        return 0
    return prefetch if OVERRIDE is None else OVERRIDE


@triton.jit
def prefetch_rows(w_ptr, rows, row_ok, stride_w, k0, k_cols, PTX: tl.constexpr):
    """Ask the L2 for ``k_cols`` elements from column ``k0`` of each row ``rows`` (where ``row_ok``)
    of the row-major ``w``. The byte count is rounded down to the 16 the instruction takes; the
    start must be 16-byte aligned (``k0`` a multiple of 8 elements of a 16-byte aligned row)."""
    if PTX:
        nbytes = (k_cols * w_ptr.dtype.element_ty.primitive_bitwidth // 8) // 16 * 16
        go = (row_ok & (nbytes > 0)).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [w_ptr + rows.to(tl.int64) * stride_w + k0, go, tl.zeros_like(go) + nbytes],
            dtype=tl.int32, is_pure=False, pack=1)
