"""The options of ``patch``: one frozen dataclass, validated once when it is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

from .tuning import Tuning

# batch sizes decode graphs are captured for; a batch is padded to the next one
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

Tristate = Union[bool, str]  # True, False or "auto"
_TRISTATE = (True, False, "auto")


@dataclass(frozen=True)
class PatchOptions:
    """What ``fastlora.patch`` was asked for (see its docstring for each option's meaning)."""

    backend: str = "auto"
    fuse: bool = True
    max_loras_per_batch: Optional[int] = None
    cuda_graphs: Union[bool, str] = "auto"  # True, False, "auto" or "emulate"
    graph_buckets: Tuple[int, ...] = DEFAULT_BUCKETS
    max_graphs: Optional[int] = None  # None: one per bucket (two with per-call folds: DecodeGraphRunner)
    cache_budget_bytes: Optional[int] = None  # None: no cap beyond the largest call's needs
    decode_attention: Tristate = "auto"
    fuse_norms: Tristate = "auto"
    fuse_rotary: Tristate = "auto"
    fuse_silu_mul: Tristate = "auto"
    fuse_kv_write: Tristate = "auto"
    grouped_experts: Tristate = "auto"
    engine_attention: str = "auto"  # "auto", "varlen", "paged" or "engine"
    fold_shrink: Tristate = "auto"
    stream_gemm: Tristate = "auto"
    defer_stop_check: bool = True
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self):
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a string, got {self.backend!r}")
        for name in ("fuse", "defer_stop_check"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_loras_per_batch is not None and (
                isinstance(self.max_loras_per_batch, bool) or int(self.max_loras_per_batch) < 1):
            raise ValueError(f"max_loras_per_batch must be a positive int or None, got {self.max_loras_per_batch!r}")
        if self.cuda_graphs not in (True, False, "auto", "emulate"):
            raise ValueError(f"cuda_graphs must be True, False, 'auto' or 'emulate', got {self.cuda_graphs!r}")
        buckets = self.graph_buckets
        if buckets is None or isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
            raise ValueError(f"graph_buckets must be positive batch sizes, got {buckets!r}")
        buckets = tuple(buckets)
        if not buckets or any(isinstance(b, bool) or int(b) != b or int(b) < 1 for b in buckets):
            raise ValueError(f"graph_buckets must be positive batch sizes, got {self.graph_buckets!r}")
        object.__setattr__(self, "graph_buckets", tuple(sorted({int(b) for b in buckets})))
        if self.max_graphs is not None and (isinstance(self.max_graphs, bool) or int(self.max_graphs) < 1):
            raise ValueError(f"max_graphs must be a positive int or None, got {self.max_graphs!r}")
        if self.cache_budget_bytes is not None and (
                isinstance(self.cache_budget_bytes, bool) or int(self.cache_budget_bytes) < 0):
            raise ValueError(f"cache_budget_bytes must be a non-negative int or None, got {self.cache_budget_bytes!r}")
        if self.engine_attention not in ("auto", "varlen", "paged", "engine"):
            raise ValueError(
                f"engine_attention must be 'auto', 'varlen', 'paged' or 'engine', got {self.engine_attention!r}")
        if not isinstance(self.tuning, Tuning):
            raise TypeError(f"tuning must be a peft_fastlora.Tuning, got {type(self.tuning).__name__}")
        for name in ("decode_attention", "fuse_norms", "fuse_rotary", "fuse_silu_mul", "fuse_kv_write",
                     "grouped_experts", "fold_shrink", "stream_gemm"):
            if getattr(self, name) not in _TRISTATE:
                raise ValueError(f"{name} must be True, False or 'auto', got {getattr(self, name)!r}")

    def differences(self, other: "PatchOptions") -> list:
        """``name: self -> other`` for every option that differs."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: {a!r} -> {b!r}")
        return out
