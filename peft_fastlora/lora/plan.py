"""What the LoRA side of a build decided: ``LoRAPlan``, frozen, with the reason for each layer,
group and site left off a fast path. ``PatchReport`` takes its LoRA fields from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class LoRAPlan:
    """Attributes (the ``PatchReport`` fields of the same names):
        backend, device: the backend's name and the device of the adapters' stacks.
        adapters: the adapters served (``from_folders``' placeholder not counted).
        sites: (name, kind, LoRA layers) of each site.
        left_on_peft: (module, why) of each LoRA layer PEFT's forward keeps.
        adapter_fallbacks: (module, adapter, why) of each adapter a site cannot compute.
        fusion_blocked: (group, why) of each sibling group not fused.
        triton_missing: why fastlora's Triton kernels cannot run in this process ("": they can).
        stack_bytes, adapter_bytes: the stacks' bytes and the adapters' own within them.
        gpu_slots: "all adapters", or the slots loaded on demand.
        registered, store_bytes: adapters registered by name and their bytes in CPU memory.
        shrink_folded: "N of M sites" whose decode shrink the base GEMM computes, or "off (why)".
        fold_refused: (site, why) of each site that keeps the shrink kernel.
        quantized_joined: (group, None where its quantized siblings' base matmuls are one, else why
            each keeps its own) of each group of quantized siblings with LoRA.
    """

    backend: str
    device: str
    adapters: List[str] = field(default_factory=list)
    sites: List[Tuple[str, str, int]] = field(default_factory=list)
    left_on_peft: List[Tuple[str, str]] = field(default_factory=list)
    adapter_fallbacks: List[Tuple[str, str, str]] = field(default_factory=list)
    fusion_blocked: List[Tuple[str, str]] = field(default_factory=list)
    triton_missing: str = ""
    stack_bytes: int = 0
    adapter_bytes: int = 0
    gpu_slots: str = "all adapters"
    registered: int = 0
    store_bytes: int = 0
    shrink_folded: str = "off"
    fold_refused: List[Tuple[str, str]] = field(default_factory=list)
    quantized_joined: List[Tuple[str, Optional[str]]] = field(default_factory=list)

    def report_fields(self) -> Dict[str, object]:
        return asdict(self)
