"""Gated MLPs with ``act(gate) * up`` in one Triton launch (``ops.act_mul``), on this model
instance only.

An MLP is changed only when its class's ``forward`` computes the Llama-family
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (``match.py``) and its ``act_fn`` is SiLU (Llama,
Mistral, Qwen2/3, ...) or torch's tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``). The
instance forward still calls ``gate_proj``, ``up_proj`` and ``down_proj`` in that order, so LoRA
layers, fastlora's fused gate/up GEMM and PEFT's own path all keep working; only the activation and
the product become one kernel, when it takes the inputs.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .install import candidates
from ..instance_methods import InstancePatches
from ..kernel_support import FLOAT_DTYPES, kernel_runs_on
from .match import mismatch, reference_shape
from ..ops.silu_mul import act_mul

_REFERENCE = reference_shape('''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
''')


def _from_transformers(act, *names: str) -> bool:
    cls = type(act)
    return cls.__module__ == "transformers.activations" and cls.__name__ in names


def activation_kind(act) -> Optional[str]:
    """The kernel's name for ``act`` ("silu", "gelu_tanh"), or None where it computes something
    else (transformers' Python GELU-tanh rounds after each op in 16-bit dtypes: not the kernel's
    numerics, so it is left alone)."""
    if type(act) is nn.SiLU or _from_transformers(act, "SiLUActivation"):
        return "silu"
    if type(act) is nn.GELU and act.approximate == "tanh":
        return "gelu_tanh"
    if _from_transformers(act, "GELUTanh", "PytorchGELUTanh"):
        inner = getattr(act, "act", None)  # torch's gelu as a partial, unless the Python formula was asked for
        if (isinstance(inner, functools.partial) and inner.func is torch.nn.functional.gelu and not inner.args
                and inner.keywords == {"approximate": "tanh"}):
            return "gelu_tanh"
    return None


def _kernel_applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return False
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return False
    if gate.dtype not in FLOAT_DTYPES or gate.dim() < 1:
        return False
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return False
    try:  # the rows must be one stride apart (true of slices of a fused projection output)
        gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
    except RuntimeError:
        return False
    return kernel_runs_on(gate, up)


def _forward_with(act: str):
    def forward(self, x):

        gated = self.__dict__.get("_fastlora_gated")  # set by GatedHooks
        hidden = None if gated is None else gated(x)
        if hidden is not None:
            return self.down_proj(hidden)
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        hidden = act_mul(gate, up, act) if _kernel_applies(gate, up) else self.act_fn(gate) * up
        return self.down_proj(hidden)

    forward.__name__ = f"_{act}_mul_forward"
    return forward


_FORWARDS = {"silu": _forward_with("silu"), "gelu_tanh": _forward_with("gelu_tanh")}


class GatedHooks:
    """The gated MLPs whose ``act(gate(x)) * up(x)`` a function of their gate/up's owner computes in
    fewer launches (the forward above calls it first; None from it: the members' forwards, as
    usual): a plain fused gate/up's GEMM with the activation in its epilogue (``"base"``) or a LoRA
    gate/up site's deltas inside the activation's launch (``"lora"``: at 65-128 rows of a folded
    site its GEMM and shrink too, ``ops.glu_lora``; at prefill after the GEMM and the shrink,
    ``ops.glu_expand``). One function per MLP, set and taken back by its owner's kind, with the
    paths it may take (for the report)."""

    def __init__(self):
        self._mlps: Dict[str, List[Tuple[nn.Module, Tuple[str, ...]]]] = {}

    def set(self, kind: str, mlp: nn.Module, fn: Callable, paths: Tuple[str, ...] = ()) -> None:
        mlp._fastlora_gated = fn
        self._mlps.setdefault(kind, []).append((mlp, tuple(paths)))

    def count(self, kind: str, path: Optional[str] = None) -> int:
        """The MLPs of ``kind`` (that may take ``path``, where given)."""
        return sum(path is None or path in paths for _, paths in self._mlps.get(kind, ()))

    def clear(self, kind: Optional[str] = None) -> None:
        """Take back the functions of ``kind`` (None: all)."""
        for k in [kind] if kind is not None else list(self._mlps):
            for mlp, _ in self._mlps.pop(k, ()):
                mlp.__dict__.pop("_fastlora_gated", None)


def has_gated_forward(mlp: nn.Module) -> bool:
    """Whether ``mlp`` runs this module's forward: ``down_proj(act(gate) * up)``, nothing after it."""
    forward = mlp.__dict__.get("forward")
    return getattr(forward, "__func__", None) in _FORWARDS.values()


def install_gated_mlps(root: nn.Module, patches: InstancePatches) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every SiLU- or GELU-tanh-gated Llama-family MLP under ``root`` the fused activation.

    Returns (the modules changed, (class, reason) for gate/up/down MLPs left as they are).
    """
    done, skipped, verdicts = [], {}, {}
    for name, m, forward in candidates(root, ("gate_proj", "up_proj", "down_proj")):
        cls = type(m)
        kind = activation_kind(getattr(m, "act_fn", None))
        if kind is None:
            skipped[cls.__name__] = (f"activation {type(getattr(m, 'act_fn', None)).__name__} is neither SiLU "
                                     "nor torch's GELU-tanh")
            continue
        if cls not in verdicts:
            verdicts[cls] = mismatch(forward, _REFERENCE, f"{cls.__name__}.forward")
        if verdicts[cls] is not None:
            skipped[cls.__name__] = verdicts[cls]
            continue
        patches.bind(m, "forward", _FORWARDS[kind])
        done.append((name, m))
    return done, sorted(skipped.items())
