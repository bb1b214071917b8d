"""RMSNorm in one launch (HF's eager RMSNorm is five or six small kernels), optionally with the
residual add before it (``add_rms_norm``: a decoder layer's ``residual + attention output`` and
the post-attention norm of that sum, one launch instead of two), and for Gemma 2's sandwich
norms a norm of the sublayer's output before the add too (``norm_add``: ``residual + norm(x)``;
``norm_add_norm``: that sum and the next norm of it, one launch instead of three).

Numerics follow transformers' RMSNorms (a norm before the add is rounded to the input dtype, as its
module returns it; the residual sum is rounded to the input dtype, as torch's add rounds it, and
normed from that rounded value): the row is upcast to float32 and scaled by
rsqrt(mean(x^2) + eps); then either (Llama family) rounded to the input dtype, multiplied by the
weight and rounded again (what ``weight * normed.to(input_dtype)`` does in torch), or (Gemma,
``unit_offset``) multiplied by ``1 + weight`` in float32 and rounded once.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..kernel_support import tl, triton
from . import pdl


@triton.jit
def _normed(x, w, n_cols, eps, UNIT_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """One row's RMSNorm in float32, before its final rounding to ``dtype``."""
    var = tl.sum(x * x, axis=0) / n_cols
    normed = x * tl.math.rsqrt(var + eps)
    if UNIT_OFFSET:
        return normed * (1.0 + w)
    return w * normed.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr, w_ptr, out_ptr,
    res_ptr, sum_ptr,  # RESIDUAL: the residual, and where residual + x goes
    w_pre_ptr,  # PRE: the weight of the norm applied to x before the add
    # dimensions and strides
    n_cols, x_row_stride, out_row_stride, res_row_stride, sum_row_stride,
    # parameters
    eps, eps_pre,
    # meta-parameters
    UNIT_OFFSET: tl.constexpr,  # Gemma: x * rsqrt(...) * (1 + w), all in float32, one rounding
    RESIDUAL: tl.constexpr,
    PRE: tl.constexpr,  # x is normed (w_pre, eps_pre) and rounded before the add
    POST: tl.constexpr,  # the (sum or x) is normed into out (False: only the sum is written)
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py: the weights are read before the wait
):
    pdl.launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = x_ptr.dtype.element_ty
    # every load upcast: the interpreter keeps bf16 as raw bits otherwise
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PRE:
        w_pre = tl.load(w_pre_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if PRE:
        x = _normed(x, w_pre, n_cols, eps_pre, UNIT_OFFSET, dt).to(dt).to(tl.float32)
    if RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_row_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    if POST:
        y = _normed(x, w, n_cols, eps, UNIT_OFFSET, dt)
        tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension; with
    ``unit_offset`` (Gemma), ``(x.float() * rsqrt(...) * (1 + weight.float())).to(x.dtype)``.

    Args:
        x: (..., n) float32 / float16 / bfloat16; the last dimension must be contiguous.
        weight: (n,), the same dtype as ``x``.
    Returns:
        a new tensor shaped like ``x``.
    """
    return _launch(x, None, weight, eps, unit_offset)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` and ``rms_norm(s, weight, eps, unit_offset)`` in one launch.

    Args:
        x, residual: (..., n), one shape and dtype; last dimensions contiguous (rows may be strided,
            as slices of a wider GEMM output are).
        weight: (n,), the same dtype.
    Returns:
        (the norm of s, s): new contiguous tensors shaped like ``x``.
    """
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps, unit_offset)


def norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """``residual + rms_norm(x, weight, eps, unit_offset)`` in one launch (Gemma 2's norm after a
    sublayer and the residual add). Shapes as ``add_rms_norm``; returns a new contiguous tensor."""
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps, unit_offset, pre=(weight, eps), post=False)[1]


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, pre_weight: torch.Tensor, pre_eps: float,
                  weight: torch.Tensor, eps: float, unit_offset: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + rms_norm(x, pre_weight, pre_eps)`` and ``rms_norm(s, weight, eps)`` in one
    launch (Gemma 2: the post-attention norm, the residual add, the pre-feedforward norm).
    Returns (the norm of s, s), as ``add_rms_norm``."""
    _check_residual(x, residual)
    return _launch(x, residual, weight, eps, unit_offset, pre=(pre_weight, pre_eps))


def _check_residual(x, residual):
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} differs from x "
                         f"{tuple(x.shape)} {x.dtype}")


def _launch(x, residual, weight, eps, unit_offset, pre=None, post=True):
    n = x.shape[-1]
    for w in (weight,) + ((pre[0],) if pre is not None else ()):
        if w.shape != (n,):
            raise ValueError(f"weight has shape {tuple(w.shape)}, expected ({n},)")
        if w.dtype != x.dtype:
            raise TypeError(f"weight dtype {w.dtype} differs from the input's {x.dtype}")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("the last dimension of x (and of the residual) must be contiguous")
    rows = x.reshape(-1, n)  # a view for the usual (B, T, n) hidden states
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device) if post else rows
    res = summed = rows
    if residual is not None:
        res = residual.reshape(-1, n)
        summed = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    w_pre, eps_pre = pre if pre is not None else (weight, eps)
    block = triton.next_power_of_2(n)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    use_pdl = pdl.mode(x)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, res, summed, w_pre, n, rows.stride(0), out.stride(0),
                                           res.stride(0), summed.stride(0), float(eps), float(eps_pre),
                                           UNIT_OFFSET=unit_offset, RESIDUAL=residual is not None,
                                           PRE=pre is not None, POST=post, BLOCK=block, USE_PDL=use_pdl,
                                           num_warps=num_warps, launch_pdl=use_pdl > 0)
    return (out.view(x.shape) if post else None), (summed.view(x.shape) if residual is not None else None)
