"""Rotary embedding of the model's attention modules in one Triton launch, on this instance only.

An attention ``forward`` that calls the module-level ``apply_rotary_pos_emb`` gets, on the module
instance, a copy of that same function (same code object, decorators kept) whose globals see
``fast_apply_rotary_pos_emb`` under that name. Nothing of the model code is rewritten, and the
class and the modeling module are untouched, so other models in the process keep transformers'
function.

The copy is made only when the model's ``apply_rotary_pos_emb`` and its ``rotate_half`` compute
what the Llama-family ones do (``match.py``: Llama, Mistral, Qwen2/3, Gemma, Granite, ...): partial
rotary (Phi-3), interleaved or upcasting variants keep their own function, with the reason
reported. At call time, anything ``ops.rotary`` does not take (gradients, other devices, broadcast
shapes) goes to the original function.
"""

from __future__ import annotations

import inspect
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .attention_forwards import attention_form, make_attention_forward
from ..compat.attention import plain_function
from ..instance_methods import InstancePatches
from ..kernel_support import FLOAT_DTYPES, kernel_runs_on
from .match import code_shape, reference_shape
from ..ops.rotary import apply_rotary

_NAME = "apply_rotary_pos_emb"

_APPLY = reference_shape('''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
''')

_ROTATE_HALF = reference_shape('''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
''')


def rotary_mismatch(fn: Callable) -> Optional[str]:
    """None when ``fn`` computes Llama's ``q * cos + rotate_half(q) * sin``, else the reason."""
    raw = inspect.unwrap(plain_function(fn))
    scope = getattr(raw, "__globals__", {})
    rotate_half = scope.get("rotate_half")
    module = getattr(raw, "__module__", "?")
    if rotate_half is None or scope.get("torch") is not torch:
        return f"{module}.{_NAME}: no rotate_half / torch beside it"
    if code_shape(raw) != _APPLY:
        return f"{module}.{_NAME} differs from the reference code"
    if code_shape(rotate_half) != _ROTATE_HALF:
        return f"{module}.rotate_half differs from the reference code"
    return None


def is_llama_rotary(fn: Callable) -> bool:
    return rotary_mismatch(fn) is None


def _kernel_applies(q, k, cos, sin) -> bool:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[-1] % 2:
        return False
    if cos.shape[1:] != q.shape[2:] or cos.shape[0] not in (1, q.shape[0]):
        return False
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1 or q.dtype not in FLOAT_DTYPES:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or len({t.device for t in (q, k, cos, sin)}) != 1:
        return False
    return kernel_runs_on(q, k, cos, sin)


def make_fast_apply(original: Callable) -> Callable:
    """A drop-in ``apply_rotary_pos_emb`` that launches ``ops.rotary`` when it can."""

    def fast_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if unsqueeze_dim != 1 or kwargs or not _kernel_applies(q, k, cos, sin):
            return original(q, k, cos, sin, unsqueeze_dim, **kwargs)
        return apply_rotary(q, k, cos, sin)

    fast_apply_rotary_pos_emb.__wrapped_original__ = original
    return fast_apply_rotary_pos_emb


def rebind_global(fn: Callable, name: str, value) -> Optional[Callable]:
    """A copy of ``fn`` whose global ``name`` is ``value``; decorator wrappers (``functools.wraps``
    closures over the wrapped function) are copied around it. None when ``fn`` is not built that way.
    """
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        if not isinstance(fn, types.FunctionType) or name not in fn.__code__.co_names:
            return None
        scope = dict(fn.__globals__)
        scope[name] = value
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        new_inner = rebind_global(inner, name, value)
        cells = getattr(fn, "__closure__", None) or ()
        holds = [i for i, c in enumerate(cells) if _cell_value(c) is inner]
        if new_inner is None or len(holds) != 1:
            return None
        cells = list(cells)
        cells[holds[0]] = types.CellType(new_inner)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def install_rotary(root: nn.Module, patches: InstancePatches, with_kv: Optional[List[Tuple[str, nn.Module]]] = None
                   ) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
    """Give every attention module under ``root`` whose forward calls a Llama-family
    ``apply_rotary_pos_emb`` the one-kernel version; where the whole forward is the Llama family's
    (``attention_forwards``), one that also writes fastlora's static caches in the same kernel.

    Returns (the modules changed, (class, reason) for forwards calling another rotary); the
    modules given the rotary and KV write in one kernel are appended to ``with_kv``.
    """

    copies: Dict[Callable, Optional[Callable]] = {}  # one copy per class forward
    fused: Dict[Callable, Optional[Callable]] = {}  # the forward with the KV write, where the form matches
    done, skipped = [], {}
    for name, m in root.named_modules():
        forward = type(m).__dict__.get("forward")
        if forward is None or "forward" in m.__dict__:
            continue
        if forward not in copies:
            copies[forward] = None
            raw = inspect.unwrap(forward)
            code = getattr(raw, "__code__", None)
            original = getattr(raw, "__globals__", {}).get(_NAME)
            if code is not None and _NAME in code.co_names and callable(original):
                why = rotary_mismatch(original)
                if why is None:
                    fast_apply = make_fast_apply(original)
                    copies[forward] = rebind_global(forward, _NAME, fast_apply)
                    why = None if copies[forward] is not None else "its forward cannot be copied"
                    form = attention_form(forward)
                    if why is None and form is not None:
                        fused[forward] = make_attention_forward(form, forward, copies[forward], fast_apply,
                                                                _kernel_applies)
                if why is not None:
                    skipped[type(m).__name__] = why
        if copies[forward] is not None:
            patches.bind(m, "forward", fused.get(forward) or copies[forward])
            done.append((name, m))
            if forward in fused and with_kv is not None:
                with_kv.append((name, m))
    return done, sorted(skipped.items())
