"""``silu(gate) * up`` of a gated MLP in one launch (torch runs it as two kernels).

The gate and up halves may be views of one fused gate/up projection output: rows are read
through their strides, nothing is copied first. Numerics follow torch's: the SiLU is computed in
fp32 and rounded to the input dtype, then the product is computed in fp32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _silu_mul_kernel(
    # pointers
    gate_ptr, up_ptr, out_ptr,
    # dimensions and strides
    n_cols, gate_row_stride, up_row_stride,
    # meta-parameters
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py
):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(dt), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``.

    Args:
        gate, up: (..., n), one dtype and shape; the last dimension contiguous and the leading ones
            collapsible to rows (true of slices of a fused (..., 2n) projection output).
    Returns:
        a new contiguous tensor shaped like ``gate``.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("the last dimension of gate and up must be contiguous")
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # views for the usual (B, T, n) slices
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(max(n, 1)))
    if g.shape[0] and n:
        use_pdl = pdl.mode(g)
        _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0),
                                                              BLOCK=block, USE_PDL=use_pdl, num_warps=4,
                                                              launch_pdl=use_pdl > 0)
    return out.view(gate.shape)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up
