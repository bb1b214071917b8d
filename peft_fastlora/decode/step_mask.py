"""The 4-D attention mask of a one-token decode step, built without transformers' mask machinery.

On calls whose decode steps fastlora's graphs replay, ``generate`` builds each step's 4-D mask on
the host before the step (``create_masks_for_generate``: some hundreds of microseconds of Python
for a handful of tiny kernels per layer type). Where that mask is transformers' causal mask over
fastlora's own static cache (one query token, sdpa's boolean or eager's additive mask function,
no extra mask functions), it is the step's 2-D padding mask laid into the first columns of a
(B, 1, 1, L) tensor of False (then 0 / the dtype's min for eager): two or three torch ops.
Sliding-window layers get the same mask while the step's tokens fit their window (their window
then hides nothing); past it, and in every other case, transformers' function builds it. A call
with no padding may come with no 2-D mask (transformers 5.24 drops one of all ones for one row,
5.25 for any batch); its step's mask is then every column up to the query's position, where no
window is shorter than the cache. The
tests compare the two in real ``generate`` calls (Llama, Qwen2, Mistral, Gemma 2; sdpa and eager),
on both transformers versions.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..compat.generate import step_mask_spec, transformers_mask_builder
from . import step_advance

# arguments that change the mask; the fast path applies only when none is given
_OTHER_MASK_INPUTS = ("or_mask_function", "and_mask_function", "block_sequence_ids", "token_type_ids",
                      "mm_token_type_ids")


def decode_mask(store, kwargs) -> Optional[object]:
    """The step's mask, or None where transformers' function must build it."""
    emb, am, pos = kwargs.get("inputs_embeds"), kwargs.get("attention_mask"), kwargs.get("position_ids")
    if not isinstance(emb, torch.Tensor) or emb.dim() != 3 or emb.shape[1] != 1:
        return None
    rows = emb.shape[0]
    if am is None:  # a mask of all ones dropped by transformers: no padding, causal by position
        if not isinstance(pos, torch.Tensor) or pos.shape != (rows, 1) or pos.is_floating_point():
            return None
    elif not isinstance(am, torch.Tensor) or am.dim() != 2 or am.shape[0] != rows or am.dtype not in (
            torch.bool, torch.int64, torch.int32):
        return None
    if any(kwargs.get(k) is not None for k in _OTHER_MASK_INPUTS):
        return None
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.17 / 5.24 names
    length = store.length_of(cache)
    if length is None or (am is not None and am.shape[1] > length) or "config" not in kwargs:
        return None
    spec = step_mask_spec(kwargs["config"])
    # a window hides nothing while the tokens fit it; without a 2-D mask their count is on the GPU
    # only, so the window must cover the whole cache
    width = am.shape[1] if am is not None else length
    if spec is None or (spec.window is not None and width > spec.window):
        return None
    if am is not None:  # the query is the step's last position (am covers every token so far)
        mask = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=am.device)
        mask[:, 0, 0, : am.shape[1]] = am != 0
    else:  # the columns up to the query's position
        mask = (torch.arange(length, device=pos.device) <= pos).view(rows, 1, 1, length)
    if spec.additive:  # transformers' torch.where(mask, torch.tensor(0.0), min) copies a scalar from the
        # host at every step, which waits for the GPU; the same values with no copy:
        mask = torch.zeros(mask.shape, dtype=emb.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(emb.dtype).min)
    # marks it for ``step_advance``, which writes the next steps' masks on the GPU while they stay
    # this form (within the window)
    setattr(mask, step_advance.MASK_TAG, spec.window or 0)
    return {key: mask for key in spec.keys} if spec.keys else mask


def builder(store):
    """``create_masks_for_generate`` for a model whose calls ``store``'s caches serve."""
    original = transformers_mask_builder()

    def create_masks_for_generate(**kwargs):
        mask = decode_mask(store, kwargs)
        return original(**kwargs) if mask is None else mask

    return create_masks_for_generate
