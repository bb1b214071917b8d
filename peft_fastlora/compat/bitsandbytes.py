"""bitsandbytes' 8-bit sibling layers (q/k/v, gate/up) computed by one matmul.

``Linear8bitLt`` quantizes its weight row by row: each output row is int8 values and one scale.
The rows of siblings laid one after the other are therefore, exactly, the 8-bit weight of the
stacked layer, and one ``bnb.matmul`` over them quantizes the shared input once, runs one int8
GEMM and one dequantization (and, with an outlier threshold, one outlier search) where the
siblings ran one of each. Each layer's int8 rows and scales become views of the joined tensors:
no second copy, and the layer's own forward still works. A single layer is held the same way (a
join of one) where fastlora dequantizes its product itself.

Without an outlier threshold the matmul's steps are also available apart (``JoinedInt8.quantize``
and ``int8_gemm``: bitsandbytes' quantization of the input and its int8 GEMM), so that
``ops.int8_dequant`` can dequantize the int32 product and add the LoRA deltas in one pass. Only
bitsandbytes' names are read here.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn


def is_int8_linear(module: nn.Module) -> bool:
    """bitsandbytes' ``Linear8bitLt`` (what transformers' ``load_in_8bit`` makes)."""
    cls = type(module)
    return cls.__name__ == "Linear8bitLt" and cls.__module__.startswith("bitsandbytes")


def _int8_parts(layer: nn.Module) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(int8 rows (out, in), their scales (out,)) as the layer's matmul reads them: its state's
    after its first forward, its weight's before; None where it holds neither."""
    state = layer.state
    rows = state.CB if state.CB is not None else getattr(layer.weight, "CB", None)
    scales = state.SCB if state.SCB is not None else getattr(layer.weight, "SCB", None)
    return None if rows is None or scales is None else (rows, scales)


def outlier_threshold(layer: nn.Module) -> float:
    """An 8-bit layer's outlier threshold (0.0: none, every column quantized)."""
    return float(layer.state.threshold or 0.0)


def int8_join_blocker(layers: Sequence[nn.Module]) -> Optional[str]:
    """Why these sibling layers cannot share one 8-bit matmul (None: they can)."""
    if not all(is_int8_linear(m) for m in layers):
        return "not all bitsandbytes 8-bit layers"
    if any(m.state.has_fp16_weights for m in layers):
        return "8-bit layers that keep 16-bit weights (has_fp16_weights)"
    if any(m.bias is not None for m in layers):
        return "a base layer has a bias"
    if len({outlier_threshold(m) for m in layers}) != 1:
        return "different outlier thresholds"
    parts = [_int8_parts(m) for m in layers]
    if any(p is None for p in parts):
        return "a weight not quantized yet"
    first = parts[0][0]
    for rows, scales in parts:
        if (rows.dtype != torch.int8 or rows.dim() != 2 or rows.shape[1] != first.shape[1]
                or rows.device != first.device or scales.shape != (rows.shape[0],) or scales.device != first.device):
            return "8-bit weights of different widths, layouts or devices"
    if first.device.type == "meta":
        return "weights on the meta device"
    return None


class JoinedInt8:
    """The int8 rows and scales of sibling ``Linear8bitLt`` layers as one, and the matmul over
    them. Build only where ``int8_join_blocker`` is None; ``release`` gives each layer its own
    storage again."""

    def __init__(self, layers: Sequence[nn.Module]):
        import bitsandbytes as bnb  # (an optional dependency: only a model it quantized gets here)

        self._bnb = bnb
        self.layers = list(layers)
        parts = [_int8_parts(m) for m in self.layers]
        self.offsets: List[int] = [0]
        for rows, _ in parts:
            self.offsets.append(self.offsets[-1] + rows.shape[0])
        with torch.no_grad():
            self.rows = torch.cat([rows for rows, _ in parts])
            self.scales = torch.cat([scales for _, scales in parts])
        self.state = bnb.MatmulLtState()
        self.state.CB, self.state.SCB = self.rows, self.scales
        self.state.threshold = outlier_threshold(self.layers[0])
        self.state.has_fp16_weights = False
        self._repoint([(self.rows[lo:hi], self.scales[lo:hi]) for lo, hi in self._spans()])
        self._addresses = self._current_addresses()

    def _spans(self):
        return zip(self.offsets[:-1], self.offsets[1:])

    def _repoint(self, parts) -> None:
        # as the layer's first forward leaves it (``init_8bit_state``): rows and scales in its
        # state, its weight's data the same rows
        for layer, (rows, scales) in zip(self.layers, parts):
            layer.state.CB, layer.state.SCB = rows, scales
            layer.weight.data = rows
            layer.weight.CB = layer.weight.SCB = None

    def _current_addresses(self) -> list:
        return [(m.state.CB.data_ptr() if m.state.CB is not None else None,
                 m.state.SCB.data_ptr() if m.state.SCB is not None else None) for m in self.layers]

    def intact(self) -> bool:
        """Every layer still reads its rows of the joined tensors (a reload or ``model.to`` moves them)."""
        return self._current_addresses() == self._addresses

    @property
    def threshold(self) -> float:
        return self.state.threshold

    def quantize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(int8 rows, each row's scale): bitsandbytes' quantization of an input of rows (M, in),
        cast to fp16 first as its matmul does. Only without an outlier threshold (where there is
        one, the outlier columns are computed apart)."""
        if self.state.threshold != 0.0:
            raise RuntimeError("JoinedInt8.quantize: layers with an outlier threshold split outlier columns out")
        quantized, row_scales, _ = self._bnb.functional.int8_vectorwise_quant(x.to(torch.float16), threshold=0.0)
        return quantized, row_scales

    def int8_gemm(self, quantized: torch.Tensor) -> torch.Tensor:
        """The int32 product (rows, sum of output widths) of quantized input rows and the joined rows."""
        return self._bnb.functional.int8_linear_matmul(quantized, self.rows)

    def product(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the int32 product (rows, sum of output widths), each input row's scale): what the
        matmul computes before its dequantization, for an input of rows (M, in)."""
        quantized, row_scales = self.quantize(x)
        return self.int8_gemm(quantized), row_scales

    def dequantize(self, product: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """bitsandbytes' own dequantization of ``product`` into ``dtype``, as its matmul asks for it
        (its CUDA kernel rounds to fp16 on the way; its CPU one does not)."""
        return torch.ops.bitsandbytes.int8_mm_dequant.default(product, row_scales, self.scales, dtype=dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Every sibling's output side by side: (..., sum of their output widths)."""
        self.state.is_training = False  # (bitsandbytes' inference path)
        return self._bnb.matmul(x, self.rows, state=self.state)

    @torch.no_grad()
    def release(self) -> None:
        """Each layer its own rows and scales again (fresh storages, the same values)."""
        if self.intact():
            self._repoint([(self.rows[lo:hi].clone(), self.scales[lo:hi].clone()) for lo, hi in self._spans()])
        self.rows = self.scales = self.state = None
