"""peft_fastlora: fast mixed-adapter LoRA inference for Hugging Face PEFT models.

    import peft_fastlora as fastlora
    fastlora.patch(model)
    model.generate(**inputs, adapter_names=["sql", "__base__", "chat", ...])
"""

from contextlib import contextmanager

from .backend import BaseLoRABackend, available_backends, get_backend
from .batch import ForwardBatch, LoRABatchInfo
from .decode.generate import WarmupReport
from .options import PatchOptions
from .continuous.graphs import EngineWarmup
from .patch import get_state, patch, unpatch, warmup, warmup_engine
from .registration import from_folders, register_adapter, register_adapters, unregister_adapter
from .report import PatchReport
from .tuning import Tuning

__version__ = "0.1.0"


@contextmanager
def patched(model, **kwargs):
    """``with fastlora.patched(model): ...`` patches for the block and unpatches after it."""
    report = patch(model, **kwargs)
    try:
        yield report
    finally:
        unpatch(model)


__all__ = [
    "EngineWarmup",
    "BaseLoRABackend",
    "ForwardBatch",
    "LoRABatchInfo",
    "PatchOptions",
    "PatchReport",
    "Tuning",
    "WarmupReport",
    "available_backends",
    "from_folders",
    "get_backend",
    "get_state",
    "patch",
    "patched",
    "register_adapter",
    "register_adapters",
    "unpatch",
    "unregister_adapter",
    "warmup",
    "warmup_engine",
]
