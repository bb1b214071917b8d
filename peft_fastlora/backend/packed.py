"""The packed layout of a site's LoRA weights: each adapter at its own rank, only for the modules
it targets (the contract's stacks pad every slot to the largest rank and to every module).

- ``a``: a ``(rows, K)`` arena; module j of slot s is rows ``a_rows[s, j] : a_rows[s, j] + rank``.
- ``b``: a flat arena; module j of slot s is the ``(width_j, rank)`` matrix at element
  ``b_offs[s, j]`` (B as PEFT stores it, so values are copied in with one multi-tensor copy).
- ``align``: 8 when every rank of the site is a multiple of 8; the arenas then place every block
  at a multiple of 8 elements and the kernels read B's rows 16 bytes at a time. Else 1.
- entries of modules with rank 0 are never read.
- ``bias``: ``(num_slots, N_total)``, each slot's LoRA B bias (PEFT's ``lora_bias``) in the stacks'
  dtype, zeros where its adapter has none; None where no adapter of the site has one (no cost).
- ``dora``: (scale, shift), each ``(num_slots, N_total)`` float32: a DoRA adapter's output is
  ``(base + delta) * scale + shift`` in its slot's columns (scale: its magnitude over the column
  norms of ``W + s B A``; shift: ``(1 - scale) * base bias``); ones and zeros for other slots; None
  where no adapter of the site is DoRA.

``lora.pool`` allocates it; the kernels (``ops.lora_shrink``, ``lora_expand``, ``lora_fused`` with
``a_rows`` / ``b_offs``) and ``TorchNativeLoRABackend`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

def block_align(ranks) -> int:
    """The ``align`` of a site whose adapters have these ranks (see the module docstring)."""
    return 8 if all(int(r) % 8 == 0 for r in ranks) else 1


@dataclass
class PackedWeights:
    """One site's packed arenas and their (num_slots, c) tables (see the module docstring).

    ``max_rank``: R, the width per module of the shrink output ``(s, c * R)`` (the largest rank).
    ``offsets``: c + 1 column offsets of the stacked modules in the output.
    ``align``: 8 or 1, the alignment every block and rank of the site keeps (elements).
    ``mixed_ranks``: whether the adapters the site may hold differ in rank (a host fact the fused
    decode kernel's launch is chosen by).
    """

    a: torch.Tensor
    b: torch.Tensor
    a_rows: torch.Tensor
    b_offs: torch.Tensor
    max_rank: int
    offsets: Tuple[int, ...]
    align: int = 1
    mixed_ranks: bool = False  # the adapters it may hold differ in rank (the fused kernel's launch)
    bias: Optional[torch.Tensor] = None  # (num_slots, N_total): each slot's LoRA B bias, or None
    dora: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # DoRA's (scale, shift) tables, or None

    @property
    def stack_num(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_slots(self) -> int:
        return self.a_rows.shape[0]

    def width(self, j: int) -> int:
        return self.offsets[j + 1] - self.offsets[j]

    def a_view(self, row: int, rank: int) -> torch.Tensor:
        """Module j's A, (rank, K), starting at arena row ``row``."""
        return self.a[row: row + rank]

    def b_view(self, offset: int, j: int, rank: int) -> torch.Tensor:
        """Module j's B, (width_j, rank), starting at element ``offset`` of the flat arena."""
        return self.b[offset: offset + self.width(j) * rank].view(self.width(j), rank)

    def check(self, x: torch.Tensor) -> None:
        """That ``x`` (s, K) can be multiplied by these weights (the kernels trust the rest)."""
        c = self.stack_num
        if self.a.dim() != 2 or self.b.dim() != 1 or self.a.shape[1] != x.shape[1]:
            raise ValueError(f"packed weights: A {tuple(self.a.shape)} / B {tuple(self.b.shape)} do not "
                             f"fit an input of width {x.shape[1]}")
        if self.a.dtype != x.dtype or self.b.dtype != x.dtype:
            raise TypeError(f"packed weights are {self.a.dtype}, the input {x.dtype}")
        for name, t, dtype in (("a_rows", self.a_rows, torch.int32), ("b_offs", self.b_offs, torch.int64)):
            if t.dtype != dtype or t.dim() != 2 or t.shape[1] != c or not t.is_contiguous():
                raise ValueError(f"packed weights: {name} must be a contiguous (num_slots, {c}) {dtype} table")
        if self.b_offs.shape[0] != self.a_rows.shape[0]:
            raise ValueError("packed weights: a_rows and b_offs hold different slot counts")
        if self.align not in (1, 8):
            raise ValueError(f"packed weights: align must be 1 or 8, got {self.align}")
        if not self.a.is_contiguous() or not self.b.is_contiguous():
            raise ValueError("packed weights: the arenas must be contiguous")
        if self.bias is not None and (self.bias.dtype != x.dtype or self.bias.dim() != 2
                                      or tuple(self.bias.shape) != (self.num_slots, self.offsets[-1])
                                      or self.bias.stride(1) != 1):
            raise ValueError(f"packed weights: bias must be a ({self.num_slots}, {self.offsets[-1]}) {x.dtype} "
                             "table with unit column stride")
        if self.dora is not None:
            shape = (self.num_slots, self.offsets[-1])
            if len(self.dora) != 2 or any(t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous()
                                          for t in self.dora):
                raise ValueError(f"packed weights: dora must be two contiguous {shape} float32 tables (scale, shift)")
