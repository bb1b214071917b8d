"""The one way fastlora recognises model code: by what it does, not by how it is written.

A function matches a reference when their syntax trees are equal once docstrings, decorators and
type annotations are dropped; formatting and comments never enter a syntax tree. A transformers
release that reformats a forward keeps its kernel; one that changes what the forward computes
loses it, and the reason is reported (``PatchReport.base_ops_skipped``) and logged.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Callable, Optional


def _normalised(tree: ast.AST) -> Optional[str]:
    if not isinstance(tree, ast.FunctionDef):
        return None
    tree.decorator_list = []
    tree.returns = None
    for arg in tree.args.posonlyargs + tree.args.args + tree.args.kwonlyargs:
        arg.annotation = None
    for arg in (tree.args.vararg, tree.args.kwarg):
        if arg is not None:
            arg.annotation = None
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        tree.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def reference_shape(source: str) -> str:
    """The normalised syntax tree of the first function in ``source``."""
    shape = _normalised(ast.parse(textwrap.dedent(source)).body[0])
    if shape is None:
        raise ValueError("reference source must start with a function definition")
    return shape


def code_shape(fn: Callable) -> Optional[str]:
    """The normalised syntax tree of ``fn`` (unwrapped from decorators), or None without source."""
    try:
        source = inspect.getsource(inspect.unwrap(fn))
        tree = ast.parse(textwrap.dedent(source)).body[0]
    except (OSError, TypeError, SyntaxError, IndexError, ValueError):
        return None
    return _normalised(tree)


def mismatch(fn: Callable, reference: str, what: str) -> Optional[str]:
    """None when ``fn`` computes what ``reference`` (a ``reference_shape``) does, else the reason."""
    shape = code_shape(fn)
    if shape is None:
        return f"{what}: no source to compare"
    if shape != reference:
        return f"{what} differs from the reference code"
    return None
