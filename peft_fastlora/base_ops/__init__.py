"""The base model's own decode work in fastlora's kernels: attention (through transformers'
attention registry), RMSNorms (the post-attention ones with the residual add before them),
rotary embedding, SiLU-gated MLPs and routed experts (instance forwards), q/k/v and gate/up siblings without
LoRA in one GEMM each, and decode-sized GEMMs through a weight-streaming kernel on Hopper.

``install_base_ops`` decides from the options and the device what to install, installs it on this
model instance only, and returns what it did (and why anything was left as it is);
``BaseOps.remove`` undoes all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compat.modules import multi_device_reason
from ..instance_methods import InstancePatches
from ..kernel_support import interpreting, triton_missing
from .attention_registry import disable_decode_attention, enable_decode_attention
from .expert_forwards import install_grouped_experts
from .fused_linears import PlainFusedGroup, install_fused_linears
from .layer_forwards import install_decoder_layers
from .mlp_forwards import GatedHooks, activation_kind, has_gated_forward, install_gated_mlps
from .norm_forwards import install_norms
from .rotary_forwards import install_rotary
from .rotary_tables import RotaryTables
from .stream_linears import StreamLinears, supported_device


@dataclass
class BaseOps:
    """What ``install_base_ops`` did to one model."""

    decode_attention: str = "off"  # "on", or "off (why)"
    installed: Dict[str, List[Tuple[str, nn.Module]]] = field(default_factory=dict)  # option -> modules
    skipped: List[Tuple[str, str, str]] = field(default_factory=list)  # (option, class, why not)
    off: Dict[str, str] = field(default_factory=dict)  # option -> why nothing was installed for it
    fused_groups: List[PlainFusedGroup] = field(default_factory=list)  # siblings without LoRA in one GEMM
    stream: Optional[StreamLinears] = None  # the decode GEMMs' kernel, where ``stream_gemm`` is on
    rotary_tables: Optional[RotaryTables] = None  # cos / sin from tables in decode graphs (``fuse_rotary``)
    gated: GatedHooks = field(default_factory=GatedHooks)  # gated MLPs' gate/up and activation in fewer launches
    patches: InstancePatches = field(default_factory=InstancePatches)  # every instance forward installed

    @property
    def gemm(self):
        """The fused groups' GEMM (``FusedGroup.gemm``): the streaming kernel's, or None (F.linear)."""
        return None if self.stream is None else self.stream.linear

    def count(self, option: str) -> int:
        return len(self.installed.get(option, ()))

    def report_fields(self) -> Dict[str, object]:
        """``PatchReport``'s base-model fields."""
        stream = self.stream
        return dict(
            decode_attention=self.decode_attention, fused_norms=self.count("fuse_norms"),
            fused_add_norms=self.count("fuse_add_norm"), fused_rotary=self.count("fuse_rotary"),
            fused_rotary_kv=self.count("fuse_rotary_kv"), rotary_tables=self.count("rotary_table"),
            fused_mlps=self.count("fuse_silu_mul"), grouped_experts=self.count("grouped_experts"),
            fused_base_groups=len(self.fused_groups),
            stream_gemm_layers=self.count("stream_gemm"),
            stream_residual_layers=stream.residual_layers if stream is not None else 0,
            stream_gated_mlps=self.gated.count("base"),
            stream_lora_gated_mlps=self.gated.count("lora", "glu_lora"),
            lora_glu_expand_mlps=self.gated.count("lora", "glu_expand"),
            base_ops_skipped=list(self.skipped), base_ops_off=dict(self.off))

    def remove(self, model: nn.Module) -> None:
        disable_decode_attention(model)
        self.gated.clear()
        self.patches.restore()
        for g in self.fused_groups:
            g.remove()
        if self.stream is not None:
            self.stream.remove()
        if self.rotary_tables is not None:
            self.rotary_tables.remove()
        self.installed, self.fused_groups, self.stream, self.rotary_tables = {}, [], None, None


def stream_wanted(model: nn.Module, options, device: torch.device) -> bool:
    """Whether ``install_base_ops`` gives ``model`` the decode GEMMs' kernel (``StreamLinears``) on
    ``device``: ``stream_gemm=True`` on CUDA (or on the CPU under Triton's interpreter: the CPU
    tests' model path), ``"auto"`` on a Hopper GPU with graphs on; never to a model on several
    devices."""
    if multi_device_reason(model) is not None:
        return False
    on_cuda = device.type == "cuda"
    if options.stream_gemm is True:
        return on_cuda or (device.type == "cpu" and interpreting())
    return (options.stream_gemm == "auto" and on_cuda and options.cuda_graphs in (True, "auto")
            and supported_device(device))


def install_base_ops(model: nn.Module, options, device: torch.device) -> BaseOps:
    """Install what ``options`` (a ``PatchOptions``) asks for on ``model`` (the transformers model).

    ``"auto"``: decode attention and norms on CUDA; rotary and act-mul on CUDA with graphs on (an
    eager step pays the host time of each Triton launch, more than the torch ops it replaces).
    ``grouped_experts``: on CUDA (routed experts no adapter targets as grouped GEMMs).
    ``fuse``: on CUDA, q/k/v and gate/up siblings that no LoRA site fused share one GEMM (on the CPU
    the unfused GEMMs stay, so the CPU's numerics stay the model's own). ``stream_gemm`` ``"auto"``:
    on a Hopper GPU with graphs on (``stream_linears``).
    """
    ops = BaseOps()
    on_cuda = device.type == "cuda"
    # several devices: kept to what graphs need. Under tensor parallelism every kernel takes its
    # sizes from the tensors it gets (this rank's heads and widths)
    blocker = multi_device_reason(model)
    if blocker is None and on_cuda:  # the kernels are Triton's: without it, transformers' own code runs
        blocker = triton_missing()
    if blocker is not None:
        ops.decode_attention = f"off ({blocker})"
        ops.off.update({o: blocker for o in ("fuse_base", "fuse_norms", "fuse_rotary", "fuse_silu_mul",
                                             "grouped_experts", "stream_gemm")})
        return ops
    if options.decode_attention is False:
        ops.decode_attention = "off (decode_attention=False)"
    elif options.decode_attention == "auto" and not on_cuda:
        ops.decode_attention = "off (the model is not on CUDA)"
    else:
        why = enable_decode_attention(model)
        ops.decode_attention = "on" if why is None else f"off ({why})"
    # the CPU under Triton's interpreter with stream_gemm=True: the kernel's model path in the CPU tests
    interpreted_stream = options.stream_gemm is True and device.type == "cpu" and interpreting()
    if options.fuse and (on_cuda or interpreted_stream):
        done, skipped, ops.fused_groups = install_fused_linears(model, ops.patches)
        ops.installed["fuse_base"] = done
        ops.skipped.extend(("fuse", group, why) for group, why in skipped)
    else:
        ops.off["fuse_base"] = "fuse=False" if not options.fuse else "the model is not on CUDA"
    graphed = on_cuda and options.cuda_graphs in (True, "auto")
    not_graphed = "the model is not on CUDA" if not on_cuda else "decode graphs off (eager steps: torch ops are cheaper)"
    for option, install, auto, why_not in (("fuse_norms", install_norms, on_cuda, "the model is not on CUDA"),
                                           ("fuse_rotary", install_rotary, graphed, not_graphed),
                                           ("fuse_silu_mul", install_gated_mlps, graphed, not_graphed),
                                           ("grouped_experts", install_grouped_experts, on_cuda,
                                            "the model is not on CUDA")):
        value = getattr(options, option)
        if value is True or (value == "auto" and auto):
            if option == "fuse_rotary":  # and, in Llama-family forwards, the KV write in its kernel
                ops.installed["fuse_rotary_kv"] = []
                done, skipped = install(model, ops.patches, ops.installed["fuse_rotary_kv"])
                ops.rotary_tables = RotaryTables()  # and the rotary embeddings' cos / sin from tables
                ops.installed["rotary_table"], table_skipped = ops.rotary_tables.install(model, ops.patches)
                ops.skipped.extend(("rotary_table", cls, why) for cls, why in table_skipped)
            else:
                done, skipped = install(model, ops.patches)
            ops.installed[option] = done
            ops.skipped.extend((option, cls, why) for cls, why in skipped)
            if option == "fuse_norms":  # the post-attention norms also take the residual add before them
                done, skipped = install_decoder_layers(model, ops.patches)
                ops.installed["fuse_add_norm"] = done
                ops.skipped.extend((option, cls, why) for cls, why in skipped)
        else:
            ops.off[option] = f"{option}=False" if value is False else why_not
    if stream_wanted(model, options, device):
        ops.stream = StreamLinears(device, options.tuning)
        ops.installed["stream_gemm"] = ops.stream.install(model, ops.patches)
        for g in ops.fused_groups:
            if g.group.separate:  # (bitsandbytes' matmul: not the streaming GEMM's)
                continue
            g.group.gemm = ops.gemm
            parent = model.get_submodule(g.group.parent_name) if g.group.kind == "gate_up" else None
            if parent is not None and has_gated_forward(parent):
                ops.gated.set("base", parent, g.gated(parent, ops.stream, activation_kind(parent.act_fn)))
        ops.stream.fold_residuals([(n, m) for n, m in ops.installed.get("fuse_add_norm", ())
                                   if not hasattr(m, "pre_feedforward_layernorm")])  # (Gemma 2's: a norm after)
    else:
        value = options.stream_gemm
        ops.off["stream_gemm"] = ("stream_gemm=False" if value is False else "the model is not on CUDA" if not on_cuda
                                  else "not a Hopper GPU (the tiles were chosen on one)" if not supported_device(device)
                                  else not_graphed)
    return ops


__all__ = ["BaseOps", "install_base_ops"]
