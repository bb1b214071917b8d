"""Plain-torch backend: the CPU path, and the oracle the Triton kernels are tested against.

It loops over the adapters present in the batch (a host-side list), so it is neither fast nor
safe inside CUDA graphs; it computes each slot's product in float32 and rounds once, which is what
the kernels do.
"""

from __future__ import annotations

import torch

from ..batch import LoRABatchInfo
from .segmented import SegmentedLoRABackend


class TorchNativeLoRABackend(SegmentedLoRABackend):
    name = "torch_native"

    @staticmethod
    def _rows_of(bi: LoRABatchInfo, slot: int) -> torch.Tensor:
        return torch.nonzero(bi.token_slot[: bi.num_tokens] == slot).squeeze(1)

    def _shrink(self, x, weights, stack_num, ranks, bi):
        r = weights.shape[1] // stack_num
        out = torch.zeros(x.shape[0], weights.shape[1], dtype=x.dtype, device=x.device)
        ranks_host = ranks.tolist()
        for slot in bi.slots_in_batch:
            rows = self._rows_of(bi, slot)
            xs = x[rows].float()
            for j in range(stack_num):
                rank = ranks_host[slot][j]
                if rank == 0:
                    continue
                a = weights[slot, j * r : j * r + rank].float()
                out[rows, j * r : j * r + rank] = (xs @ a.T).to(x.dtype)
        return out

    def _expand(self, x, weights, offsets, ranks, scalings, out, bi):
        r = weights.shape[2]
        ranks_host, scal_host = ranks.tolist(), scalings.tolist()
        for slot in bi.slots_in_batch:
            rows = self._rows_of(bi, slot)
            for j in range(len(offsets) - 1):
                rank = ranks_host[slot][j]
                lo, hi = offsets[j], offsets[j + 1]
                if rank == 0 or hi == lo:
                    continue
                xs = x[rows, j * r : j * r + rank].float()
                b = weights[slot, lo:hi, :rank].float()
                delta = (xs @ b.T) * scal_host[slot][j]
                out[rows, lo:hi] = (out[rows, lo:hi].float() + delta).to(out.dtype)
        return out

    def _packed_blocks(self, weights, ranks, scalings, bi):
        """(token rows, module j, its columns lo:hi, rank, A row, B offset, scaling) of every
        (slot in the batch, module) with a block."""
        ranks_host, scal_host = ranks.tolist(), scalings.tolist()
        a_rows, b_offs = weights.a_rows.tolist(), weights.b_offs.tolist()
        for slot in bi.slots_in_batch:
            rows = self._rows_of(bi, slot)
            for j in range(weights.stack_num):
                rank = ranks_host[slot][j]
                lo, hi = weights.offsets[j], weights.offsets[j + 1]
                if rank and hi > lo:
                    yield rows, j, lo, hi, rank, a_rows[slot][j], b_offs[slot][j], scal_host[slot][j]

    @staticmethod
    def _add_expand(out, rows, lo, hi, y, b, scaling, weights=None, slots=None):
        """out[rows, lo:hi] += scaling * (y @ b.T + bias), then DoRA's ``* scale + shift``, in
        float32, rounded once (``weights``' bias and DoRA tables, read at the rows' ``slots``)."""
        delta = y @ b.float().T
        slots = None if slots is None else slots.long()
        if weights is not None and weights.bias is not None:
            delta = delta + weights.bias[slots, lo:hi].float()
        res = out[rows, lo:hi].float() + delta * scaling
        if weights is not None and weights.dora is not None:
            res = res * weights.dora[0][slots, lo:hi] + weights.dora[1][slots, lo:hi]
        out[rows, lo:hi] = res.to(out.dtype)

    def _packed(self, x, weights, ranks, scalings, out, bi):
        for rows, j, lo, hi, rank, a_row, b_off, scaling in self._packed_blocks(weights, ranks, scalings, bi):
            # rounded to the input dtype between the two products, as the kernels' shrink output is
            y = (x[rows].float() @ weights.a_view(a_row, rank).float().T).to(x.dtype).float()
            self._add_expand(out, rows, lo, hi, y, weights.b_view(b_off, j, rank), scaling, weights,
                             bi.token_slot[rows])
        return out

    def _packed_expand(self, y, weights, ranks, scalings, out, bi):
        for rows, j, lo, hi, rank, a_row, b_off, scaling in self._packed_blocks(weights, ranks, scalings, bi):
            ys = y[rows, a_row: a_row + rank].float()  # this module's A rows are these columns of y
            self._add_expand(out, rows, lo, hi, ys, weights.b_view(b_off, j, rank), scaling, weights,
                             bi.token_slot[rows])
        return out

    def _packed_embedding(self, input_ids, weights, vocab_size, ranks, scalings, out, bi):
        ranks_host, scal_host = ranks.tolist(), scalings.tolist()
        a_rows, b_offs = weights.a_rows.tolist(), weights.b_offs.tolist()
        for slot in bi.slots_in_batch:
            rank = ranks_host[slot][0]
            if rank == 0:
                continue
            rows = self._rows_of(bi, slot)
            ids = input_ids[rows].long()
            a = weights.a_view(a_rows[slot][0], rank)
            # added tokens get no delta here (as the kernel: their lookup in A is zeros)
            y = torch.where((ids < vocab_size)[:, None], a[:, ids.clamp(max=vocab_size - 1)].T.float(), 0.0)
            res = out[rows].float() + (y @ weights.b_view(b_offs[slot][0], 0, rank).float().T) * scal_host[slot][0]
            if weights.dora is not None:
                res = res * weights.dora[0][slot] + weights.dora[1][slot]
            out[rows] = res.to(out.dtype)
        return out

    def _embedding_a(self, input_ids, weights, vocab_size, extra, bi):
        rank = weights.shape[1]
        out = torch.zeros(input_ids.shape[0], rank, dtype=weights.dtype, device=weights.device)
        for slot in bi.slots_in_batch:
            rows = self._rows_of(bi, slot)
            ids = input_ids[rows].long()
            base = ids < vocab_size
            out[rows[base]] = weights[slot][:, ids[base]].T
            if (~base).any():
                if extra is None:
                    raise ValueError(
                        f"token id {int(ids[~base][0])} >= vocab_size {vocab_size} and no extra_embeddings")
                out[rows[~base]] = extra[slot][ids[~base] - vocab_size]
        return out

    def _extra_token_embedding(self, input_ids, output, extra, vocab_size, bi):
        for slot in bi.slots_in_batch:
            rows = self._rows_of(bi, slot)
            ids = input_ids[rows].long()
            added = ids >= vocab_size
            output[rows[added]] = extra[slot][ids[added] - vocab_size]
        return output
