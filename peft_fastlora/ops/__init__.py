"""Triton kernels, one file per op: a private ``_<op>_kernel`` (named for the op, so profiles tell
them apart) and a public launcher, which checks its inputs (``check=False``: the caller, a
backend, has already checked them).

The kernels know nothing of HF or PEFT; they read plain tensors and the chunk plan of
``peft_fastlora.batch``. Importing this package imports Triton where it is installed; without it
the modules still import (their torch references and configs work) and a kernel launch raises
``ModuleNotFoundError`` (``kernel_support``).
"""

from .decode_attention import decode_attention, decode_attention_config, decode_attention_reference
from .glu_expand import glu_expand, glu_expand_reference
from .kv_cache import kv_cache_write
from .lora_embedding import lora_embedding_a, lora_extra_token_embedding
from .lora_expand import expand_config, lora_expand
from .lora_fused import MAX_BLOCK_R as FUSED_MAX_BLOCK_R
from .lora_fused import MAX_MODULES as FUSED_MAX_MODULES
from .lora_fused import FusedWorkspace, fused_config, fused_supported, lora_fused
from .lora_shrink import lora_shrink, shrink_config
from .rms_norm import add_rms_norm, norm_add, norm_add_norm, rms_norm
from .rotary import apply_rotary, apply_rotary_reference
from .silu_mul import act_mul, act_mul_reference, silu_mul, silu_mul_reference


__all__ = [
    "act_mul",
    "act_mul_reference",
    "add_rms_norm",
    "FUSED_MAX_BLOCK_R",
    "FUSED_MAX_MODULES",
    "FusedWorkspace",
    "apply_rotary",
    "apply_rotary_reference",
    "decode_attention",
    "decode_attention_config",
    "decode_attention_reference",
    "expand_config",
    "fused_config",
    "fused_supported",
    "glu_expand",
    "glu_expand_reference",
    "kv_cache_write",
    "lora_embedding_a",
    "lora_expand",
    "lora_extra_token_embedding",
    "lora_fused",
    "lora_shrink",
    "norm_add",
    "norm_add_norm",
    "rms_norm",
    "shrink_config",
    "silu_mul",
    "silu_mul_reference",
]
