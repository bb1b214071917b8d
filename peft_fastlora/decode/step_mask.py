"""The 4-D attention mask of a one-token decode step, built without transformers' mask machinery.

On calls whose decode steps fastlora's graphs replay, ``generate`` builds each step's 4-D mask on
the host before the step (``create_masks_for_generate``: some hundreds of microseconds of Python
for a handful of tiny kernels). Where that mask is the plain causal boolean mask over fastlora's
own static cache (one query token, an sdpa-style mask function, no sliding window, no extra mask
functions), it is the step's 2-D padding mask laid into the first columns of a (B, 1, 1, L)
tensor of False: two torch ops. Every other case goes to transformers' function. The tests
compare the two for random paddings, lengths and cache sizes, on both transformers versions.
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
    keyed = _compat.plain_causal_bool_mask(kwargs["config"])
    if keyed is None:
        return None
    # the query is the step's last position (am covers every token so far): causal = am's columns
    mask = torch.zeros(am.shape[0], 1, 1, length, dtype=torch.bool, device=am.device)
    mask[:, 0, 0, : am.shape[1]] = am != 0
    return {"full_attention": mask} if keyed else mask


def builder(store):
    """``create_masks_for_generate`` for a model whose calls ``store``'s caches serve."""
    original = _compat.transformers_mask_builder()

    def create_masks_for_generate(**kwargs):
        mask = decode_mask(store, kwargs)
        return original(**kwargs) if mask is None else mask

    return create_masks_for_generate
