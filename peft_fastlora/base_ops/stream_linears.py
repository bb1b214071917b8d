"""Decode-sized GEMMs of the base model through fastlora's weight-streaming kernel
(``ops.stream_gemm``) instead of cuBLAS, on Hopper.

A decode step's GEMM of a few rows reads its weight once; cuBLAS takes these shapes with few tiles
along the output and, for some, a split-K reduction in a second kernel, and each GEMM waits for the
kernel before it to drain. The streaming kernel covers every SM from the start and, launched with
programmatic dependent launch, runs its preamble while the kernel before it finishes (both
measured per shape and batch against cuBLAS on an H200).

``StreamLinears.linear`` is ``F.linear`` that takes the kernel where it applies (the limits are
``Tuning``'s ``stream_*`` fields): bf16 / fp16 inputs of at most ``stream_max_rows`` rows with no
gradient, on the model's device, output widths between ``stream_min_n`` and ``stream_max_n`` (the LM
head is already at the bandwidth under cuBLAS), reductions of at least ``stream_min_k`` that the
16-byte loads can take. Layers narrower than ``stream_narrow_n`` (a 1B model's q/k/v, o and down)
give too few column blocks to cover the SMs, so they split K into ranges and stream up to
``stream_narrow_max_rows`` rows only (past it cuBLAS measured as fast). Everything
else, float32 included, is ``F.linear``. It is installed only on CUDA devices of compute
capability 9 (``supported_device``: the tiles were chosen on an H200).

Two kinds of callers: the fused groups (``FusedGroup.gemm``: q/k/v, gate/up, a folded site's
``[W; A]``) and the model's other plain ``nn.Linear`` layers (o_proj, down_proj, the base layers
of their LoRA layers), which get it as an instance forward (``StreamLinears.install``).

A decoder layer's residual add after its MLP can ride in down_proj's GEMM (``fold_residuals``):
the layer names the residual and down's weight before calling the MLP (``expect_add``); the
kernel's epilogue adds it where that weight's GEMM takes the kernel, and the layer adds it itself
where it did not (``took_add``). Only where everything after down's base GEMM adds to its output:
a plain down_proj, or a LoRA layer with plain LoRA adapters (PEFT's and fastlora's paths both add
the delta to the base output; DoRA and other variants rescale it, so they keep the separate add).

A gated MLP whose gate/up pair is a plain fused group (no LoRA on either) takes ``act(gate) * up``
from one GEMM over the fused weight (``gated``, the kernel's ``glu`` epilogue) where it applies.
One whose gate/up pair is a folded LoRA site does at 65-128 rows, where the gated tile applies,
through ``ops.glu_lora`` (``gated_lora``): the site's shrink, gate/up, the rows' deltas and the
act-mul in one launch, in place of the folded GEMM, the expand and the act-mul.

Past ``stream_max_rows`` (a batch of 65-128 rows) the arithmetic is no longer small beside the
weight's bytes and the streaming kernel loses to cuBLAS; there the TMA-fed tensor-core kernel
(``ops.tma_gemm``) takes the layers of at least ``stream_narrow_n`` outputs whose shape class
(``shape_class``) has a tile in ``TMA_TILES``, a table measured on an H200 holding only the classes where the
kernel's best tile beat cuBLAS, each with the shallowest reduction it was measured on (shallower
ones, say a 1B model's, keep cuBLAS); the others keep cuBLAS. The residual and gated-activation
epilogues ride there too.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.modules import has_forward_hooks, is_dtensor, is_plain_weight
from ..compat.peft import base_layer_of, is_lora_layer
from ..instance_methods import InstancePatches
from ..lora.fusion import FUSIBLE_GROUPS
from .mlp_forwards import has_gated_forward
from ..ops.glu_lora import glu_lora
from ..ops.stream_gemm import stream_gemm, StreamConfig, StreamWorkspace
from ..ops.tma_gemm import MAX_ROWS as TMA_ROWS, tma_aligned, tma_gemm, TmaConfig
from ..tuning import Tuning

TMA_TILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tma_tiles_h200.json")
# A folded deep layer ([W; A] of a LoRA down_proj) at 65-128 rows whose residual add rides along: the TMA
# kernel's best deep tile in the H200 measurements behind TMA_TILES, at reductions as deep as it was
# measured on. Alone it is a little slower than cuBLAS (so the table leaves the class out), but behind
# cuBLAS the residual add reads the base columns of the wider output, a strided view, in a kernel of its
# own (``Tuning.tma_add_tiles``). A plain down keeps cuBLAS and the vectorised add (faster there).
_hopper: Dict[int, bool] = {}
# the members of fusible groups reach the kernel through their group's GEMM, not a forward of their own
_GROUP_MEMBERS = frozenset(n for names in FUSIBLE_GROUPS.values() for n in names)


def supported_device(device: torch.device) -> bool:
    """A CUDA device of compute capability 9 (Hopper: the tiles were chosen there)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper:
        _hopper[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _hopper[index]


def _config(m: int, n: int, k: int, narrow_n: int):
    """The tile for ``m`` rows of an (n, k) weight: the best measured on an H200 after a norm at 8B
    Llama's shapes (wide gate/up; q/k/v wider than deep; square o and deep down, which past a few
    rows stream best in two K ranges), and at 1B Llama's for layers narrower than ``narrow_n``
    (q/k/v in one range up to 16 rows, then two; o and down in four)."""
    if n < narrow_n:
        if n > k:
            return StreamConfig(block_n=64, block_k=128, split_k=1 if m <= 16 else 2, num_warps=4,
                                num_stages=8 if m <= 16 else 6)
        return StreamConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=6)
    if n >= 16384:
        return StreamConfig(block_n=128, block_k=128, num_warps=8, num_stages=4)
    if n > k:
        return StreamConfig(block_n=64, block_k=128, num_warps=4, num_stages=6)
    if m <= 8 or (n == k and m > 32):
        return StreamConfig(block_n=64, block_k=128, num_warps=4, num_stages=8)
    return StreamConfig(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=6, preload=True)


def shape_class(n: int, k: int) -> str:
    """An (n, k) weight's class for the TMA tiles, by outputs over inputs: ``deep`` (down_proj),
    ``square`` (o_proj), ``tall`` (fused q/k/v), ``wide`` (fused gate/up); folding adapters' A under
    a weight keeps its class."""
    ratio = n / k
    return "deep" if ratio < 0.6 else "square" if ratio < 1.25 else "tall" if ratio < 3 else "wide"


class TmaTile(NamedTuple):
    config: TmaConfig
    min_k: int = 0  # the shallowest reduction the tile was measured on: shallower ones keep cuBLAS


def tma_tiles(path: Optional[str] = None) -> Dict[str, TmaTile]:
    """The TMA kernel's tile per shape class (and ``glu`` for the gated gate/up GEMM) from the table
    at ``path`` (``TMA_TILES``); a class the table lacks keeps cuBLAS, and so does every class
    without the file."""

    path = path or TMA_TILES
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        classes = json.load(f).get("classes", {})
    return {name: TmaTile(TmaConfig(**{k: fields[k] for k in TmaConfig._fields}), fields.get("min_k", 0))
            for name, fields in classes.items()}


def _dense_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` with its rows packed where they are spread out in memory and few beside ``weight``'s:
    the LM head reads each sequence's last token as a strided slice of the hidden states, and for a
    row stride that large cuBLAS picks a kernel that reads the weight several times over; the copy
    costs a few rows' bytes."""
    if x.dim() < 2 or x.is_contiguous() or x.numel() >= weight.numel():
        return x
    return x.contiguous()


class StreamLinears:
    """One model's decode GEMMs through the kernel: ``linear`` for its fused groups and the instance
    forwards of its other plain ``nn.Linear`` layers, and the split-K workspace they share (the
    model's forwards run one at a time, so its launches never overlap)."""

    def __init__(self, device: torch.device, tuning: Optional[Tuning] = None):
        self.tuning = t = tuning if tuning is not None else Tuning()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compared with tensors' devices, which have one
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # a zero-argument test the owner sets: True where this forward keeps cuBLAS
        self.skip: Optional[Callable[[], bool]] = None
        self.tma_tiles = tma_tiles() if t.tma_tiles is None else {
            name: TmaTile(TmaConfig(**{k: v for k, v in fields.items() if k != "min_k"}), fields.get("min_k", 0))
            for name, fields in t.tma_tiles.items()}
        self.add_tiles = {name: TmaTile(TmaConfig(**fields), min_k)
                          for name, (fields, min_k) in t.tma_add_tiles.items()}
        tiles = list(self.tma_tiles.values()) + list(self.add_tiles.values())
        tma_split = max([t.config.split_k for t in tiles], default=1)
        tma_block_n = min([t.config.block_n for t in tiles], default=64)
        # the partials of the largest split launch (two K ranges of the most rows of the widest layer
        # that splits, four of a narrow layer's, or the TMA tiles' ranges of their rows), a ticket per
        # column tile
        self.workspace = StreamWorkspace(
            device, max(2 * t.stream_max_rows * t.stream_split_max_n, 4 * t.stream_narrow_max_rows * t.stream_narrow_n,
                        tma_split * TMA_ROWS * t.stream_split_max_n),
            t.stream_split_max_n // min(64, tma_block_n))
        self._tma_rows = TMA_ROWS
        self.modules: List[Tuple[str, nn.Module]] = []
        self._streamed: set = set()  # ids of the modules with the instance forward
        self._folding: List[nn.Module] = []  # decoder layers told to fold their residual add
        self.residual_layers = 0  # how many (the patch report's)
        # the residual a decoder layer is folding: (down weight's address, residual, taken), per thread
        # (a forward on another thread, say the continuous-batching engine's, never takes this one's)
        self._pending = threading.local()

    def _tma_tile(self, rows: int, n: int, k: int, glu: bool = False, weight: Optional[torch.Tensor] = None):
        """The TMA kernel's tile for ``rows`` rows of an (n, k) weight, or None (module doc); a folded
        deep ``weight`` whose residual add is pending takes ``Tuning.tma_add_tiles``' where the table
        has none."""
        if rows <= self.tuning.stream_max_rows or rows > self._tma_rows or n < self.tuning.stream_narrow_n:
            return None
        cls = "glu" if glu else shape_class(n, k)
        tile = self.tma_tiles.get(cls)
        if tile is None and weight is not None and self._add_pending(weight):
            tile = self.add_tiles.get(cls)
        return tile.config if tile is not None and k >= tile.min_k else None

    def _add_pending(self, weight: torch.Tensor) -> bool:
        """A residual add is pending for ``weight`` and covers fewer columns than it has (folded)."""
        pending = getattr(self._pending, "add", None)
        return (pending is not None and pending[0] == weight.data_ptr() and pending[1].dim() > 0
                and pending[1].shape[-1] < weight.shape[0])

    def _rows(self, x, weight, bias, glu: bool = False) -> int:
        """The rows of ``x`` where ``x @ weight.T`` takes one of the kernels (module doc), else 0."""
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        rows = x.numel() // k if k and x.dim() and x.shape[-1] == k else 0
        t = self.tuning
        max_rows = t.stream_max_rows if n >= t.stream_narrow_n else t.stream_narrow_max_rows
        if rows > max_rows and self._tma_tile(rows, n, k, glu, weight) is not None:
            max_rows = self._tma_rows
        if (rows > max_rows or rows == 0 or not t.stream_min_n <= n <= t.stream_max_n or k < t.stream_min_k or k % 8
                or x.dtype not in t.stream_dtypes
                or weight.dtype != x.dtype or (bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1))
                or weight.stride(1) != 1 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                or x.device != self.device or weight.device != self.device or (self.skip is not None and self.skip())):
            return 0
        return rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, through the streaming kernel where it applies (module doc)."""
        rows = self._rows(x, weight, bias)
        if not rows:
            return F.linear(_dense_rows(x, weight), weight, bias)

        n, k = weight.shape
        x2 = x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        tile = self._tma_tile(rows, n, k, weight=weight)
        if tile is not None and not (tma_aligned(x2) and tma_aligned(weight)):
            return F.linear(x, weight, bias)  # a descriptor cannot address it
        config = tile or _config(rows, n, k, self.tuning.stream_narrow_n)
        if config.split_k > 1 and n > self.tuning.stream_split_max_n:
            config = config._replace(split_k=1)
        add = self._take_add(weight, rows, n, x.dtype)
        gemm = stream_gemm if tile is None else tma_gemm
        out = gemm(x2, weight, bias, config=config, workspace=self.workspace, check=False, add=add)
        return out.view(*x.shape[:-1], n)

    def gated(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str
              ) -> Optional[torch.Tensor]:
        """``act(gate) * up`` for a fused [gate; up] ``weight`` in one kernel GEMM, or None where the
        kernel does not take it (the caller runs its own GEMM and activation)."""
        rows = self._rows(x, weight, bias, glu=True)
        if not rows or weight.shape[0] % 2:
            return None

        n, k = weight.shape[0] // 2, weight.shape[1]
        x2 = x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        tile = self._tma_tile(rows, 2 * n, k, glu=True)
        if tile is not None:
            if not (tma_aligned(x2) and tma_aligned(weight)):
                return None
            out = tma_gemm(x2, weight, bias, config=tile._replace(split_k=1), check=False, glu=act)
            return out.view(*x.shape[:-1], n)
        # half-width tiles, gate's and up's: the best measured with the gated epilogue at 1-64 rows
        config = StreamConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
        out = stream_gemm(x2, weight, bias, config=config, check=False, glu=act)
        return out.view(*x.shape[:-1], n)

    def gated_lora(self, x: torch.Tensor, weight: torch.Tensor, n: int, act: str, lora) -> Optional[torch.Tensor]:
        """``gated`` for a folded LoRA gate/up site: ``weight`` is ``[gate; up; A arena]`` (n rows
        each, then the arena) and ``lora`` its ``ops.glu_lora.GluLora`` (checked once per scratch by
        the caller's ``check``). ``act(gate + dg) * (up + du)`` in one launch at 65-128 rows where
        the gated tile applies; None elsewhere (the caller takes its folded GEMM and expand)."""
        rows = self._rows(x, weight[: 2 * n], None, glu=True)
        k = weight.shape[1]
        tile = self._tma_tile(rows, 2 * n, k, glu=True) if rows else None
        if tile is None:
            return None

        x2 = x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if not (tma_aligned(x2) and tma_aligned(weight)):
            return None
        return glu_lora(x2, weight, n, lora, act, tile, check=False).view(*x.shape[:-1], n)

    # -- the residual add in down_proj's GEMM ----------------------------------------------------
    def expect_add(self, weight: torch.Tensor, residual: torch.Tensor) -> None:
        """The next GEMM over ``weight`` (its address: a folded ``[W; A]`` starts with W) that takes
        the kernel adds ``residual`` to its first columns."""
        self._pending.add, self._pending.added = (weight.data_ptr(), residual), False

    def took_add(self) -> bool:
        """Whether a GEMM added the residual since ``expect_add``; forgets it either way."""
        took = getattr(self._pending, "added", False)
        self._pending.add, self._pending.added = None, False
        return took

    def _take_add(self, weight, rows, n, dtype) -> Optional[torch.Tensor]:
        pending = getattr(self._pending, "add", None)
        if pending is None or pending[0] != weight.data_ptr():
            return None
        residual = pending[1]
        width = residual.shape[-1] if residual.dim() else 0
        if residual.dtype != dtype or residual.device != self.device or width > n or residual.numel() != rows * width:
            return None
        self._pending.add, self._pending.added = None, True
        add = residual.reshape(rows, width)
        return add if add.stride(1) == 1 else add.contiguous()

    def residual_target(self, layer: nn.Module) -> Optional[torch.Tensor]:
        """down_proj's base weight where ``layer``'s MLP may fold the residual (module doc), else None."""
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not has_gated_forward(mlp):
            return None
        down = getattr(mlp, "down_proj", None)
        if is_lora_layer(down):
            if any(getattr(down, "use_dora", {}).values()) or getattr(down, "lora_variant", None):
                return None
            down = base_layer_of(down)
        if id(down) not in self._streamed or "forward" not in down.__dict__:
            return None
        return down.weight

    def fold_residuals(self, layers: List[Tuple[str, nn.Module]]) -> None:
        """Let these decoder layers (Llama-family fast forwards) fold their MLP's residual add."""
        for _, layer in layers:
            layer._fastlora_stream = self
            self._folding.append(layer)
            self.residual_layers += 1

    def remove(self) -> None:
        for m in self._folding:
            m.__dict__.pop("_fastlora_stream", None)
        self._folding, self.residual_layers = [], 0

    def install(self, root: nn.Module, patches: InstancePatches) -> List[Tuple[str, nn.Module]]:
        """Give ``linear`` as an instance forward to every plain ``nn.Linear`` under ``root`` that is
        not a member of a fusible group (nor the base layer of one: those reach it through their
        group's GEMM), not an adapter's own (PEFT's ``lora_A`` / ``lora_B``), and has no forward or
        hooks of its own. Returns the modules changed."""
        linear = self.linear

        def forward(module, x):
            return linear(x, module.weight, module.bias)

        adapters_own = set()  # PEFT's lora_A / lora_B layers: the adapters' weights, not the model's
        for layer in root.modules():
            if is_lora_layer(layer):
                base = base_layer_of(layer)
                adapters_own |= {id(sub) for sub in layer.modules() if sub is not layer and sub is not base}
        for name, m in root.named_modules():
            if (type(m) is not nn.Linear or id(m) in adapters_own or "forward" in m.__dict__
                    or has_forward_hooks(m) or is_dtensor(m.weight) or not is_plain_weight(m.weight)):
                continue
            parts = name.split(".")
            own = parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]
            if own in _GROUP_MEMBERS:
                continue
            patches.bind(m, "forward", forward)
            self.modules.append((name, m))
            self._streamed.add(id(m))
        return self.modules
