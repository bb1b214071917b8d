"""Where instance forwards may go: the modules that have the parts a fast forward needs and no
instance forward yet. The forwards are set through an ``InstancePatches`` (``BaseOps.patches``)."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence, Tuple

from torch import nn


def candidates(root: nn.Module, parts: Sequence[str]) -> Iterator[Tuple[str, nn.Module, Callable]]:
    """(name, module, its class's forward) of every module under ``root`` that has the submodules
    ``parts`` and no instance forward yet (someone else's, or one of ours)."""
    for name, m in root.named_modules():
        forward = type(m).__dict__.get("forward")
        if "forward" in m.__dict__ or forward is None:
            continue
        if all(isinstance(getattr(m, n, None), nn.Module) for n in parts):
            yield name, m, forward
