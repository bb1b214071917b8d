"""What every fastlora backend shares: batch-info preparation, input checks, and the mapping of
the contract's methods onto two primitives, a stacked shrink and a sliced expand.

A backend subclasses ``SegmentedLoRABackend`` and implements ``_shrink``, ``_expand`` and
``_embedding_a`` (and ``_extra_token_embedding``); the methods of the contract are written once
here on top of them. A backend with a one-kernel shrink + expand for some batches also implements
``_fuses`` (which batches) and ``_fused``; the stacked calls and ``run_lora`` then use it.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from ..kernel_support import FLOAT_DTYPES
from ..batch import BLOCK_M_TIERS, BatchInfoBuffers, ForwardBatch, LoRABatchInfo, choose_block_m
from .base import BaseLoRABackend
from .packed import PackedWeights


def _round_up_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_input(name: str, t: torch.Tensor, ndim: int, dtype=None, ids: bool = False):
    """The one validation of a contract method's tensor argument (the kernels below trust it):
    a contiguous ``ndim``-D tensor of a floating dtype the kernels take (``ids``: int32/int64)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    allowed = (torch.int32, torch.int64) if ids else FLOAT_DTYPES
    if t.dtype not in allowed:
        raise TypeError(f"{name} has unsupported dtype {t.dtype} (expected one of {allowed})")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")


class SegmentedLoRABackend(BaseLoRABackend):
    """Backend skeleton over chunked, slot-sorted batch info (see ``batch.LoRABatchInfo``)."""

    supported_dtypes = FLOAT_DTYPES  # the layers leave other dtypes on PEFT's path

    def __init__(self, max_loras_per_batch: int, device: torch.device):
        super().__init__(max_loras_per_batch, torch.device(device))
        self._eager_buffers: dict[int, BatchInfoBuffers] = {}
        self._eager_high = (1, 1, 1)  # largest (rows, tokens, slots) an eager forward has had
        self._graph_buffers: Optional[BatchInfoBuffers] = None

    # ---- primitives a backend implements -------------------------------------------------
    def _shrink(self, x, weights, stack_num, ranks, bi: LoRABatchInfo) -> torch.Tensor:
        raise NotImplementedError

    def _expand(self, x, weights, offsets, ranks, scalings, out, bi: LoRABatchInfo) -> torch.Tensor:
        raise NotImplementedError

    def _embedding_a(self, input_ids, weights, vocab_size, extra, bi: LoRABatchInfo) -> torch.Tensor:
        raise NotImplementedError

    def _extra_token_embedding(self, input_ids, output, extra, vocab_size, bi) -> torch.Tensor:
        raise NotImplementedError

    def _packed(self, x, weights: PackedWeights, ranks, scalings, out, bi: LoRABatchInfo) -> torch.Tensor:
        """Shrink and expand of packed weights (``backend.packed``), out (s, N_total) in place."""
        raise NotImplementedError

    def _packed_expand(self, y, weights: PackedWeights, ranks, scalings, out, bi: LoRABatchInfo) -> torch.Tensor:
        """The expand of packed weights from ``y`` (s, rows of A): module j of a slot reads the
        columns of its A rows, ``y[:, a_rows[slot, j] : + rank]``; out (s, N_total) in place."""
        raise NotImplementedError

    def _packed_embedding(self, input_ids, weights: PackedWeights, vocab_size, ranks, scalings, out,
                          bi: LoRABatchInfo) -> torch.Tensor:
        """A LoRA embedding on packed weights: lookup in A, expand by B into out (s, D) in place."""
        raise NotImplementedError

    def _fuses(self, lora_b, stack_num, bi: LoRABatchInfo) -> bool:
        """Whether ``_fused`` serves this site (host-side, static per batch info): no by default."""
        return False

    def _fused(self, x, lora_a, lora_b, offsets, ranks, scalings, out, bi) -> torch.Tensor:
        """Shrink and expand in one primitive; x (s, K), lora_a (num_slots, c*R, K), lora_b
        (num_slots, N_total, R), out (s, N_total) updated in place."""
        raise NotImplementedError

    # ---- batch info ----------------------------------------------------------------------
    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int, *,
                                   max_slots: int = 0):
        """Static batch-info buffers for graphs of up to ``max_bs_in_cuda_graph`` rows, shared by
        every graph (a smaller batch fills the first entries). Kernels size their grids from the
        buffers' chunk capacity and skip unused chunks, so sizing for the largest batch costs a
        small batch nothing. Calling this again replaces the buffers: graphs captured before
        must be dropped. ``max_slots``: adapter slots to leave room for (beyond the default hint).
        """
        if max_bs_in_cuda_graph < 1 or num_tokens_per_bs < 1:
            raise ValueError(f"init_cuda_graph_batch_info needs positive sizes, got "
                             f"({max_bs_in_cuda_graph}, {num_tokens_per_bs})")
        self._graph_buffers = self.new_graph_buffers(max_bs_in_cuda_graph,
                                                     max_bs_in_cuda_graph * num_tokens_per_bs,
                                                     max_slots=max_slots)
        return self._graph_buffers

    def new_graph_buffers(self, max_bs: int, max_tokens: int, *, max_slots: int = 0) -> BatchInfoBuffers:
        """Static batch-info buffers for graphs of up to ``max_bs`` rows and ``max_tokens`` tokens,
        row tile chosen from ``max_tokens``. ``init_cuda_graph_batch_info`` makes the backend's
        own; an owner of several graph families (the continuous-batching engine's) makes one per
        family and fills it through ``using_graph_buffers``."""
        return BatchInfoBuffers(
            max_bs=max_bs, max_tokens=max_tokens,
            max_slots=max(self._max_slots_hint(), _round_up_pow2(max(1, max_slots))),
            max_loras=self.max_loras_per_batch, block_m=choose_block_m(max_tokens),
            device=self.device)

    @contextlib.contextmanager
    def using_graph_buffers(self, buffers: BatchInfoBuffers):
        """``prepare_lora_batch(..., use_cuda_graph=True)`` inside fills ``buffers``."""
        previous, self._graph_buffers = self._graph_buffers, buffers
        try:
            yield buffers
        finally:
            self._graph_buffers = previous

    def graph_slot_capacity(self) -> int:
        """Adapter slots the graph batch-info buffers hold (0 before ``init_cuda_graph_batch_info``)."""
        return self._graph_buffers.max_slots if self._graph_buffers is not None else 0

    def _max_slots_hint(self) -> int:
        # slot tables are small; leave room for adapters added after the graphs were captured
        return max(64, 2 * self.max_loras_per_batch)

    def prepare_lora_batch(
        self,
        forward_batch: ForwardBatch,
        weight_indices: Sequence[int],
        lora_ranks: Sequence[int],
        scalings: Sequence[float],
        use_cuda_graph: bool,
    ) -> LoRABatchInfo:
        # (builtins over the whole list, no Python loop: an engine step has hundreds of rows)
        weight_indices = list(map(int, weight_indices))
        if len(weight_indices) != forward_batch.batch_size:
            raise ValueError(
                f"weight_indices has {len(weight_indices)} entries for a batch of "
                f"{forward_batch.batch_size} rows")
        seq_lens = list(map(int, forward_batch.seq_lens))
        if len(seq_lens) != forward_batch.batch_size:
            raise ValueError(f"forward_batch.seq_lens has {len(seq_lens)} entries for a batch of "
                             f"{forward_batch.batch_size} rows")
        if seq_lens and min(seq_lens) < 0:
            raise ValueError(f"forward_batch.seq_lens holds a negative token count ({min(seq_lens)})")
        if len(lora_ranks) != len(scalings):
            raise ValueError(
                f"lora_ranks ({len(lora_ranks)}) and scalings ({len(scalings)}) must both have "
                "one entry per slot")
        if weight_indices and (min(weight_indices) < -1 or max(weight_indices) >= len(lora_ranks)):
            w = next(w for w in weight_indices if w < -1 or w >= len(lora_ranks))
            raise ValueError(f"weight index {w} is not a slot (0..{len(lora_ranks) - 1}) or -1")
        distinct = set(weight_indices)
        distinct.discard(-1)
        if len(distinct) > self.max_loras_per_batch:
            raise ValueError(
                f"{len(distinct)} distinct adapters in one batch exceed "
                f"max_loras_per_batch={self.max_loras_per_batch}")
        num_tokens = forward_batch.num_tokens
        if use_cuda_graph:
            if self._graph_buffers is None:
                raise RuntimeError("prepare_lora_batch(use_cuda_graph=True) before init_cuda_graph_batch_info")
            buffers = self._graph_buffers
        else:
            buffers = self._eager_buffers_for(forward_batch.batch_size, num_tokens, len(lora_ranks))
        self.batch_info = buffers.fill(
            forward_batch.batch_size, num_tokens, seq_lens, weight_indices,
            list(lora_ranks), list(scalings))
        return self.batch_info

    def _eager_buffers_for(self, bs: int, num_tokens: int, num_slots: int) -> BatchInfoBuffers:
        """The eager batch-info buffers of this forward's row tile. When one must grow, every
        tile's buffers are rebuilt together: the bounded tiles at their limit, the last one at the
        largest call so far (powers of two). Memory then follows the largest call alone and
        stops growing after it, whatever order the sizes arrive in."""
        block_m = choose_block_m(num_tokens)
        buffers = self._eager_buffers.get(block_m)
        if (buffers is not None and buffers.max_bs >= bs and buffers.max_tokens >= num_tokens
                and buffers.max_slots >= num_slots):
            return buffers
        high_bs, high_tokens, high_slots = self._eager_high = tuple(
            max(a, b) for a, b in zip(self._eager_high, (bs, num_tokens, num_slots)))
        slots = max(self._max_slots_hint(), _round_up_pow2(high_slots))
        self._eager_buffers = {}
        for tile, limit in BLOCK_M_TIERS:
            tokens = limit if limit is not None else _round_up_pow2(high_tokens)
            rows = limit if limit is not None else _round_up_pow2(high_bs)  # rows <= tokens
            self._eager_buffers[tile] = BatchInfoBuffers(
                max_bs=rows, max_tokens=tokens, max_slots=slots,
                max_loras=self.max_loras_per_batch, block_m=tile, device=self.device)
        return self._eager_buffers[block_m]

    def _bi(self, batch_info: Optional[LoRABatchInfo]) -> LoRABatchInfo:
        bi = batch_info if batch_info is not None else self.batch_info
        if bi is None:
            raise RuntimeError("no batch info: call prepare_lora_batch first")
        return bi

    def _tables(self, bi, stack_num, layer_ranks, layer_scalings, num_slots):
        """Per-(slot, module) rank and scaling tables, from the layer or from the batch."""
        if layer_ranks is None:
            layer_ranks = bi.lora_ranks[:, None].expand(-1, stack_num).contiguous()
        if layer_scalings is None:
            layer_scalings = bi.scalings[:, None].expand(-1, stack_num).contiguous()
        for name, t, dtype in (("layer_ranks", layer_ranks, torch.int32),
                               ("layer_scalings", layer_scalings, torch.float32)):
            if t.dtype != dtype or t.dim() != 2 or t.shape[1] != stack_num or not t.is_contiguous():
                raise ValueError(
                    f"{name} must be a contiguous (num_slots, {stack_num}) {dtype} tensor, got "
                    f"{tuple(t.shape)} {t.dtype}")
            if t.shape[0] < num_slots:
                raise ValueError(f"{name} has {t.shape[0]} slots, the weights {num_slots}")
        return layer_ranks, layer_scalings

    def _check_tokens(self, x, bi):
        if x.shape[0] != bi.num_tokens:
            raise ValueError(
                f"input has {x.shape[0]} tokens but the batch info describes {bi.num_tokens}")

    def _check_shrink_args(self, x, weights, stack_num, bi):
        check_input("x", x, 2)
        check_input("weights", weights, 3, dtype=x.dtype)
        self._check_tokens(x, bi)
        if weights.shape[2] != x.shape[1]:
            raise ValueError(f"x has input_dim {x.shape[1]}, lora A weights {weights.shape[2]}")
        if weights.shape[1] % stack_num:
            raise ValueError(f"lora A dim 1 ({weights.shape[1]}) is not a multiple of stack_num={stack_num}")

    @staticmethod
    def _checked_base_output(base_output, x, n_total):
        if base_output is None:
            return torch.zeros(x.shape[0], n_total, dtype=x.dtype, device=x.device)
        if base_output.dim() != 2 or tuple(base_output.shape) != (x.shape[0], n_total):
            raise ValueError(
                f"base_output must be ({x.shape[0]}, {n_total}), got {tuple(base_output.shape)}")
        if base_output.stride(1) != 1:
            raise ValueError("base_output must have unit stride in its last dimension")
        if base_output.dtype not in FLOAT_DTYPES:
            raise TypeError(f"base_output has unsupported dtype {base_output.dtype}")
        return base_output

    # ---- the contract ----------------------------------------------------------------------
    def run_lora_a_sgemm(self, x, weights, *, stack_num=1, layer_ranks=None, batch_info=None):
        bi = self._bi(batch_info)
        self._check_shrink_args(x, weights, stack_num, bi)
        ranks, _ = self._tables(bi, stack_num, layer_ranks, None, weights.shape[0])
        return self._shrink(x, weights, stack_num, ranks, bi)

    def _expand_checked(self, x, weights, offsets, base_output, layer_ranks, layer_scalings, bi):
        stack_num = len(offsets) - 1
        check_input("x", x, 2)
        check_input("weights", weights, 3, dtype=x.dtype)
        self._check_tokens(x, bi)
        r = weights.shape[2]
        if x.shape[1] != stack_num * r:
            raise ValueError(
                f"expand input has {x.shape[1]} columns, expected {stack_num} x rank {r}")
        if offsets[-1] != weights.shape[1]:
            raise ValueError(f"output offsets end at {offsets[-1]}, lora B has {weights.shape[1]} rows")
        base_output = self._checked_base_output(base_output, x, offsets[-1])
        ranks, scalings = self._tables(bi, stack_num, layer_ranks, layer_scalings, weights.shape[0])
        return self._expand(x, weights, tuple(int(o) for o in offsets), ranks, scalings, base_output, bi)

    def run_lora_b_sgemm(self, x, weights, *, base_output=None, layer_ranks=None,
                         layer_scalings=None, batch_info=None):
        bi = self._bi(batch_info)
        return self._expand_checked(x, weights, (0, weights.shape[1]), base_output,
                                    layer_ranks, layer_scalings, bi)

    def _stacked(self, x, lora_a, lora_b, offsets, base_output, layer_ranks, layer_scalings, bi):
        n = len(offsets) - 1
        if isinstance(lora_b, (tuple, list)):
            lora_b = self._join_b(lora_b, n)
        if self._fuses(lora_b, n, bi):
            return self._fused_checked(x, lora_a, lora_b, offsets, base_output, layer_ranks,
                                       layer_scalings, bi)
        y = self.run_lora_a_sgemm(x, lora_a, stack_num=n, layer_ranks=layer_ranks, batch_info=bi)
        return self._expand_checked(y, lora_b, offsets, base_output, layer_ranks, layer_scalings, bi)

    def _fused_checked(self, x, lora_a, lora_b, offsets, base_output, layer_ranks, layer_scalings, bi):
        """The checks of the shrink and of the expand, then ``_fused``."""
        n = len(offsets) - 1
        self._check_shrink_args(x, lora_a, n, bi)
        check_input("weights", lora_b, 3, dtype=x.dtype)
        r = lora_b.shape[2]
        if lora_a.shape[1] != n * r:
            raise ValueError(f"lora A has {lora_a.shape[1]} rows, expected {n} x rank {r} (lora B's)")
        if offsets[-1] != lora_b.shape[1]:
            raise ValueError(f"output offsets end at {offsets[-1]}, lora B has {lora_b.shape[1]} rows")
        base_output = self._checked_base_output(base_output, x, offsets[-1])
        ranks, scalings = self._tables(bi, n, layer_ranks, layer_scalings,
                                       max(lora_a.shape[0], lora_b.shape[0]))
        return self._fused(x, lora_a, lora_b, tuple(int(o) for o in offsets), ranks, scalings,
                           base_output, bi)

    def run_lora(self, x, lora_a, lora_b, *, output_offset=None, base_output=None,
                 layer_ranks=None, layer_scalings=None, batch_info=None):
        """Shrink and expand of one site in one call: ``run_lora_a_sgemm`` then
        ``run_lora_b_sgemm`` (one module) or ``run_stacked_lora`` (``output_offset`` given), in
        a single kernel where the backend has one for this batch (Triton, decode).

        Args:
            x: (s, input_dim).
            lora_a: (num_loras, c * r, input_dim).
            lora_b: (num_loras, output_dim, r).
            output_offset: c + 1 column offsets of the stacked modules in the output; None: one
                module, ``(0, output_dim)``.
        Returns:
            (s, output_dim), ``base_output`` when given.
        """
        bi = self._bi(batch_info)
        if output_offset is None:
            if isinstance(lora_b, (tuple, list)):
                raise ValueError("run_lora: a tuple lora B needs output_offset")
            if not self._fuses(lora_b, 1, bi):  # the two contract calls, as a layer makes them
                y = self.run_lora_a_sgemm(x, lora_a, stack_num=1, layer_ranks=layer_ranks,
                                          batch_info=bi)
                return self.run_lora_b_sgemm(y, lora_b, base_output=base_output,
                                             layer_ranks=layer_ranks,
                                             layer_scalings=layer_scalings, batch_info=bi)
            output_offset = (0, lora_b.shape[1])
        return self._stacked(x, lora_a, lora_b, [int(o) for o in output_offset], base_output,
                             layer_ranks, layer_scalings, bi)

    @staticmethod
    def _check_packed_slots(bi, weights: PackedWeights):
        if bi.slots_in_batch and max(bi.slots_in_batch) >= weights.num_slots:
            raise ValueError(f"the batch uses slot {max(bi.slots_in_batch)} but the packed weights hold "
                             f"{weights.num_slots} slots")

    def _packed_tables(self, bi, weights: PackedWeights, layer_ranks, layer_scalings):
        """The slots checked, then the (num_slots, c) rank and scaling tables of packed weights."""
        self._check_packed_slots(bi, weights)
        return self._tables(bi, weights.stack_num, layer_ranks, layer_scalings, weights.num_slots)

    def run_packed_lora(self, x, weights: PackedWeights, *, base_output=None, layer_ranks=None,
                        layer_scalings=None, batch_info=None):
        """fastlora's own storage, beside the contract: ``run_stacked_lora`` on packed weights
        (each adapter at its own rank, only for the modules it targets; see ``backend.packed``).

        Args:
            x: (s, input_dim).
            weights: the site's ``PackedWeights`` (its ``offsets`` give the output's columns).
            base_output, layer_ranks, layer_scalings, batch_info: as ``run_stacked_lora``.
        Returns:
            (s, output_dim), ``base_output`` when given.
        """
        bi = self._bi(batch_info)
        check_input("x", x, 2)
        self._check_tokens(x, bi)
        weights.check(x)
        base_output = self._checked_base_output(base_output, x, weights.offsets[-1])
        ranks, scalings = self._packed_tables(bi, weights, layer_ranks, layer_scalings)
        return self._packed(x, weights, ranks, scalings, base_output, bi)

    def run_packed_expand(self, y, weights: PackedWeights, *, base_output=None, layer_ranks=None,
                          layer_scalings=None, batch_info=None):
        """The second half of ``run_packed_lora``, for a shrink computed elsewhere: by the base
        GEMM, when the packed A arena is stored as more rows under the base weight, so that
        ``x @ [W; A].T`` gives the base output and every A row's product at once.

        Args:
            y: (s, rows of ``weights.a``), x @ A.T for every row of the arena (the input dtype);
                module j of a slot reads columns ``a_rows[slot, j] : a_rows[slot, j] + rank``.
            weights, base_output, layer_ranks, layer_scalings, batch_info: as ``run_packed_lora``.
        Returns:
            (s, output_dim), ``base_output`` when given.
        """
        bi = self._bi(batch_info)
        # a view of the GEMM's output columns: rows one stride apart, not contiguous
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.stride(1) != 1:
            raise ValueError("run_packed_expand: y must be a 2-D tensor with unit column stride")
        self._check_tokens(y, bi)
        if y.shape[1] != weights.a.shape[0] or y.dtype != weights.b.dtype:
            raise ValueError(f"run_packed_expand: y {tuple(y.shape)} {y.dtype} does not hold one {weights.b.dtype} "
                             f"column per row of the packed A arena ({weights.a.shape[0]})")
        base_output = self._checked_base_output(base_output, y, weights.offsets[-1])
        ranks, scalings = self._packed_tables(bi, weights, layer_ranks, layer_scalings)
        return self._packed_expand(y, weights, ranks, scalings, base_output, bi)

    def run_packed_embedding_lora(self, input_ids, weights: PackedWeights, vocab_size: int, *,
                                  base_output=None, layer_ranks=None, layer_scalings=None, batch_info=None):
        """fastlora's own storage for a LoRA embedding: ``run_lora_a_embedding`` then
        ``run_lora_b_sgemm`` on packed weights (A blocks ``(rank, vocab)``, B ``(D, rank)``).

        Args:
            input_ids: (s,) int32 / int64; ids at or past ``vocab_size`` get no delta.
            weights: the site's ``PackedWeights`` (one module: ``offsets`` (0, D)).
        Returns:
            (s, D), ``base_output`` when given.
        """
        bi = self._bi(batch_info)
        check_input("input_ids", input_ids, 1, ids=True)
        self._check_tokens(input_ids, bi)
        if weights.stack_num != 1 or weights.a.dim() != 2 or weights.a.shape[1] != vocab_size:
            raise ValueError(f"packed embedding weights: A {tuple(weights.a.shape)} with {weights.stack_num} "
                             f"modules does not fit a vocabulary of {vocab_size}")
        self._check_packed_slots(bi, weights)
        out = torch.zeros(input_ids.shape[0], weights.offsets[-1], dtype=weights.a.dtype, device=weights.a.device) \
            if base_output is None else base_output
        if out.dim() != 2 or tuple(out.shape) != (input_ids.shape[0], weights.offsets[-1]) or out.stride(1) != 1:
            raise ValueError(f"base_output must be ({input_ids.shape[0]}, {weights.offsets[-1]}) with unit "
                             f"column stride, got {tuple(out.shape)}")
        ranks, scalings = self._tables(bi, 1, layer_ranks, layer_scalings, weights.num_slots)
        return self._packed_embedding(input_ids, weights, vocab_size, ranks, scalings, out, bi)

    @staticmethod
    def _join_b(parts, n):
        # the tuple form of the contract: ((1, L, out_q, r), (2, L, out_kv, r)) or two (L, out, r)
        mats = []
        for p in parts:
            mats.extend(p.unbind(0) if p.dim() == 4 else [p])
        if len(mats) != n:
            raise ValueError(f"lora B tuple holds {len(mats)} matrices, expected {n}")
        return torch.cat(mats, dim=1).contiguous()

    def run_qkv_lora(self, x, qkv_lora_a, qkv_lora_b, *, output_offset, base_output=None,
                     layer_ranks=None, layer_scalings=None, batch_info=None):
        offsets = [int(o) for o in output_offset]
        if len(offsets) != 4:
            raise ValueError(f"output_offset needs 4 entries (q, k, v, end), got {offsets}")
        return self._stacked(x, qkv_lora_a, qkv_lora_b, offsets, base_output, layer_ranks,
                             layer_scalings, self._bi(batch_info))

    def run_gate_up_lora(self, x, gate_up_lora_a, gate_up_lora_b, *, base_output=None,
                         layer_ranks=None, layer_scalings=None, batch_info=None):
        if isinstance(gate_up_lora_b, (tuple, list)):
            out = gate_up_lora_b[0].shape[-2]
        else:
            if gate_up_lora_b.shape[1] % 2:
                raise ValueError(f"gate_up lora B has an odd output dim {gate_up_lora_b.shape[1]}")
            out = gate_up_lora_b.shape[1] // 2
        return self._stacked(x, gate_up_lora_a, gate_up_lora_b, (0, out, 2 * out), base_output,
                             layer_ranks, layer_scalings, self._bi(batch_info))

    def run_stacked_lora(self, x, lora_a, lora_b, *, output_offset, base_output=None,
                         layer_ranks=None, layer_scalings=None, batch_info=None):
        """Any number of stacked modules (the general case of qkv and gate_up)."""
        return self._stacked(x, lora_a, lora_b, [int(o) for o in output_offset], base_output,
                             layer_ranks, layer_scalings, self._bi(batch_info))

    def run_lora_a_embedding(self, input_ids, weights, vocab_size, extra_embeddings=None, *,
                             batch_info=None):
        bi = self._bi(batch_info)
        check_input("input_ids", input_ids, 1, ids=True)
        check_input("weights", weights, 3)
        self._check_tokens(input_ids, bi)
        if weights.shape[2] != vocab_size:
            raise ValueError(f"embedding A has vocab dim {weights.shape[2]}, vocab_size={vocab_size}")
        if extra_embeddings is not None:
            check_input("extra_embeddings", extra_embeddings, 3, dtype=weights.dtype)
            if extra_embeddings.shape[2] != weights.shape[1]:
                raise ValueError("extra_embeddings' last dim must equal the rank of weights")
        return self._embedding_a(input_ids, weights, vocab_size, extra_embeddings, bi)

    def run_extra_token_embedding(self, input_ids, output, extra_embeddings, vocab_size, *,
                                  batch_info=None):
        bi = self._bi(batch_info)
        check_input("input_ids", input_ids, 1, ids=True)
        check_input("output", output, 2)
        check_input("extra_embeddings", extra_embeddings, 3, dtype=output.dtype)
        self._check_tokens(input_ids, bi)
        if extra_embeddings.shape[2] != output.shape[1]:
            raise ValueError("extra_embeddings' last dim must equal output's embed_dim")
        return self._extra_token_embedding(input_ids, output, extra_embeddings, vocab_size, bi)
