"""Sibling base projections with no LoRA layer among them (q/k/v, gate/up of a plain model, or of
a PEFT model whose adapters skip them) computed by one GEMM, on this model instance only.

fastlora's LoRA sites fuse the siblings that have a LoRA member (``lora.fusion``); a group with none
would otherwise keep three (two) GEMMs a layer, each a separate pass over the weights with its own
ramp and tail. Here the same ``FusedGroup`` holds the weights (each parameter becomes a view of one
tensor: no second copy, ``state_dict()`` unchanged), and each member gets an instance forward: the
first member called with an input computes every member's output and keeps the others for the
siblings, keyed by the input tensor's identity; a sibling called with that input takes its output,
once. Any other call (another input, gradients on, weights no longer views of the fused tensor)
runs the member's own forward. bitsandbytes' 8-bit siblings share one 8-bit matmul over their
joined rows instead (``compat.bitsandbytes``), as the LoRA sites' do; without an outlier threshold
its product is dequantized by fastlora's kernel (``lora.fusion.int8_matmul``), and so is that of
every other 8-bit layer outside PEFT's LoRA layers (a group of one), as the LoRA sites' are: the
base model patched by fastlora takes the same base path as the model with adapters.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..compat.bitsandbytes import int8_join_blocker, is_int8_linear, outlier_threshold
from ..compat.modules import has_forward_hooks, is_dtensor
from ..compat.peft import is_tuner_layer
from ..instance_methods import InstancePatches
from ..lora.fusion import FUSIBLE_GROUPS, FusedGroup, SeparateGroup, fusion_blocker


class PlainFusedGroup:
    """One group of plain ``nn.Linear`` siblings (or bitsandbytes 8-bit ones: ``int8``) and the
    outputs kept for them."""

    def __init__(self, parent_name: str, kind: str, names: Tuple[str, ...], members: List[nn.Linear],
                 int8: bool = False):
        self.group = (SeparateGroup(kind, parent_name, names, members, members, separate="int8") if int8
                      else FusedGroup(kind, parent_name, names, members, members))
        self._kept = None  # (input, [output or None per member])

    def install(self, patches: InstancePatches):
        if self.group.separate:
            self.group.join()
        else:
            self.group.fuse()
        for i, m in enumerate(self.group.members):
            patches.bind(m, "forward", self._forward_of(i))

    def remove(self):
        """The members' own weights again (their forwards go back with the patches)."""
        self._kept = None
        if self.group.weight is not None or self.group.separate:
            self.group.unfuse()

    def gated(self, mlp: nn.Module, stream, act: str):
        """For the gate/up group of ``mlp``: ``x -> act(gate(x)) * up(x)`` in one GEMM of ``stream``
        (``StreamLinears.gated``), or None where it does not apply (the MLP calls its members:
        when they are no longer this group's plain layers, say wrapped by a new LoRA adapter)."""
        group = self.group

        def forward(x):
            if (torch.is_grad_enabled() and x.requires_grad) or not group.is_intact() \
                    or mlp.gate_proj is not group.members[0] or mlp.up_proj is not group.members[1] \
                    or any(has_forward_hooks(m) for m in group.members):
                return None
            return stream.gated(x, group.weight, group.bias, act)

        return forward

    def _forward_of(self, i: int):
        def forward(module, x):
            kept = self._kept
            if kept is not None and kept[0] is x and kept[1][i] is not None:
                out, kept[1][i] = kept[1][i], None
                if all(o is None for o in kept[1]):
                    self._kept = None  # every sibling served: the input and the fused output are let go
                return out
            g = self.group
            if (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)) \
                    or not (g.joined_intact() if g.separate else g.is_intact()):
                return type(module).forward(module, x)  # its own weight: a view of the fused tensor, or its own again
            res = g.linear(x)  # (intact: checked just above)
            outs = [res[..., lo:hi] for lo, hi in zip(g.offsets[:-1], g.offsets[1:])]
            mine, outs[i] = outs[i], None
            self._kept = (x, outs)
            return mine

        return forward


def install_fused_linears(model: nn.Module, patches: InstancePatches) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]],
                                                      List[PlainFusedGroup]]:
    """Fuse every q/k/v and gate/up group of plain ``nn.Linear`` siblings under ``model``.

    Returns the (name, module) pairs given a forward, the (group, reason) pairs left unfused, and
    the groups (``PlainFusedGroup.remove`` unfuses each; ``patches.restore`` takes the forwards back)."""
    done, skipped, groups = [], [], []
    for parent_name, parent in model.named_modules():
        for kind, names in FUSIBLE_GROUPS.items():
            members = [getattr(parent, n, None) for n in names]
            int8 = all(m is not None and is_int8_linear(m) for m in members)
            if not int8 and any(type(m) is not nn.Linear for m in members):
                continue  # absent, a LoRA layer (its site fuses it), or another layer type
            label = f"{parent_name}.{kind}" if parent_name else kind
            if any("forward" in m.__dict__ for m in members):
                skipped.append((label, "a member already has an instance forward"))
                continue
            why = int8_join_blocker(members) if int8 else fusion_blocker(members)
            if why is None and any(is_dtensor(m.weight) or has_forward_hooks(m) for m in members):
                why = "sharded or hooked weights"
            if why is not None:
                skipped.append((label, why))
                continue
            g = PlainFusedGroup(parent_name, kind, names, members, int8=int8)
            g.install(patches)
            groups.append(g)
            done.extend((f"{parent_name}.{n}" if parent_name else n, m) for n, m in zip(names, members))
    for name, m in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        if (not is_int8_linear(m) or "forward" in m.__dict__ or outlier_threshold(m) != 0.0
                or is_tuner_layer(model.get_submodule(parent_name) if parent_name else model)
                or int8_join_blocker([m]) is not None or has_forward_hooks(m)):
            continue  # (a LoRA layer's base: its site computes it)
        g = PlainFusedGroup(parent_name, "linear", (child,), [m], int8=True)
        g.install(patches)
        groups.append(g)
        done.append((name, m))
    return done, skipped, groups
