"""Triton backend: the segmented shrink / expand / embedding kernels of ``peft_fastlora.ops``.

Every launch is sized from the batch info's fixed ``max_chunks`` and reads ranks, scalings and
slots on the device, so a call never syncs with the host and can be captured in a CUDA graph.
Decode-sized batches (16-row chunks) run a site's shrink and expand as one fused launch
(``ops.lora_fused``); prefill keeps the two kernels. The choice is made on the host from the
batch info's row tile, which is fixed per captured graph.
The registry imports this module only when the backend is asked for; Triton is imported here.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import BLOCK_M_TIERS, BatchInfoBuffers, LoRABatchInfo, max_chunks_for
from ..kernel_support import interpreting
from .. import ops as _ops
from .segmented import SegmentedLoRABackend, check_input


class TritonLoRABackend(SegmentedLoRABackend):
    """Args (beyond the contract's): fused_decode: run decode-sized stacked calls and ``run_lora``
    as one fused kernel (False: always the shrink and expand kernels, as before)."""

    name = "triton"

    def __init__(self, max_loras_per_batch: int, device: torch.device, *, fused_decode: bool = True,
                 rank_block: Optional[int] = None):
        super().__init__(max_loras_per_batch, device)
        if rank_block is not None and (not isinstance(rank_block, int) or rank_block < 1):
            raise ValueError(f"TritonLoRABackend: rank_block must be a positive int or None, got {rank_block!r}")
        self.fused_decode = fused_decode
        self.rank_block = rank_block  # the fused kernel's rows of A a step (None: ``ops.lora_fused``'s choice)
        # the fused kernel's scratch, one per device; zero between calls, never freed (graphs)
        self._workspaces: dict = {}

    def _workspace(self, device: torch.device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0": one workspace
            device = torch.device("cuda", torch.cuda.current_device())
        ws = self._workspaces.get(device)
        if ws is None:
            ws = self._workspaces[device] = _ops.FusedWorkspace(device)
        return ws

    def _reserve_fused(self, buffers: BatchInfoBuffers) -> None:
        """Size the fused kernel's workspace, at the first buffers of its row tile, for every launch
        it can ever take: any site (the most modules and rank block) and the most chunks of the
        tile's largest forward over ``max_loras_per_batch`` adapters. Sized for these buffers alone,
        a later call with more chunks (an eager prefill of a few hundred tokens after the decode
        buckets were captured) would grow it, and each grown-out buffer stays for the graphs that
        captured it."""
        tile, limit = BLOCK_M_TIERS[0]
        if not (self.fused_decode and buffers.block_m <= tile):
            return
        most = max(buffers.max_chunks, max_chunks_for(limit, tile, max(self.max_loras_per_batch, buffers.max_loras)))
        self._workspace(self.device).reserve(most, _ops.FUSED_MAX_MODULES, _ops.FUSED_MAX_BLOCK_R, tile)

    def new_graph_buffers(self, max_bs: int, max_tokens: int, *, max_slots: int = 0):
        buffers = super().new_graph_buffers(max_bs, max_tokens, max_slots=max_slots)
        self._reserve_fused(buffers)  # now, so that no capture has to allocate it
        return buffers

    def _eager_buffers_for(self, bs: int, num_tokens: int, num_slots: int) -> BatchInfoBuffers:
        buffers = super()._eager_buffers_for(bs, num_tokens, num_slots)
        self._reserve_fused(buffers)
        return buffers

    def fused_timeouts(self) -> int:
        """How many times a fused-kernel reader gave up waiting and recomputed (should be 0; a
        host sync, for tests and benchmarks)."""
        return sum(ws.timeouts() for ws in self._workspaces.values())

    # ---- the checks the shared layer cannot make (placement); the launchers then check nothing --
    def _check_place(self, what: str, bi: LoRABatchInfo, *tensors: torch.Tensor):
        dev = tensors[0].device
        if dev.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"triton backend: {what} got tensors on {dev}; the kernels need CUDA tensors "
                "(or TRITON_INTERPRET=1 set before peft_fastlora.ops is imported, to run them "
                "on CPU in Triton's interpreter); use the 'torch_native' backend on CPU")
        for t in tuple(tensors[1:]) + (bi.sorted_token_ids, bi.chunk_slot, bi.token_slot):
            if t.device != dev:
                raise ValueError(
                    f"triton backend: {what} mixes devices ({dev} and {t.device}); the inputs, "
                    "weights, rank/scaling tables and batch info must share one device")

    @staticmethod
    def _check_slots(what: str, bi: LoRABatchInfo, num_slots: int):
        # host-side list, no sync; the kernels also skip such slots rather than read past the end
        if bi.slots_in_batch and max(bi.slots_in_batch) >= num_slots:
            raise ValueError(
                f"triton backend: {what}: the batch uses slot {max(bi.slots_in_batch)} but the "
                f"weights hold {num_slots} slots")

    # ---- primitives --------------------------------------------------------------------------
    def _shrink(self, x, weights, stack_num, ranks, bi):
        """x (s, K), weights (num_slots, c*R, K), ranks (num_slots, c) -> (s, c*R)."""
        self._check_place("lora A", bi, x, weights, ranks)
        self._check_slots("lora A", bi, weights.shape[0])
        return _ops.lora_shrink(
            x, weights, stack_num, ranks,
            bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
            block_m=bi.block_m, check=False)

    def _expand(self, x, weights, offsets, ranks, scalings, out, bi):
        """x (s, c*R), weights (num_slots, N_total, R), out (s, N_total) updated in place."""
        self._check_place("lora B", bi, x, weights, ranks, scalings, out)
        self._check_slots("lora B", bi, weights.shape[0])
        return _ops.lora_expand(
            x, weights, offsets, ranks, scalings, out,
            bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
            block_m=bi.block_m, check=False)

    def _fuses(self, lora_b, stack_num, bi):
        return (self.fused_decode and isinstance(lora_b, torch.Tensor) and lora_b.dim() == 3
                and _ops.fused_supported(stack_num, lora_b.shape[2], bi.block_m, lora_b.dtype))

    def _fused(self, x, lora_a, lora_b, offsets, ranks, scalings, out, bi):
        """x (s, K), lora_a (num_slots, c*R, K), lora_b (num_slots, N_total, R), out (s, N_total)
        updated in place, in one launch."""
        self._check_place("lora A and B", bi, x, lora_a, lora_b, ranks, scalings, out)
        self._check_slots("lora A and B", bi, min(lora_a.shape[0], lora_b.shape[0]))
        return _ops.lora_fused(
            x, lora_a, lora_b, offsets, ranks, scalings, out,
            bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
            self._workspace(x.device), block_m=bi.block_m, check=False, rank_block=self.rank_block)

    def _packed(self, x, weights, ranks, scalings, out, bi):
        """Packed weights: the fused kernel for decode-sized batches, else shrink and expand."""
        w = weights
        self._check_place("packed lora A and B", bi, x, w.a, w.b, w.a_rows, w.b_offs, ranks, scalings, out)
        self._check_slots("packed lora A and B", bi, w.num_slots)
        plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
        if self.fused_decode and _ops.fused_supported(w.stack_num, w.max_rank, bi.block_m, x.dtype):
            return _ops.lora_fused(x, w.a, w.b, w.offsets, ranks, scalings, out, *plan,
                                   self._workspace(x.device), block_m=bi.block_m, check=False,
                                   a_rows=w.a_rows, b_offs=w.b_offs, max_rank=w.max_rank, b_align=w.align,
                                   mixed_ranks=w.mixed_ranks, rank_block=self.rank_block, bias=w.bias, dora=w.dora)
        y = _ops.lora_shrink(x, w.a, w.stack_num, ranks, *plan, block_m=bi.block_m, check=False,
                             a_rows=w.a_rows, max_rank=w.max_rank)
        return _ops.lora_expand(y, w.b, w.offsets, ranks, scalings, out, *plan, block_m=bi.block_m,
                                check=False, b_offs=w.b_offs, b_align=w.align, bias=w.bias, dora=w.dora)

    def run_packed_glu(self, x, weights, gate_up, act: str, *, layer_ranks=None, layer_scalings=None,
                       batch_info=None):
        """Beside the contract, for a gate/up site at prefill: ``act(gate + dg) * (up + du)`` from
        the site's base output, by the shrink then ``ops.glu_expand`` (the deltas added inside
        the activation's launch: the projection's output is read once and never written back).
        Its tiles are fastest where each holds one adapter's tokens (rows of at least
        ``ops.glu_expand.BLOCK_M`` tokens); the caller decides.

        Args:
            x: (s, input_dim).
            weights: the site's ``PackedWeights``: two modules of one width n, no LoRA bias or DoRA.
            gate_up: (s, 2n) the base output, gate's columns then up's.
            act: one of ``ops.silu_mul.ACTIVATIONS``.
            layer_ranks, layer_scalings, batch_info: as ``run_packed_lora``.
        Returns:
            (s, n), a new tensor.
        """
        bi = self._bi(batch_info)
        w = weights
        check_input("x", x, 2)
        self._check_tokens(x, bi)
        w.check(x)
        n = w.offsets[1]
        if tuple(w.offsets) != (0, n, 2 * n) or w.bias is not None or w.dora is not None:
            raise ValueError(f"run_packed_glu: a gate/up site of two modules of one width without LoRA bias or "
                             f"DoRA, got offsets {tuple(w.offsets)}"
                             + (" and a LoRA bias" if w.bias is not None else "")
                             + (" and DoRA" if w.dora is not None else ""))
        gate_up = self._checked_base_output(gate_up, x, 2 * n)
        if gate_up.dtype != x.dtype:
            raise TypeError(f"run_packed_glu: the base output is {gate_up.dtype}, the input {x.dtype}")
        ranks, scalings = self._packed_tables(bi, w, layer_ranks, layer_scalings)
        self._check_place("packed gate/up lora", bi, x, w.a, w.b, w.a_rows, w.b_offs, ranks, scalings, gate_up)
        y = _ops.lora_shrink(x, w.a, w.stack_num, ranks, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start,
                             bi.chunk_len, block_m=bi.block_m, check=False, a_rows=w.a_rows, max_rank=w.max_rank)
        return _ops.glu_expand(y, w.b, w.b_offs, ranks, scalings, bi.token_slot, gate_up, act,
                               max_rank=w.max_rank, b_align=w.align)

    def _packed_expand(self, y, weights, ranks, scalings, out, bi):
        w = weights
        self._check_place("packed lora B", bi, y, w.b, w.a_rows, w.b_offs, ranks, scalings, out)
        self._check_slots("packed lora B", bi, w.num_slots)
        return _ops.lora_expand(y, w.b, w.offsets, ranks, scalings, out, bi.sorted_token_ids, bi.chunk_slot,
                                bi.chunk_start, bi.chunk_len, block_m=bi.block_m, check=False,
                                b_offs=w.b_offs, b_align=w.align, y_cols=w.a_rows, max_rank=w.max_rank,
                                bias=w.bias, dora=w.dora)

    def _packed_embedding(self, input_ids, weights, vocab_size, ranks, scalings, out, bi):
        w = weights
        self._check_place("packed embedding A and B", bi, input_ids, w.a, w.b, w.a_rows, w.b_offs, ranks,
                          scalings, out)
        y = _ops.lora_embedding_a(input_ids, w.a, bi.token_slot, vocab_size, check=False,
                                  a_rows=w.a_rows, ranks=ranks, max_rank=w.max_rank)
        return _ops.lora_expand(y, w.b, w.offsets, ranks, scalings, out, bi.sorted_token_ids, bi.chunk_slot,
                                bi.chunk_start, bi.chunk_len, block_m=bi.block_m, check=False,
                                b_offs=w.b_offs, b_align=w.align, dora=w.dora)

    def _embedding_a(self, input_ids, weights, vocab_size, extra, bi):
        """input_ids (s,), weights (num_slots, rank, vocab) -> (s, rank); ids in neither table
        give zeros (the torch backend raises; a kernel cannot without a host sync)."""
        tensors = (input_ids, weights) + ((extra,) if extra is not None else ())
        self._check_place("embedding A", bi, *tensors)
        self._check_slots("embedding A", bi, weights.shape[0])
        if extra is not None and extra.shape[0] < weights.shape[0]:
            raise ValueError(f"extra_embeddings hold {extra.shape[0]} slots, the weights {weights.shape[0]}")
        return _ops.lora_embedding_a(input_ids, weights, bi.token_slot, vocab_size, extra, check=False)

    def _extra_token_embedding(self, input_ids, output, extra, vocab_size, bi):
        """output (s, D) gets extra[slot, id - vocab] for added tokens of adapter rows."""
        self._check_place("extra-token embedding", bi, input_ids, output, extra)
        self._check_slots("extra-token embedding", bi, extra.shape[0])
        return _ops.lora_extra_token_embedding(input_ids, output, extra, bi.token_slot, vocab_size,
                                               check=False)
