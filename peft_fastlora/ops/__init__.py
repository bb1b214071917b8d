"""Triton kernels, one file per op: a private ``_<op>_kernel`` (named for the op, so profiles tell them apart) and a public launcher.

The kernels know nothing of HF or PEFT; they read plain tensors and the chunk plan of
``peft_fastlora.batch``. Importing this package imports Triton.
"""

from .lora_embedding import lora_embedding_a, lora_extra_token_embedding
from .lora_expand import expand_config, lora_expand
from .lora_fused import MAX_BLOCK_R as FUSED_MAX_BLOCK_R
from .lora_fused import MAX_MODULES as FUSED_MAX_MODULES
from .lora_fused import FusedWorkspace, fused_config, fused_supported, lora_fused
from .lora_shrink import lora_shrink, shrink_config
from .lora_shrink import _lora_shrink_kernel as _shrink_kernel


def interpreting() -> bool:
    """True when the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` was set
    before they were imported), which runs them on CPU tensors."""
    return type(_shrink_kernel).__name__ == "InterpretedFunction"


__all__ = [
    "FUSED_MAX_BLOCK_R",
    "FUSED_MAX_MODULES",
    "FusedWorkspace",
    "expand_config",
    "fused_config",
    "fused_supported",
    "interpreting",
    "lora_embedding_a",
    "lora_expand",
    "lora_extra_token_embedding",
    "lora_fused",
    "lora_shrink",
    "shrink_config",
]
