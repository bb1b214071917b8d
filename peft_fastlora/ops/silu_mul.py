"""``act(gate) * up`` of a gated MLP in one launch (torch runs it as two kernels or more), for the
two activations of the common families: SiLU (Llama, Mistral, Qwen) and GELU with the tanh
approximation (Gemma's ``gelu_pytorch_tanh``).

The gate and up halves may be views of one fused gate/up projection output: rows are read
through their strides, nothing is copied first. Numerics follow torch's: the activation is
computed in fp32 and rounded to the input dtype, then the product is computed in fp32 and rounded
again. GELU-tanh is computed in torch's CUDA kernel's order, ``0.5 x (1 + tanh(z))`` with
``z = sqrt(2 / pi) (x + 0.044715 x^3)`` and CUDA's ``tanhf`` (libdevice), so that it rounds where
torch's does (for x below about -4, ``1 + tanh`` cancels: an algebraically equal form such as
``x * sigmoid(2 z)`` gives other values there). Triton's interpreter has no libdevice: there tanh
comes from ``exp``.
"""

from __future__ import annotations

import torch

from ..kernel_support import AVAILABLE, tl, triton
from ..kernel_support import interpreting
from . import pdl

if AVAILABLE:
    from triton.language.extra import libdevice

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _tanh(z, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.tanh(z)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def act_mul_rounded(g, u, dt, GELU_TANH: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``act(g) * u`` in torch's roundings (module doc): g and u float32 values of dtype ``dt``,
    the activation rounded to ``dt``, the product returned in float32 (the caller rounds it)."""
    if GELU_TANH:
        act = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g)), LIBDEVICE))
    else:
        act = g / (1.0 + tl.exp(-g))
    return act.to(dt).to(tl.float32) * u


@triton.jit
def _act_mul_kernel(
    # pointers
    gate_ptr, up_ptr, out_ptr,
    # dimensions and strides
    n_cols, gate_row_stride, up_row_stride,
    # meta-parameters
    GELU_TANH: tl.constexpr,  # False: SiLU
    LIBDEVICE: tl.constexpr,  # False under Triton's interpreter
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
    tl.store(out_ptr + row * n_cols + cols, act_mul_rounded(g, u, dt, GELU_TANH, LIBDEVICE).to(dt), mask=mask)


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up``, ``act`` one of ``ACTIVATIONS``.

    Args:
        gate, up: (..., n), one dtype and shape; the last dimension contiguous and the leading ones
            collapsible to rows (true of slices of a fused (..., 2n) projection output).
    Returns:
        a new contiguous tensor shaped like ``gate``.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown gated activation {act!r}; the kernel takes {ACTIVATIONS}")
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
        _act_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0),
                                                             GELU_TANH=act == "gelu_tanh",
                                                             LIBDEVICE=not interpreting(), BLOCK=block,
                                                             USE_PDL=use_pdl, num_warps=4,
                                                             launch_pdl=use_pdl > 0)
    return out.view(gate.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (``act_mul``)."""
    return act_mul(gate, up, "silu")


def act_mul_reference(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """torch's own: ``F.silu`` or ``F.gelu(approximate="tanh")``, then the product."""
    f = torch.nn.functional
    return (f.silu(gate) if act == "silu" else f.gelu(gate, approximate="tanh")) * up


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act_mul_reference(gate, up, "silu")
