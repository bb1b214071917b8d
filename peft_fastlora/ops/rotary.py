"""Rotary position embedding of the query and key heads of a step in one launch.

transformers' ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, then the same for k) is
about ten small kernels per layer: two multiplies, a negation, a concatenation and an add for each
of q and k. Here one program rotates a block of heads of one token, q heads and k heads alike.

Numerics reproduce torch's exactly: each product and the sum are rounded to the input dtype, as
torch's elementwise ops on half-precision tensors do (fp32 math, one rounding per op). The kernel
is compiled without FP contraction: with it, the compiler folds a product's rounding into an FMA
with the sum, and bf16 outputs then differ from torch's by one ulp (seen on the GPU; the
interpreter cannot show it).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..kernel_support import tl, triton
from . import pdl


@triton.jit
def cos_sin_halves(cos_ptr, sin_ptr, row_offset, half, offs_d, d_mask):
    """A position's cos and sin rows, each as its two halves, in fp32 (1, BLOCK_D) tiles."""
    c_row = cos_ptr + row_offset
    s_row = sin_ptr + row_offset
    c1 = tl.load(c_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def rotate_halves(x1, x2, c1, c2, s1, s2, dt):
    """``x * cos + rotate_half(x) * sin`` of the halves (x1, x2) (fp32), rotate_half(x) = (-x2, x1);
    each product and the sum rounded to ``dt`` like torch's ops (the kernel must be compiled
    without FP contraction, module doc)."""
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return y1, y2


@triton.jit
def _rotary_kernel(
    # pointers
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    # dimensions
    seq_len, num_q_heads, num_heads, half,
    # strides (q, k: batch, head, position; cos/sin: batch, position; the last dim is contiguous)
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, c_sb, c_ss,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,  # pdl.mode(); see pdl.py (cos and sin are the step's: read after the wait)
):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0)
    b = token // seq_len
    s = token % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < half

    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, b * c_sb + s * c_ss, half, offs_d, d_mask)

    # heads [0, num_q_heads) are query heads, the rest key heads
    is_q = heads < num_q_heads
    kh = tl.where(is_q, 0, heads - num_q_heads)
    qh = tl.where(is_q, heads, 0)
    src = tl.where(is_q[:, None], q_ptr + b * q_sb + qh[:, None] * q_sh + s * q_ss,
                   k_ptr + b * k_sb + kh[:, None] * k_sh + s * k_ss)
    # outputs are contiguous (B, heads, S, 2 * half)
    dim = 2 * half
    dst = tl.where(is_q[:, None], q_out_ptr + ((b * num_q_heads + qh[:, None]) * seq_len + s) * dim,
                   k_out_ptr + ((b * (num_heads - num_q_heads) + kh[:, None]) * seq_len + s) * dim)
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    x1 = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)

    y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2, q_out_ptr.dtype.element_ty)
    tl.store(dst + offs_d[None, :], y1, mask=mask)
    tl.store(dst + half + offs_d[None, :], y2, mask=mask)


def check_rotary_inputs(q, k, cos, sin):
    """Raise on inputs ``apply_rotary`` does not take; returns (cos, sin, cos's batch stride), with
    cos and sin made contiguous where their strides differ (0 for a batch of one, shared by every row)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be (B, heads, S, D) alike")
    bsz, _, seq, dim = q.shape
    if dim % 2:
        raise ValueError(f"head dim {dim} is odd")
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (seq, dim) or cos.shape[0] not in (1, bsz):
        raise ValueError(f"cos / sin {tuple(cos.shape)} must be ({bsz} or 1, {seq}, {dim})")
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1:
        raise TypeError("q, k, cos and sin must share one dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the last dimension of q and k must be contiguous")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, (cos.stride(0) if cos.shape[0] == bsz else 0)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q * cos + rotate_half(q) * sin`` and the same for ``k``, in one launch.

    Args:
        q: (B, H, S, D) query states, any strides with a contiguous last dimension (a view of a
            fused q/k/v projection output is fine).
        k: (B, KVH, S, D) key states, the same dtype and device.
        cos, sin: (B or 1, S, D), the same dtype (what transformers' rotary embedding returns).
    Returns:
        (q_embed, k_embed), new contiguous tensors shaped like ``q`` and ``k``.
    """
    cos, sin, c_sb = check_rotary_inputs(q, k, cos, sin)
    bsz, num_q, seq, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_heads = num_q + k.shape[1]
    block_h = min(16, triton.next_power_of_2(num_heads))
    grid = (bsz * seq, triton.cdiv(num_heads, block_h))
    if bsz * seq:
        use_pdl = pdl.mode(q)
        _rotary_kernel[grid](
            q, k, cos, sin, q_out, k_out,
            seq, num_q, num_heads, dim // 2,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            c_sb, cos.stride(1),
            BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(max(dim // 2, 1)), USE_PDL=use_pdl, num_warps=4,
            enable_fp_fusion=False, launch_pdl=use_pdl > 0)
    return q_out, k_out


def apply_rotary_reference(q, k, cos, sin):
    """transformers' formula, op by op (the oracle in the tests)."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
