"""A decode step's rotary embedding, KV-cache write and attention in one launch.

After the q/k/v projection a Llama-family decode step runs ``ops.rotary_kv`` (q and k rotated, k and
v stored into the static cache at its fill length) and then ``ops.decode_attention``, which waits
for it and reads the cache back. Here the attention's programs do the first kernel's work: each
(row, kv head) program rotates its query heads in registers, and the rotated key and the value of
the new token are stored into the cache (by split 0) and attended from registers, as one more
position of the online softmax. The loop over the cache leaves the new position out, so no
program reads what another is writing, and nothing waits for the store.

The cache receives exactly what ``ops.rotary_kv`` writes (the same roundings; the kernel is
compiled without FP contraction). The output equals ``decode_attention`` over that cache up to the
order of the softmax's sums.
"""

from __future__ import annotations

from typing import Optional

import torch

from .decode_attention import check_attention_inputs, launch_attention
from .kv_cache import check_write_inputs
from .rotary import check_rotary_inputs


def rotary_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, length: torch.Tensor,
                        ticket: Optional[torch.Tensor] = None, scaling: Optional[float] = None,
                        softcap: Optional[float] = None, **overrides) -> torch.Tensor:
    """``ops.rotary_kv.rotary_kv_write`` then ``ops.decode_attention`` over the written cache.

    Args:
        q: (B, H, 1, D) the step's query states before rotary, any strides with a contiguous last
            dimension (a view of a fused q/k/v output is fine); D even.
        k, v: (B, KVH, 1, D) the step's key (before rotary) and value states, likewise.
        cos, sin: (B or 1, 1, D) the rotary rows, q's dtype.
        k_cache, v_cache: (B_cache >= B, KVH, L, D) the static cache; the first B rows are attended.
        mask: (B or 1, 1, 1, L) bool or additive, as ``decode_attention`` takes it, over the cache
            with the new token at position ``length``.
        length: one integer on the device, the cache's fill length: the new token's position.
            Positions at or past L are neither written nor attended.
        ticket: optional one-element int32 zero on the device, shared by no launch running at the
            same time: then ``length`` is advanced by one in this launch (as ``ops.kv_cache``).
        scaling, softcap: as ``decode_attention``'s.
        overrides: ``decode_attention``'s launch overrides (num_splits, block_n, num_warps,
            num_stages, prewait).
    Returns:
        (B, 1, H, D) in q's dtype.
    """
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"rotary_kv_attention: q must be (B, H, 1, D), got {tuple(q.shape)}")
    cos, sin, c_sb = check_rotary_inputs(q, k, cos, sin)
    check_write_inputs(k, v, k_cache, v_cache, length, ticket)
    bsz = q.shape[0]
    keys, values = k_cache[:bsz], v_cache[:bsz]
    check_attention_inputs(q, keys, values, mask)
    if not bsz:
        if ticket is not None:
            length.add_(1)  # no program to advance it (nothing to write)
        return q.new_empty(0, 1, q.shape[1], q.shape[3])
    new = (k[:, :, 0], v[:, :, 0], cos, sin, c_sb, length, ticket)
    return launch_attention(q, keys, values, mask, scaling, softcap, overrides=overrides, new=new)


__all__ = ["rotary_kv_attention"]
