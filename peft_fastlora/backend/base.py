"""The LoRA backend contract.

Method names, parameter names, their order and tensor shapes follow SGLang's ``BaseLoRABackend``
so that a backend written for one can be read against the other. Every method takes, after the
contract's own parameters, explicit keyword-only extras (never ``*args, **kwargs``, which would
swallow a misspelled argument):

- ``batch_info``: the ``LoRABatchInfo`` to use; defaults to the one ``prepare_lora_batch`` built.
- ``layer_ranks`` ``(num_slots, c)`` int32 and ``layer_scalings`` ``(num_slots, c)`` float32: the
  rank and scaling of each slot for each of the ``c`` stacked modules of *this* layer. PEFT lets
  both vary per layer (``rank_pattern``, ``alpha_pattern``) and an adapter may skip some of
  q/k/v (rank 0: no work). When omitted, ``batch_info.lora_ranks`` / ``scalings`` apply.
- ``base_output``: the base layer's output; the delta is added into it in place and it is
  returned. When omitted a zero tensor is allocated.

Slots: the first dimension of every weight stack is the slot; ``weight_indices`` of
``prepare_lora_batch`` gives each row's slot (-1 for no adapter), ``lora_ranks[slot]`` and
``scalings[slot]`` describe the slot. A stack may be padded to a larger rank than a slot's:
only the first ``rank`` rows (A) / columns (B) of a slot are read.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ..batch import ForwardBatch, LoRABatchInfo


class BaseLoRABackend:
    """A way of computing LoRA deltas for a batch whose rows use different adapters.

    Args:
        max_loras_per_batch: most distinct adapters one forward may use.
        device: where the backend runs.
    """

    name = "base"

    def __init__(self, max_loras_per_batch: int, device: torch.device):
        self.max_loras_per_batch = max_loras_per_batch
        self.device = device
        self.batch_info: Optional[LoRABatchInfo] = None

    def run_lora_a_embedding(
        self,
        input_ids: torch.Tensor,
        weights: torch.Tensor,
        vocab_size: int,
        extra_embeddings: Optional[torch.Tensor] = None,
        *,
        batch_info: Optional[LoRABatchInfo] = None,
    ) -> torch.Tensor:
        """LoRA A of an embedding: a column lookup per token.

        Args:
            input_ids: (s,) token ids.
            weights: (num_loras, rank, vocab_size) LoRA A of the embedding.
            vocab_size: ids at or past it are read from ``extra_embeddings``.
            extra_embeddings: (num_loras, num_extra_tokens, rank), for added tokens.
        Returns:
            (s, rank); rows of tokens with no adapter are zero.
        """
        raise NotImplementedError

    def run_extra_token_embedding(
        self,
        input_ids: torch.Tensor,
        output: torch.Tensor,
        extra_embeddings: torch.Tensor,
        vocab_size: int,
        *,
        batch_info: Optional[LoRABatchInfo] = None,
    ) -> torch.Tensor:
        """Write the embedding of added tokens (ids >= vocab_size) into ``output`` in place.

        Args:
            input_ids: (s,) token ids.
            output: (s, embed_dim), modified in place for added tokens of rows with an adapter.
            extra_embeddings: (num_loras, num_extra_tokens, embed_dim).
            vocab_size: base vocabulary size.
        Returns:
            ``output``.
        """
        raise NotImplementedError

    def run_lora_a_sgemm(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        *,
        stack_num: int = 1,
        layer_ranks: Optional[torch.Tensor] = None,
        batch_info: Optional[LoRABatchInfo] = None,
    ) -> torch.Tensor:
        """Shrink: ``x @ A[slot].T`` per token.

        Args:
            x: (s, input_dim).
            weights: (num_loras, c * r, input_dim), ``c = stack_num`` modules of padded rank r
                stacked along dim 1.
        Returns:
            (s, c * r). Only the first ``rank(slot, j)`` columns of each module ``j`` of rows with
            an adapter are defined; the expand reads nothing else.
        """
        raise NotImplementedError

    def run_lora_b_sgemm(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        *,
        base_output: Optional[torch.Tensor] = None,
        layer_ranks: Optional[torch.Tensor] = None,
        layer_scalings: Optional[torch.Tensor] = None,
        batch_info: Optional[LoRABatchInfo] = None,
    ) -> torch.Tensor:
        """Expand: ``scaling * x @ B[slot].T`` per token, added into ``base_output``.

        Args:
            x: (s, r), the shrink's output.
            weights: (num_loras, output_dim, r).
        Returns:
            (s, output_dim).
        """
        raise NotImplementedError

    def run_qkv_lora(
        self,
        x: torch.Tensor,
        qkv_lora_a: torch.Tensor,
        qkv_lora_b: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        *,
        output_offset: Sequence[int],
        base_output: Optional[torch.Tensor] = None,
        layer_ranks: Optional[torch.Tensor] = None,
        layer_scalings: Optional[torch.Tensor] = None,
        batch_info: Optional[LoRABatchInfo] = None,
    ) -> torch.Tensor:
        """LoRA of a fused q/k/v projection.

        Args:
            x: (s, input_dim).
            qkv_lora_a: (num_loras, 3 * r, input_dim).
            qkv_lora_b: (num_loras, output_dim_q + 2 * output_dim_kv, r), or a tuple of
                (1, num_loras, output_dim_q, r) for q and (2, num_loras, output_dim_kv, r) for k, v.
            output_offset: the 4 column offsets of q, k, v and the end in the output
                (0, output_dim_q, output_dim_q + output_dim_kv, output_dim_q + 2 * output_dim_kv).
        Returns:
            (s, output_dim_q + 2 * output_dim_kv).
        """
        raise NotImplementedError

    def run_gate_up_lora(
        self,
        x: torch.Tensor,
        gate_up_lora_a: torch.Tensor,
        gate_up_lora_b: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        *,
        base_output: Optional[torch.Tensor] = None,
        layer_ranks: Optional[torch.Tensor] = None,
        layer_scalings: Optional[torch.Tensor] = None,
        batch_info: Optional[LoRABatchInfo] = None,
    ) -> torch.Tensor:
        """LoRA of a fused gate/up projection.

        Args:
            x: (s, input_dim).
            gate_up_lora_a: (num_loras, 2 * r, input_dim).
            gate_up_lora_b: (num_loras, 2 * output_dim, r), or a tuple of two
                (num_loras, output_dim, r).
        Returns:
            (s, 2 * output_dim).
        """
        raise NotImplementedError

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_bs: int):
        """Allocate the static batch-info buffers that captured graphs read.

        Args:
            max_bs_in_cuda_graph: largest batch a graph is captured for.
            num_tokens_per_bs: tokens per row in a graphed forward (1 for decode).
        """
        raise NotImplementedError

    def prepare_lora_batch(
        self,
        forward_batch: ForwardBatch,
        weight_indices: Sequence[int],
        lora_ranks: Sequence[int],
        scalings: Sequence[float],
        use_cuda_graph: bool,
    ) -> LoRABatchInfo:
        """Build the batch info of one forward, once for all layers.

        Args:
            forward_batch: rows and tokens of this forward.
            weight_indices: one slot per row of ``forward_batch`` (-1: no adapter).
            lora_ranks: rank of every slot, indexed by slot (not by row).
            scalings: scaling of every slot, indexed by slot.
            use_cuda_graph: refresh the static buffers of ``init_cuda_graph_batch_info`` in place
                (the captured graphs read them) instead of buffers sized for this batch.
        Returns:
            the ``LoRABatchInfo``, also kept as ``self.batch_info``.
        """
        raise NotImplementedError
