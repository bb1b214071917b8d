"""``Tuning``: the thresholds and tiles of fastlora's paths that remain choices, in one frozen object.

The defaults were measured on an H200 (``docs/performance.md``, ``docs/what-was-tried.md``). Pass one
to ``fastlora.patch(model, tuning=Tuning(...))``: it is the only way benchmarks and tests change them
(kernel modules keep constants nobody assigns). Switches that were measured and decided are not
here: their losing branch was deleted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

import torch


@dataclass(frozen=True)
class Tuning:
    """Args:
        stream_max_rows: decode GEMMs (``base_ops.stream_linears``): the most rows the
            weight-streaming kernel takes (past it the TMA kernel, where its table has the
            weight's class, or cuBLAS).
        stream_min_n, stream_max_n: the output widths it takes (the LM head stays on cuBLAS).
        stream_narrow_n, stream_narrow_max_rows: layers narrower than ``stream_narrow_n`` split
            their reduction and stream at most ``stream_narrow_max_rows`` rows.
        stream_min_k: the shallowest reduction it takes.
        stream_split_max_n: the widest layer a split-K launch covers.
        stream_dtypes: the input dtypes it takes.
        tma_tiles: the TMA kernel's tile per shape class ("deep", "square", "tall", "wide", "glu"):
            ``ops.tma_gemm.TmaConfig`` fields and, optionally, "min_k" (the shallowest reduction
            it applies to); a class left out keeps cuBLAS. None: the table measured on an H200.
        tma_add_tiles: the tile of a folded deep weight whose residual add rides in its epilogue,
            by class: (``TmaConfig`` fields, min_k).
        glu_expand_min_tokens: a LoRA gate/up site of a gated MLP adds both deltas inside the
            activation's launch (``ops.glu_expand``, after the base GEMM and the shrink) in the
            forwards of at least this many tokens whose every row brings at least the kernel's
            row tile of tokens (a prefill: each tile then holds one adapter's tokens), instead of
            writing them into the projection's output for the activation to read again; never in
            a continuous-batching step (its tiles mix sequences) or a decode step. None: never.
            Applies with the Triton backend and the gated activation kernel (``fuse_silu_mul``).
            ``benchmarks/bench_prefill.py --glu-expand`` measures it against the two launches
            (its ``fastlora`` row runs with None).
        fold_max_share: the shrink folded under the base weight (``lora.fusion``): an arena of at
            most this share of the base weight's rows is folded for every call.
        fold_call_share: one of at most this share is folded for the calls whose adapters use at
            least ``fold_min_use`` of its rows.
        fold_min_use: see ``fold_call_share``.
        fold_stage_margin: with fewer slots than adapters, a staging tail sized for a call of
            average adapters, times this margin.
        fold_max_tokens: the most tokens a forward carries for its sites to take the shrink from
            the folded GEMM (the GEMM computes every arena row for every token); a larger one
            launches each site's shrink, which reads each adapter's A for its own tokens only.
        staging_bytes: registered adapters' loads (``lora.host_copy``): the most staging at once.
        prestage_bytes: the most of a load's buffers queued ahead of placement.
        staged_devices: the device types where loads are staged (tests add "cpu").
    """

    stream_max_rows: int = 64
    stream_min_n: int = 2048
    stream_max_n: int = 65536
    stream_narrow_n: int = 4096
    stream_narrow_max_rows: int = 32
    stream_min_k: int = 2048
    stream_split_max_n: int = 16384
    stream_dtypes: Tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    tma_tiles: Optional[Mapping[str, Mapping[str, int]]] = None
    tma_add_tiles: Mapping[str, Tuple[Mapping[str, int], int]] = dataclasses.field(default_factory=lambda: {
        "deep": (dict(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4), 14336)})
    glu_expand_min_tokens: Optional[int] = 4096
    fold_max_share: float = 1 / 8
    fold_call_share: float = 1.0
    fold_min_use: float = 1 / 3
    fold_stage_margin: float = 1.25
    fold_max_tokens: int = 256
    staging_bytes: int = 256 << 20
    prestage_bytes: int = 1 << 30
    staged_devices: Tuple[str, ...] = ("cuda",)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"Tuning.{f.name} must be a non-negative number, got {value!r}")
        tokens = self.glu_expand_min_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"Tuning.glu_expand_min_tokens must be a positive int or None, got {tokens!r}")
        if not all(isinstance(d, torch.dtype) for d in self.stream_dtypes):
            raise ValueError(f"Tuning.stream_dtypes must be torch dtypes, got {self.stream_dtypes!r}")
        if not all(isinstance(d, str) for d in self.staged_devices):
            raise ValueError(f"Tuning.staged_devices must be device types, got {self.staged_devices!r}")

    def replace(self, **changes) -> "Tuning":
        return dataclasses.replace(self, **changes)
