"""``PatchReport``: what ``patch`` did to a model, and why anything was left as it was. It is rendered
from the build's decisions (``lora.plan.LoRAPlan``, ``base_ops.BaseOps``, ``decode.plan.DecodePlan``,
the continuous-batching hook) and never changed after."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class PatchReport:
    """What ``patch`` did. ``str(report)`` is the one-line summary that is also logged."""

    backend: str
    device: str
    adapters: List[str]
    sites: List[Tuple[str, str, int]] = field(default_factory=list)  # (name, kind, LoRA layers)
    left_on_peft: List[Tuple[str, str]] = field(default_factory=list)  # (module, reason)
    adapter_fallbacks: List[Tuple[str, str, str]] = field(default_factory=list)  # (module, adapter, reason)
    fusion_blocked: List[Tuple[str, str]] = field(default_factory=list)  # (group, reason)
    triton_missing: str = ""  # why fastlora's Triton kernels cannot run in this process ("": they can)
    stack_bytes: int = 0
    # the adapters' own weights in the stacks' dtype (stack_bytes adds padding and ops.glu_lora's buffers)
    adapter_bytes: int = 0
    # what the stacks hold: every adapter, or N slots loaded on demand (GPU slots on CUDA); the
    # placeholder adapter from_folders makes the LoRA layers with is not counted
    gpu_slots: str = "all adapters"
    registered: int = 0  # adapters registered by name (fastlora.register_adapter), held in CPU memory
    store_bytes: int = 0  # their bytes there
    decode_attention: str = "off"  # "on", or why not
    fused_norms: int = 0  # RMSNorm modules served by one kernel
    fused_add_norms: int = 0  # decoder layers whose residual add and post-attention norm are one kernel
    fused_rotary: int = 0  # attention modules whose rotary embedding is one kernel
    fused_rotary_kv: int = 0  # of those, the ones that also write fastlora's static caches in that kernel
    rotary_tables: int = 0  # rotary embedding modules whose cos / sin decode graphs read from a table
    fused_mlps: int = 0  # gated MLPs whose silu(gate) * up is one kernel
    grouped_experts: int = 0  # routed experts modules without LoRA computed as grouped GEMMs
    fused_base_groups: int = 0  # q/k/v and gate/up siblings without LoRA computed by one GEMM
    stream_gemm_layers: int = 0  # plain linear layers whose decode GEMMs the streaming kernel runs
    stream_residual_layers: int = 0  # decoder layers whose MLP residual add may ride in down's streaming GEMM
    stream_gated_mlps: int = 0  # gated MLPs whose plain gate/up GEMM gives act(gate) * up
    # gated MLPs whose folded LoRA gate/up gives act(gate) * up with the deltas in one launch (65-128 rows)
    stream_lora_gated_mlps: int = 0
    # gated MLPs whose LoRA gate/up adds its deltas inside the activation's launch at prefill (a
    # forward of at least ``Tuning.glu_expand_min_tokens`` tokens in rows of at least a tile each)
    lora_glu_expand_mlps: int = 0
    cuda_graphs: str = "off"  # "on", "emulated", or "off (why)"
    stop_check: str = "per step"  # with graphs on: "deferred" (read one step late on CUDA) or "per step (why)"
    token_selection: str = "transformers'"  # with graphs on: "one kernel for greedy calls" or "transformers' (why)"
    continuous_batching: str = "off"  # per-request adapters in generate_batch: "on" or "off (why)"
    base_ops_skipped: List[Tuple[str, str, str]] = field(default_factory=list)  # (option, class, why)
    base_ops_off: Dict[str, str] = field(default_factory=dict)  # option -> why it is off
    shrink_folded: str = "off"  # "N of M sites" whose decode shrink the base GEMM computes, or "off (why)"
    fold_refused: List[Tuple[str, str]] = field(default_factory=list)  # (site, why it keeps the shrink kernel)
    # (group, None where its quantized siblings' base matmuls are one, else why each keeps its own)
    quantized_joined: List[Tuple[str, Optional[str]]] = field(default_factory=list)

    @property
    def num_patched_layers(self) -> int:
        return sum(n for _, _, n in self.sites)

    def counts(self) -> dict:
        out: dict = {}
        for _, kind, _n in self.sites:
            out[kind] = out.get(kind, 0) + 1
        return out

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items()))
        if not self.adapters:
            line = "fastlora: base model only (no LoRA adapters)"
        else:
            sites = len(self.sites)
            triton = f" (Triton kernels off: {self.triton_missing})" if self.triton_missing else ""
            line = (f"fastlora: patched {self.num_patched_layers} LoRA layers in {sites} "
                    f"site{'s' if sites != 1 else ''} ({kinds}) for {len(self.adapters)} adapters on backend "
                    f"{self.backend!r}{triton}; {len(self.left_on_peft)} left on PEFT's path; "
                    f"adapter stacks {self.stack_bytes / 2**20:.1f} MiB "
                    f"(adapters' own weights {self.adapter_bytes / 2**20:.1f} MiB)")
            if self.gpu_slots != "all adapters":  # slots of GPU memory on CUDA, of host memory elsewhere
                where = "GPU slots" if self.device.startswith("cuda") else "slots"
                line += f" in {where} ({self.gpu_slots})"
            if self.registered:
                line += f"; {self.registered} registered in CPU memory ({self.store_bytes / 2**20:.1f} MiB)"
        if self.adapter_fallbacks:
            pairs = sorted({(a, r) for _, a, r in self.adapter_fallbacks})
            line += "; served by PEFT where used: " + ", ".join(f"{a} ({r})" for a, r in pairs)
        if self.fusion_blocked:
            n = len(self.fusion_blocked)
            line += f"; {n} group{'s' if n != 1 else ''} not fused"
        line += f"; decode graphs {self.cuda_graphs}"
        if not self.cuda_graphs.startswith("off"):
            line += f" (stop check {self.stop_check}; token selection {self.token_selection})"
        line += f"; decode attention {self.decode_attention}"
        line += f"; continuous batching {self.continuous_batching}"
        if self.adapters:
            line += f"; shrink folded into the base GEMM: {self.shrink_folded}"
        if self.quantized_joined:
            joined = sum(why is None for _, why in self.quantized_joined)
            line += f"; quantized siblings in one matmul: {joined} of {len(self.quantized_joined)} groups"
        why = self.base_ops_off.get("fuse_base")
        line += (f"; siblings without LoRA in one GEMM: off ({why})" if why
                 else f"; siblings without LoRA in one GEMM: {self.fused_base_groups} groups")
        why = self.base_ops_off.get("stream_gemm")
        line += (f"; decode GEMMs streamed: off ({why})" if why
                 else f"; decode GEMMs streamed: fused groups and {self.stream_gemm_layers} layers")
        folds = [f"residual add in down's GEMM x{self.stream_residual_layers}" if self.stream_residual_layers else "",
                 f"act-mul in gate/up's GEMM x{self.stream_gated_mlps}" if self.stream_gated_mlps else "",
                 f"LoRA gate/up, its shrink and act-mul in one launch at 65-128 rows x{self.stream_lora_gated_mlps}"
                 if self.stream_lora_gated_mlps else ""]
        if not why and any(folds):
            line += f" ({', '.join(f for f in folds if f)})"
        if self.lora_glu_expand_mlps:
            line += f"; LoRA gate/up deltas in the act-mul's launch at prefill x{self.lora_glu_expand_mlps}"
        ops = []
        for option, label, count in (("fuse_norms", "RMSNorm", self.fused_norms),
                                     ("fuse_rotary", "rotary", self.fused_rotary),
                                     ("fuse_silu_mul", "act-mul", self.fused_mlps)):
            why = self.base_ops_off.get(option)
            ops.append(f"{label} off ({why})" if why else f"{label} x{count}")
            if option == "fuse_norms" and not why and self.fused_add_norms:
                ops[-1] += f" ({self.fused_add_norms} with the residual add)"
            if option == "fuse_rotary" and not why and self.fused_rotary_kv:
                ops[-1] += f" ({self.fused_rotary_kv} with the KV write)"
            if option == "fuse_rotary" and not why and self.rotary_tables:
                ops[-1] += f", cos/sin from a table in graphs x{self.rotary_tables}"
        line += "; one-kernel " + ", ".join(ops)
        if self.grouped_experts:
            line += f"; routed experts as grouped GEMMs x{self.grouped_experts}"
        kept = sorted({f"{cls}: {why}" for option, cls, why in self.base_ops_skipped if option == "grouped_experts"})
        if kept:
            line += f"; routed experts kept as transformers' ({'; '.join(kept)})"
        return line

    __str__ = summary
