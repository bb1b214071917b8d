"""LoRA on routed experts: ``ExpertsSite``, one per mixture-of-experts layer whose 3-D expert
parameters PEFT adapts (``target_parameters``: a chain of ``ParamWrapper``s over the experts).

PEFT serves such adapters by adding each one's delta to the whole expert stack for the forward,
so a batch can use one adapter only. Here the experts' forward is computed as pairs (token, chosen
expert): the base projections by expert, the LoRA factors by (adapter slot, expert), both through
``ops.grouped_gemm`` (or its torch reference off the Triton backend). A token gets its row's adapter
on the experts it is routed to; a row without an adapter (``"__base__"``), or an adapter that did
not train these experts, gets nothing extra.

The adapters' factors are copied into per-slot stacks, ``(slots, experts, rank, in)`` for A and
``(slots, experts, out, rank)`` for B, zero-padded to the layer's largest rank, when a call uses
them and their values changed (``refresh``); the stacks keep their addresses, so captured decode
graphs stay valid.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..batch import choose_block_m
from ..call_context import CallContext
from ..compat.modules import version_of
from ..compat.peft import (expert_factors, expert_layout_blocker, is_param_wrapper,
                           layer_adapters_disabled, layer_is_merged, param_wrapper_chain, split_expert_factors)
from ..decode.capture import GraphUnsafe
from ..instance_methods import InstancePatches
from ..kernel_support import kernel_runs_on
from ..ops.grouped_gemm import grouped_gemm, grouped_gemm_reference, plan_groups

RANK_ALIGN = 16  # the kernel's smallest dot tile: stacks pad ranks to a multiple of it


class ExpertStack:
    """One expert parameter's adapters, by slot: A (slots, experts, R, in), B (slots, experts,
    out, R), scaling (slots,) float32; a slot holding no adapter of this parameter is all zeros."""

    def __init__(self, module: str, wrapper: nn.Module, weight: torch.Tensor, num_slots: int, stored=()):
        self.module = module  # the wrapper's name in the model (registered adapters are keyed by it)
        self.wrapper = wrapper
        experts, out_features, in_features = weight.shape
        ranks = [wrapper.r[n] for n in wrapper.lora_A]
        ranks += [a.modules[module][0].shape[0] // experts for a in stored if module in a.modules]
        rank = -(-max(ranks, default=1) // RANK_ALIGN) * RANK_ALIGN
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.a = torch.zeros(num_slots, experts, rank, in_features, **kw)
        self.b = torch.zeros(num_slots, experts, out_features, rank, **kw)
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=weight.device)
        self._held: Dict[int, tuple] = {}  # slot -> the key of what it holds

    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def follow(self, weight: torch.Tensor) -> bool:
        """Stacks again on ``weight``'s device and dtype where it moved (``model.to``), emptied; True
        if they were rebuilt (graphs that read the old ones must go)."""
        if self.a.device == weight.device and self.a.dtype == weight.dtype:
            return False
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.a = torch.zeros(self.a.shape, **kw)
        self.b = torch.zeros(self.b.shape, **kw)
        self.scaling = torch.zeros(self.scaling.shape, dtype=torch.float32, device=weight.device)
        self._held.clear()
        return True

    def hold(self, slot: int, adapter: str, stored=None) -> None:
        """``adapter``'s current factors in ``slot``; ``stored``: the adapter registered by name under
        that name, if it is one. Runs for every adapter of every call: what a slot holds is compared
        by a key first (PEFT's tensors and their version counters), copied only when it changed."""
        if stored is not None and self.module in stored.modules:
            a, b, scaling = stored.modules[self.module]
            key: tuple = (adapter, id(stored))  # a registered adapter's tensors never change
        elif stored is None and adapter in self.wrapper.lora_A:
            a, b, scaling = expert_factors(self.wrapper, adapter)
            key = (adapter, a.data_ptr(), version_of(a), b.data_ptr(), version_of(b), scaling)
        else:
            a = b = None
            key = (adapter,)
        if self._held.get(slot) == key:
            return
        with torch.no_grad():
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.scaling[slot] = 0.0
            if a is not None:
                a, b = split_expert_factors(a, b, self.wrapper.num_experts)
                r = a.shape[1]
                self.a[slot, :, :r].copy_(a)
                self.b[slot, :, :, :r].copy_(b)
                self.scaling[slot] = scaling
        self._held[slot] = key


class ExpertsSite:
    """The experts of one MoE layer with their LoRA wrappers; installs the outermost wrapper's
    forward (the module the layer calls)."""

    kind = "experts"

    def __init__(self, name: str, outer: nn.Module, num_slots: int, stored=()):
        self.name = name
        self.outer = outer
        self.experts, self.wrappers = param_wrapper_chain(outer)
        self.lora_layers: List[nn.Module] = list(self.wrappers.values())
        # a wrapper's module name: the outer one's, then ".base_layer" for each one inside it
        depth = {id(w): i for i, w in enumerate(self.wrappers.values())}  # (outermost first)
        self.stacks = {p: ExpertStack(name + ".base_layer" * depth[id(w)], w, getattr(self.experts, p), num_slots,
                                      stored) for p, w in self.wrappers.items()}
        self._patches = InstancePatches()

    @property
    def device(self) -> torch.device:
        return self.experts.gate_up_proj.device

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stacks.values())

    # -- installing -------------------------------------------------------------------------
    def install(self, state) -> None:
        original = self.outer.forward

        def patched(module, hidden, *args, **kwargs):
            return self.forward(state, state.context(), original, hidden, args, kwargs)

        self._patches.bind(self.outer, "forward", patched)

    def uninstall(self) -> None:
        self._patches.restore()

    def follow_weights(self) -> bool:
        """Stacks rebuilt where the expert weights moved device or dtype (see ``ExpertStack.follow``)."""
        return any([stack.follow(getattr(self.experts, p)) for p, stack in self.stacks.items()])

    def refresh(self, slots: Dict[str, int], stored: Dict[str, object]) -> None:
        """The call's adapters (name -> slot) into the stacks; ``stored``: the adapters registered
        by name (``lora.store``), by name."""
        for stack in self.stacks.values():
            for name, slot in slots.items():
                stack.hold(slot, name, stored.get(name))

    # -- the forward --------------------------------------------------------------------------
    def forward(self, state, context: CallContext, original, hidden, args, kwargs):
        routing = routing_of(args, kwargs)
        names = kwargs.get("adapter_names")
        names = names if names is not None else context.names
        slots = None
        if routing is not None and self._takes_fast_path(hidden):
            slots = state.token_slots(context, names, hidden.shape[0], self.device)
        if slots is None:
            if context.graphed and (names is not None or context.segments is not None):
                raise GraphUnsafe(f"{self.name} would leave the static path")
            if kwargs.get("adapter_names") is None and context.names is not None:
                kwargs = dict(kwargs, adapter_names=list(context.names))  # PEFT's own answer to them
            elif kwargs.get("adapter_names") is None and context.segments is not None:
                kwargs = dict(kwargs, adapter_names=context.segments.token_names())
            return original(hidden, *args, **kwargs)
        top_k_index, top_k_weights = routing
        return self._experts_forward(state, hidden, top_k_index, top_k_weights, slots)

    def _takes_fast_path(self, hidden) -> bool:
        if torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            return False
        if any(layer_adapters_disabled(w) or layer_is_merged(w) for w in self.lora_layers):
            return False
        return hidden.dtype == self.experts.gate_up_proj.dtype and hidden.device == self.device

    def _experts_forward(self, state, hidden, top_k_index, top_k_weights, slots):
        kernels = state.backend.name == "triton" and kernel_runs_on(hidden, self.experts.gate_up_proj)
        return grouped_experts_forward(self.experts, hidden, top_k_index, top_k_weights, kernels,
                                       lora=(self.stacks, slots, self._slots()))

    def _slots(self) -> int:
        return next(iter(self.stacks.values())).a.shape[0]


def grouped_experts_forward(experts: nn.Module, hidden, top_k_index, top_k_weights, kernels: bool, lora=None):
    """transformers' routed experts (``experts``: 3-D ``gate_up_proj`` and ``down_proj``, its
    ``act_fn``) for every (token, chosen expert) pair as grouped GEMMs (``kernels``; else their
    torch reference), weighted and summed per token. ``lora``: (the stacks by parameter, each
    token's slot (-1: none), the stacks' slots) to add each token's adapter on its experts; None:
    the base experts alone. An expert index outside the experts (transformers' "no expert") adds
    nothing."""
    tokens, k = top_k_index.shape
    num_experts = experts.gate_up_proj.shape[0]
    expert = top_k_index.reshape(-1)
    pairs = tokens * k
    stacks, keys = {}, {False: (expert, num_experts)}
    if lora is not None:
        stacks, slots, num_slots = lora
        pair_slot = slots[:tokens, None].expand(tokens, k).reshape(-1)  # (no read-back: capturable)
        keys[True] = (torch.where((pair_slot >= 0) & (expert >= 0) & (expert < num_experts),
                                  pair_slot.long() * num_experts + expert, torch.full_like(expert, -1)),
                      num_slots * num_experts)
    if kernels:
        bm = choose_block_m(pairs)
        plans = {on: plan_groups(key, groups, bm) for on, (key, groups) in keys.items()}

        def gemm(x, w, out, in_div, lora, **kw):
            return grouped_gemm(x, w, plans[lora], out, in_div=in_div, **kw)
    else:
        def gemm(x, w, out, in_div, lora, **kw):
            return grouped_gemm_reference(x, w, keys[lora][0], out, in_div=in_div, **kw)

    gate_up = _projection(gemm, experts.gate_up_proj, stacks.get("gate_up_proj"), hidden, k, pairs, num_experts)
    inter = experts.act_fn(gate_up[:, : gate_up.shape[1] // 2]) * gate_up[:, gate_up.shape[1] // 2:]
    down = _projection(gemm, experts.down_proj, stacks.get("down_proj"), inter, 1, pairs, num_experts)
    weighted = down.view(tokens, k, -1).float() * top_k_weights.reshape(tokens, k, 1).float()
    return weighted.sum(1).to(hidden.dtype)


def _projection(gemm, weight, stack: Optional[ExpertStack], x, in_div: int, pairs: int, num_experts: int):
    """One expert projection for every pair: the base weight by expert, then (where the parameter
    has adapters) ``scaling * B @ (A @ x)`` by (slot, expert) added on."""
    out = torch.zeros(pairs, weight.shape[1], dtype=x.dtype, device=x.device)
    gemm(x, weight, out, in_div, lora=False)
    if stack is not None:
        shrunk = torch.zeros(pairs, stack.a.shape[2], dtype=x.dtype, device=x.device)
        gemm(x, stack.a.flatten(0, 1), shrunk, in_div, lora=True)
        gemm(shrunk, stack.b.flatten(0, 1), out, 1, lora=True, scale=stack.scaling, scale_div=num_experts,
             accumulate=True)
    return out


def routing_of(args, kwargs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The experts' (top_k_index, top_k_weights), as transformers' MoE blocks pass them."""
    if len(args) == 2 and not set(kwargs) - {"adapter_names"}:
        return args[0], args[1]
    if not args and {"top_k_index", "top_k_weights"} <= set(kwargs) <= {"top_k_index", "top_k_weights", "adapter_names"}:
        return kwargs["top_k_index"], kwargs["top_k_weights"]
    return None


def find_expert_sites(named_lora_layers: Sequence[Tuple[str, nn.Module]], num_slots: int, stored=()) -> tuple:
    """The experts sites of a model's LoRA layers ((name, module), outermost first), the ids of
    every expert wrapper found, and (name, reason) for the chains fastlora cannot serve.
    ``stored``: the adapters registered by name (their ranks size the stacks too)."""
    sites, served, refused = [], set(), []
    for name, m in named_lora_layers:
        if not is_param_wrapper(m) or id(m) in served:
            continue
        experts, wrappers = param_wrapper_chain(m)
        served |= {id(w) for w in wrappers.values()}
        why = expert_layout_blocker(experts, wrappers)
        if why is not None:
            refused.append((name, why))
        else:
            sites.append(ExpertsSite(name, m, num_slots, stored))
    return sites, served, refused
