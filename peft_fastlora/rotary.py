"""Rotary embedding of the model's attention modules in one Triton launch, on this instance only.

An attention ``forward`` that calls the module-level ``apply_rotary_pos_emb`` gets, on the module
instance, a copy of that same function (same code object, decorators kept) whose globals see
``fast_apply_rotary_pos_emb`` under that name. Nothing of the model code is rewritten, and the
class and the modeling module are untouched, so other models in the process keep transformers'
function.

The copy is made only when the model's ``apply_rotary_pos_emb`` and its ``rotate_half`` are, up
to docstrings and decorators, the Llama-family ones (Llama, Mistral, Qwen2/3, Gemma, Granite, ...):
partial rotary (Phi-3), interleaved or upcasting variants keep their own function. At call time,
anything ``ops.rotary`` does not take (gradients, other devices, broadcast shapes) goes to the
original function.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._forwards import kernel_runs_on, set_instance_forward

_NAME = "apply_rotary_pos_emb"

_REFERENCE_APPLY = '''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
'''

_REFERENCE_ROTATE_HALF = '''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
'''


def _shape_of_code(fn: Callable) -> Optional[str]:
    """The function's syntax tree without docstring and decorators (None if no source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return _strip(tree)


def _strip(tree) -> Optional[str]:
    if not isinstance(tree, ast.FunctionDef):
        return None
    tree.decorator_list = []
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        tree.body = body[1:]
    return ast.dump(tree)


_APPLY_CODE = _strip(ast.parse(_REFERENCE_APPLY).body[0])
_ROTATE_HALF_CODE = _strip(ast.parse(_REFERENCE_ROTATE_HALF).body[0])


def is_llama_rotary(fn: Callable) -> bool:
    """``fn`` computes Llama's ``q * cos + rotate_half(q) * sin`` (checked by its code)."""
    raw = inspect.unwrap(fn)
    rotate_half = getattr(raw, "__globals__", {}).get("rotate_half")
    return (rotate_half is not None and raw.__globals__.get("torch") is torch
            and _shape_of_code(raw) == _APPLY_CODE and _shape_of_code(rotate_half) == _ROTATE_HALF_CODE)


def _kernel_applies(q, k, cos, sin) -> bool:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[-1] % 2:
        return False
    if cos.shape[1:] != q.shape[2:] or cos.shape[0] not in (1, q.shape[0]):
        return False
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1 or q.dtype not in (torch.float16, torch.bfloat16,
                                                                            torch.float32):
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or len({t.device for t in (q, k, cos, sin)}) != 1:
        return False
    return kernel_runs_on(q, k, cos, sin)


def make_fast_apply(original: Callable) -> Callable:
    """A drop-in ``apply_rotary_pos_emb`` that launches ``ops.rotary`` when it can."""
    from .ops.rotary import apply_rotary

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


def install_rotary(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Give every attention module under ``root`` whose forward calls a Llama-family
    ``apply_rotary_pos_emb`` the one-kernel version; returns the modules changed."""
    copies: Dict[Callable, Optional[Callable]] = {}  # one copy per class forward
    done = []
    for name, m in root.named_modules():
        forward = type(m).__dict__.get("forward")
        if forward is None or "forward" in m.__dict__:
            continue
        if forward not in copies:
            copies[forward] = None
            raw = inspect.unwrap(forward)
            code = getattr(raw, "__code__", None)
            original = getattr(raw, "__globals__", {}).get(_NAME)
            if code is not None and _NAME in code.co_names and callable(original) and is_llama_rotary(original):
                copies[forward] = rebind_global(forward, _NAME, make_fast_apply(original))
        if copies[forward] is not None:
            set_instance_forward(m, copies[forward])
            done.append((name, m))
    return done
