"""Rotary cos / sin from a table in captured decode steps (``ops.rotary_table``), on this instance.

A rotary embedding module (``LlamaRotaryEmbedding`` and its copies) recomputes cos and sin of a
step's positions in about ten small kernels. Its outputs depend on the position only (static rope
types), so a table of its own outputs for positions ``0 .. L-1`` holds the same numbers, and one
gather replaces those kernels.

The table is used only where the positions are known to be below ``L``: while the decode runner
captures (or emulates) a step of a call whose positions transformers derives from the mask or the
cache (they stay below the cache's length), inside ``RotaryTables.active(length)``. Everywhere
else, and for any call the table does not fit, the module's own forward runs.

Each table is built outside a capture, by the module's own forward on ``arange(L)``, and checked
once against that forward on a batch of scattered positions: a module whose outputs are not
per-position (a rope type missed here) keeps its forward, with the reason in ``off``.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..instance_methods import InstancePatches
from ..kernel_support import kernel_runs_on
from ..ops.rotary_table import gather_cos_sin, gather_cos_sin_reference

logger = logging.getLogger("peft_fastlora")

# rope types whose inverse frequencies and scaling never change with the sequence
# (transformers' ``dynamic_rope_update`` changes "dynamic" ones and "longrope")
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_LENGTH = "_fastlora_rotary_length"  # set while a step is captured: the positions stay below it
_TABLES = "_fastlora_rotary_tables"  # (dtype, device) -> (2, L, dim) table


def table_blocker(module: nn.Module) -> Optional[str]:
    """Why ``module`` gets no table (None: it is a rotary embedding a table reproduces)."""
    forward = type(module).__dict__.get("forward")
    if forward is None or not type(module).__name__.endswith("RotaryEmbedding"):
        return "not a rotary embedding"
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
        return "no inv_freq buffer"
    rope_type = getattr(module, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (the table serves {', '.join(sorted(STATIC_ROPE_TYPES))})"
    params = list(inspect.signature(inspect.unwrap(forward)).parameters)
    if params != ["self", "x", "position_ids"]:
        return f"forward{tuple(params[1:])} is not (x, position_ids)"
    return None


class TableMismatch(RuntimeError):
    pass


def build_table(module: nn.Module, forward: Callable, length: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """(2, length, dim): cos then sin of positions 0 .. length-1 by ``forward`` (the class's), checked
    against ``forward`` on scattered positions (``TableMismatch`` when they differ)."""

    with torch.no_grad(), torch.inference_mode(False):
        like = torch.empty(0, dtype=dtype, device=device)
        cos, sin = forward(module, like, torch.arange(length, device=device).unsqueeze(0))
        table = torch.stack([cos[0], sin[0]]).contiguous()
        gen = torch.Generator().manual_seed(length)
        probe = torch.randint(0, length, (3, 5), generator=gen)
        probe[0, 0], probe[-1, -1] = 0, length - 1
        probe = probe.to(device)
        want = forward(module, like, probe)
        gather = gather_cos_sin if kernel_runs_on(table, probe) else gather_cos_sin_reference
        got = gather(table, probe)
        if not all(torch.equal(w, g) for w, g in zip(want, got)):
            raise TableMismatch(f"{type(module).__name__}: its outputs on a batch of positions differ from "
                                "its outputs position by position")
    return table


def _table_forward(original: Callable, owner: "RotaryTables") -> Callable:
    def forward(self, x, position_ids, *args, **kwargs):
        length = self.__dict__.get(_LENGTH)
        if (length is None or args or kwargs or not isinstance(position_ids, torch.Tensor)
                or position_ids.dim() != 2 or position_ids.device != x.device or x.requires_grad):
            return original(self, x, position_ids, *args, **kwargs)
        table = owner.table(self, original, length, x.dtype, x.device)
        if table is None:
            return original(self, x, position_ids, *args, **kwargs)

        gather = gather_cos_sin if kernel_runs_on(table, position_ids) else gather_cos_sin_reference
        return gather(table, position_ids)

    return forward


class RotaryTables:
    """The tables of one model's rotary modules: built on demand, used inside ``active``."""

    def __init__(self):
        self.modules: List[Tuple[str, nn.Module]] = []
        self.off: Dict[str, str] = {}  # class -> why its table is not used (a failed check)

    def install(self, root: nn.Module, patches: InstancePatches) -> Tuple[List[Tuple[str, nn.Module]], List[Tuple[str, str]]]:
        """A table forward on every rotary embedding under ``root`` that ``table_blocker`` accepts;
        returns (the modules, (class, why not) of the rotary embeddings left as they are)."""
        skipped = {}
        for name, m in root.named_modules():
            if "forward" in m.__dict__ or not type(m).__name__.endswith("RotaryEmbedding"):
                continue
            why = table_blocker(m)
            if why is not None:
                skipped[type(m).__name__] = why
                continue
            patches.bind(m, "forward", _table_forward(type(m).__dict__["forward"], self))
            self.modules.append((name, m))
        return list(self.modules), sorted(skipped.items())

    def table(self, module: nn.Module, forward: Callable, length: int, dtype, device) -> Optional[torch.Tensor]:
        """The module's table of at least ``length`` positions (built now if needed, never while
        capturing); None where it cannot be used."""
        cls = type(module).__name__
        if cls in self.off:
            return None
        tables = module.__dict__.setdefault(_TABLES, {})
        table = tables.get((dtype, device))
        if table is None or table.shape[1] < length:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None  # the runner's warm-up runs build it before the capture
            try:
                table = build_table(module, forward, length, dtype, device)
            except Exception as e:  # noqa: BLE001 - a failed check, or a forward the build cannot call
                why = (str(e) if isinstance(e, TableMismatch)
                       else f"{cls}: building its table failed ({type(e).__name__}: {e})")
                self.off[cls] = why
                logger.warning("fastlora: rotary cos/sin keep the module's own forward: %s", why)
                return None
            tables[(dtype, device)] = table  # graphs captured with the old one hold it (``held``)
        return table

    def held(self) -> List[torch.Tensor]:
        """The tables now in use: a graph captured inside ``active`` keeps these alive."""
        return [t for _, m in self.modules for t in m.__dict__.get(_TABLES, {}).values()]

    @contextmanager
    def active(self, length: int):
        """Inside, the modules read cos / sin from tables of at least ``length`` positions: every
        position passed inside must be below it."""
        for _, m in self.modules:
            m.__dict__[_LENGTH] = length
        try:
            yield
        finally:
            for _, m in self.modules:
                m.__dict__.pop(_LENGTH, None)

    def remove(self):
        """The tables let go (the forwards go back with the patches)."""
        for _, m in self.modules:
            for attr in (_LENGTH, _TABLES):
                m.__dict__.pop(attr, None)
        self.modules = []


__all__ = ["RotaryTables", "STATIC_ROPE_TYPES", "TableMismatch", "build_table", "table_blocker"]
