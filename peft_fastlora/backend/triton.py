"""Triton backend: the segmented shrink / expand / embedding kernels of ``peft_fastlora.ops``.

Every launch is sized from the batch info's fixed ``max_chunks`` and reads ranks, scalings and
slots on the device, so a call never syncs with the host and can be captured in a CUDA graph.
The registry imports this module only when the backend is asked for; Triton is imported here.
"""

from __future__ import annotations

import torch

from ..batch import LoRABatchInfo
from .segmented import SUPPORTED_DTYPES, SegmentedLoRABackend

try:
    from .. import ops as _ops
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "the 'triton' LoRA backend needs the triton package (pip install triton, Linux x86_64); "
        "use backend 'torch_native' instead") from e


class TritonLoRABackend(SegmentedLoRABackend):
    name = "triton"

    # ---- checks the shared layer does not make ---------------------------------------------
    def _check_place(self, what: str, bi: LoRABatchInfo, *tensors: torch.Tensor):
        dev = tensors[0].device
        if dev.type != "cuda" and not _ops.interpreting():
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
    def _check_float(name: str, t: torch.Tensor):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"triton backend: {name} must be one of {SUPPORTED_DTYPES}, got {t.dtype}")

    @staticmethod
    def _check_slots(what: str, bi: LoRABatchInfo, num_slots: int):
        # host-side list, no sync; the kernels also skip such slots rather than read past the end
        if bi.slots_in_batch and max(bi.slots_in_batch) >= num_slots:
            raise ValueError(
                f"triton backend: {what}: the batch uses slot {max(bi.slots_in_batch)} but the "
                f"weights hold {num_slots} slots")

    @staticmethod
    def _check_table(name: str, t: torch.Tensor, dtype: torch.dtype):
        if t.dtype != dtype or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"triton backend: {name} must be a 2-D {dtype} table with unit "
                             f"column stride, got {tuple(t.shape)} {t.dtype}")

    # ---- primitives --------------------------------------------------------------------------
    def _shrink(self, x, weights, stack_num, ranks, bi):
        """x (s, K), weights (num_slots, c*R, K), ranks (num_slots, c) -> (s, c*R)."""
        self._check_float("x", x)
        self._check_table("layer_ranks", ranks, torch.int32)
        self._check_place("lora A", bi, x, weights, ranks)
        self._check_slots("lora A", bi, weights.shape[0])
        return _ops.lora_shrink(
            x, weights, stack_num, ranks,
            bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
            block_m=bi.block_m)

    def _expand(self, x, weights, offsets, ranks, scalings, out, bi):
        """x (s, c*R), weights (num_slots, N_total, R), out (s, N_total) updated in place."""
        self._check_float("x", x)
        self._check_float("base_output", out)
        self._check_table("layer_ranks", ranks, torch.int32)
        self._check_table("layer_scalings", scalings, torch.float32)
        self._check_place("lora B", bi, x, weights, ranks, scalings, out)
        self._check_slots("lora B", bi, weights.shape[0])
        return _ops.lora_expand(
            x, weights, offsets, ranks, scalings, out,
            bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
            block_m=bi.block_m)

    def _embedding_a(self, input_ids, weights, vocab_size, extra, bi):
        """input_ids (s,), weights (num_slots, rank, vocab) -> (s, rank); ids in neither table
        give zeros (the torch backend raises; a kernel cannot without a host sync)."""
        self._check_float("weights", weights)
        tensors = (input_ids, weights) + ((extra,) if extra is not None else ())
        self._check_place("embedding A", bi, *tensors)
        self._check_slots("embedding A", bi, weights.shape[0])
        if extra is not None and extra.shape[0] < weights.shape[0]:
            raise ValueError(f"extra_embeddings hold {extra.shape[0]} slots, the weights {weights.shape[0]}")
        return _ops.lora_embedding_a(input_ids, weights, bi.token_slot, vocab_size, extra)

    def _extra_token_embedding(self, input_ids, output, extra, vocab_size, bi):
        """output (s, D) gets extra[slot, id - vocab] for added tokens of adapter rows."""
        self._check_float("output", output)
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"input_ids must be int32 or int64, got {input_ids.dtype}")
        self._check_place("extra-token embedding", bi, input_ids, output, extra)
        self._check_slots("extra-token embedding", bi, extra.shape[0])
        return _ops.lora_extra_token_embedding(input_ids, output, extra, bi.token_slot, vocab_size)
