"""The 4-D attention mask of a one-token decode step, built without transformers' mask machinery.

On calls whose decode steps fastlora's graphs replay, ``generate`` builds each step's 4-D mask on
the host before the step (``create_masks_for_generate``: some hundreds of microseconds of Python
for a handful of tiny kernels per layer type). Where that mask is transformers' causal mask over
fastlora's own static cache (one query token, sdpa's boolean or eager's additive mask function,
no extra mask functions), it is the step's 2-D padding mask laid into the first columns of a
(B, 1, 1, L) tensor of False (then 0 / the dtype's min for eager): two or three torch ops.
Sliding-window layers get the same mask while the step's tokens fit their window (their window
then hides nothing); past it, and in every other case, transformers' function builds it. The
tests compare the two in real ``generate`` calls (Llama, Qwen2, Mistral, Gemma 2; sdpa and eager),
on both transformers versions.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _compat

# arguments that change the mask; the fast path applies only when none is given
_OTHER_MASK_INPUTS = ("or_mask_function", "and_mask_function", "block_sequence_ids", "token_type_ids",
                      "mm_token_type_ids")


def decode_mask(store, kwargs) -> Optional[object]:
    """The step's mask, or None where transformers' function must build it."""
    emb, am = kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    if not isinstance(emb, torch.Tensor) or emb.dim() != 3 or emb.shape[1] != 1:
        return None
    if not isinstance(am, torch.Tensor) or am.dim() != 2 or am.shape[0] != emb.shape[0]:
        return None
    if am.dtype not in (torch.bool, torch.int64, torch.int32) or any(
            kwargs.get(k) is not None for k in _OTHER_MASK_INPUTS):
        return None
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.17 / 5.24 names
    length = store.length_of(cache)
    if length is None or am.shape[1] > length or "config" not in kwargs:
        return None
    spec = _compat.step_mask_spec(kwargs["config"])
    if spec is None or (spec.window is not None and am.shape[1] > spec.window):
        return None
    # the query is the step's last position (am covers every token so far): causal = am's columns
    mask = torch.zeros(am.shape[0], 1, 1, length, dtype=torch.bool, device=am.device)
    mask[:, 0, 0, : am.shape[1]] = am != 0
    if spec.additive:  # transformers' torch.where(mask, torch.tensor(0.0), min) copies a scalar from the
        # host at every step, which waits for the GPU; the same values with no copy:
        mask = torch.zeros(mask.shape, dtype=emb.dtype, device=am.device).masked_fill_(~mask, torch.finfo(emb.dtype).min)
    return {key: mask for key in spec.keys} if spec.keys else mask


def builder(store):
    """``create_masks_for_generate`` for a model whose calls ``store``'s caches serve."""
    original = _compat.transformers_mask_builder()

    def create_masks_for_generate(**kwargs):
        mask = decode_mask(store, kwargs)
        return original(**kwargs) if mask is None else mask

    return create_masks_for_generate
