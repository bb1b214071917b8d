"""The batch description the backends read.

SGLang's backends take a ``ForwardBatch`` from its scheduler; fastlora has no scheduler, so
``ForwardBatch`` here is the small part of it a LoRA backend needs: how many rows, how many
tokens each row brings to this forward, and whether it is a one-token decode step.

``LoRABatchInfo`` is what the kernels read. Rows are grouped by adapter slot and cut into
chunks of at most ``block_m`` tokens, each chunk owned by one slot, so a tensor-core tile is
never shared by two adapters and a decode step reads each used adapter's weights once per
chunk instead of once per row. Rows with no adapter (slot -1) are in no chunk and cost nothing.
"""

from __future__ import annotations

import enum
import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

NO_ADAPTER = -1
# the graphed context of a model without LoRA layers: no batch info to read, but the layers and
# base-model kernels still see that they are being captured
NO_LORA_BATCH = object()


class ForwardMode(enum.Enum):
    DECODE = "decode"  # one new token per row
    EXTEND = "extend"  # prefill / several tokens per row


@dataclass
class ForwardBatch:
    """What one model forward feeds the LoRA layers.

    Attributes:
        batch_size: number of rows (sequences).
        seq_lens: tokens each row brings to this forward, length ``batch_size``. HF pads rows to
            one length, so these are usually all equal; the backends accept any lengths.
        forward_mode: DECODE when every row brings exactly one token.
        device: where the tokens live.
    """

    batch_size: int
    seq_lens: Sequence[int]
    forward_mode: ForwardMode
    device: torch.device

    @classmethod
    def from_shape(cls, batch_size: int, tokens_per_row: int, device) -> "ForwardBatch":
        mode = ForwardMode.DECODE if tokens_per_row == 1 else ForwardMode.EXTEND
        return cls(batch_size, [tokens_per_row] * batch_size, mode, torch.device(device))

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))


@dataclass(eq=False)
class TokenSegments:
    """A forward whose one row holds many sequences end to end (continuous batching): the
    adapter and token count of each, in order, and the forward's token count (the engine may pad
    the tail; padded tokens belong to no adapter).

    Attributes:
        names: adapter name of each sequence (``"__base__"``: none).
        seg_lens: tokens each sequence brings to this forward.
        num_tokens: tokens of the forward, ``>= sum(seg_lens)``.
    """

    names: Sequence[str]
    seg_lens: Sequence[int]
    num_tokens: int

    def __post_init__(self):
        if len(self.names) != len(self.seg_lens):
            raise ValueError(f"{len(self.names)} adapter names for {len(self.seg_lens)} sequences")
        if sum(self.seg_lens) > self.num_tokens:
            raise ValueError(f"sequences of {sum(self.seg_lens)} tokens in a forward of {self.num_tokens}")
        self._token_names = None

    @property
    def padding(self) -> int:
        return self.num_tokens - int(sum(self.seg_lens))

    def forward_batch(self, slots: Sequence[int], device) -> tuple:
        """``(ForwardBatch, weight_indices)`` for ``prepare_lora_batch``; the padded tail is one
        more segment with no adapter."""
        lens, slots = list(self.seg_lens), list(slots)
        if self.padding:
            lens.append(self.padding)
            slots.append(NO_ADAPTER)
        mode = ForwardMode.DECODE if min(lens, default=1) == 1 == max(lens, default=1) else ForwardMode.EXTEND
        return ForwardBatch(len(lens), lens, mode, torch.device(device)), slots

    def token_names(self) -> list:
        """One adapter name per token (PEFT's per-row path, given one row per token)."""
        if self._token_names is None:
            names = []
            for name, n in zip(self.names, self.seg_lens):
                names.extend([name] * n)
            self._token_names = names + ["__base__"] * self.padding
        return self._token_names


@dataclass
class LoRABatchInfo:
    """Per-forward batch description, on the device.

    Token index ``t`` below is the row-major index into the flattened ``(s, hidden)`` input,
    rows laid end to end in order (row ``i`` owns tokens ``seg_indptr[i]:seg_indptr[i+1]``).

    Attributes:
        bs: number of rows.
        num_tokens: s, the tokens of this forward (under CUDA graphs: the captured bucket size).
        seg_lens: (bs,) int32, tokens per row.
        seg_indptr: (bs + 1,) int32, prefix sums of ``seg_lens``.
        weight_indices: (bs,) int32, pool slot of each row; -1 for a row with no adapter.
        lora_ranks: (num_slots,) int32, rank of each slot's adapter (0: a slot that does nothing).
        scalings: (num_slots,) float32, the LoRA scaling of each slot.
        token_slot: (token_capacity,) int32, slot of each token, -1 for none.
        block_m: most tokens in one chunk; the kernels' row tile.
        max_chunks: length of the chunk arrays, the most chunks ``num_tokens`` tokens can take
            (``max_chunks_for``); the kernels' grid is sized from it, never from the data, so a
            graph captured for a token count covers any later mix of adapters at that count.
        sorted_token_ids: (token_capacity,) int32; adapter tokens grouped by slot. Chunk ``c``
            owns ``sorted_token_ids[chunk_start[c] : chunk_start[c] + chunk_len[c]]``.
        chunk_slot: (max_chunks,) int32, the slot of each chunk; -1 for an unused chunk.
        chunk_start: (max_chunks,) int32.
        chunk_len: (max_chunks,) int32, 0 for an unused chunk.
        slots_in_batch: the distinct slots with an adapter, on the host (for the torch path;
            the kernels never read it).
    """

    bs: int
    num_tokens: int
    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    token_slot: torch.Tensor
    block_m: int
    max_chunks: int
    sorted_token_ids: torch.Tensor
    chunk_slot: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    slots_in_batch: tuple = ()

    def to(self, device) -> "LoRABatchInfo":
        """A copy whose tensors are on ``device`` (a layer of a model split over devices)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


# Row tiles by forward size: (block_m, largest token count it serves; None: no limit). 16 (the
# smallest tensor-core tile) for decode-sized batches, larger for prefill so each adapter's
# weights are read fewer times.
BLOCK_M_TIERS = ((16, 256), (32, 2048), (64, None))


def choose_block_m(num_tokens: int) -> int:
    """Row tile for a forward of ``num_tokens`` tokens (see ``BLOCK_M_TIERS``)."""
    for block_m, limit in BLOCK_M_TIERS:
        if limit is None or num_tokens <= limit:
            return block_m
    raise AssertionError("the last tier has no limit")


def max_chunks_for(num_tokens: int, block_m: int, max_loras: int) -> int:
    """Most chunks a plan of ``num_tokens`` tokens over at most ``max_loras`` adapters can have.

    An adapter with ``n`` tokens takes ``ceil(n / block_m)`` chunks; over ``k`` adapters these sum
    to at most ``(num_tokens + k * (block_m - 1)) // block_m``, with ``k`` no more than the tokens,
    and no plan has more chunks than tokens.
    """
    k = min(num_tokens, max_loras)
    return min(num_tokens, (num_tokens + k * (block_m - 1)) // block_m)


def plan_chunks(weight_indices: Sequence[int], seg_lens: Sequence[int], block_m: int) -> tuple:
    """Host-side grouping of tokens by slot, in numpy (an engine step carries hundreds of rows).

    Returns (token_slot, sorted_token_ids, chunk_slot, chunk_start, chunk_len), int64 arrays, and
    slots_in_batch, a tuple. Slots are visited in ascending order and rows in their original order
    within a slot, so the plan is deterministic.
    """
    rows = np.asarray(weight_indices, dtype=np.int64)
    token_slot = np.repeat(rows, np.asarray(seg_lens, dtype=np.int64))
    adapter_tokens = np.flatnonzero(token_slot != NO_ADAPTER)
    of_adapter = token_slot[adapter_tokens]
    sorted_ids = adapter_tokens[np.argsort(of_adapter, kind="stable")]  # stable: row order kept
    used, counts = np.unique(of_adapter, return_counts=True)  # ascending slots
    n_chunks = (counts + block_m - 1) // block_m
    first = np.repeat(np.cumsum(counts) - counts, n_chunks)  # each chunk's slot's first token
    k = np.arange(int(n_chunks.sum())) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)  # its index in the slot
    chunk_start = first + k * block_m
    chunk_len = np.minimum(block_m, np.repeat(counts, n_chunks) - k * block_m)
    in_batch = tuple(np.unique(rows[rows != NO_ADAPTER]).tolist())  # (a row of no tokens too)
    return token_slot, sorted_ids, np.repeat(used, n_chunks), chunk_start, chunk_len, in_batch


class BatchInfoBuffers:
    """Fixed-size device storage for ``LoRABatchInfo``, refreshed in place.

    All integer fields live in one int32 device tensor (the scalings in one float32 tensor), so
    a refresh is one pinned host-to-device copy per tensor, with no host sync; under CUDA graphs
    the captured kernels keep reading the same addresses. The host side is written through numpy
    views of the pinned buffers: an engine step refills them, and a torch op per field would cost
    the host more than the copy.
    """

    def __init__(self, max_bs: int, max_tokens: int, max_slots: int, max_loras: int, block_m: int,
                 device: torch.device):
        self.max_bs, self.max_tokens, self.max_slots = max_bs, max_tokens, max_slots
        self.block_m = block_m
        self.max_loras = max_loras
        self.max_chunks = max_chunks_for(max_tokens, block_m, max_loras)
        sizes = {
            "seg_lens": max_bs,
            "seg_indptr": max_bs + 1,
            "weight_indices": max_bs,
            "lora_ranks": max_slots,
            "token_slot": max_tokens,
            "sorted_token_ids": max_tokens,
            "chunk_slot": self.max_chunks,
            "chunk_start": self.max_chunks,
            "chunk_len": self.max_chunks,
        }
        self._offsets = {}
        total = 0
        for name, n in sizes.items():
            self._offsets[name] = (total, n)
            total += n
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        # Two pinned staging buffers used in turn: a fill waits only for the copy issued two
        # fills ago (an event), never for the whole stream.
        # Normal tensors even when first built under torch.inference_mode(): a later fill outside
        # it updates them in place, which PyTorch forbids on inference tensors.
        with torch.inference_mode(False):
            self._hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self._host_scalings = [torch.zeros(max_slots, dtype=torch.float32, pin_memory=pin)
                                   for _ in range(2)]
            self.dev = torch.zeros(total, dtype=torch.int32, device=self.device)
            self.dev_scalings = torch.zeros(max_slots, dtype=torch.float32, device=self.device)
        self._host_arrays = [h.numpy() for h in self._hosts]  # the same memory
        self._host_scaling_arrays = [h.numpy() for h in self._host_scalings]
        self._events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self._last_key, self._last_info = None, None
        self._views = {}  # (rows, tokens, slots, chunks) -> the device views a LoRABatchInfo holds

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        off, n = self._offsets[name]
        return buf[off : off + n]

    def _views_for(self, bs: int, num_tokens: int, n_slots: int, max_chunks: int) -> dict:
        """The device views a ``LoRABatchInfo`` of this size holds, made once per size (an engine
        step's sizes come back; a bound keeps eager calls of every size from growing it)."""
        size = (bs, num_tokens, n_slots, max_chunks)
        views = self._views.get(size)
        if views is None:
            if len(self._views) >= 4096:
                self._views.clear()
            dev = self.dev
            views = self._views[size] = dict(
                seg_lens=self._view(dev, "seg_lens")[:bs],
                seg_indptr=self._view(dev, "seg_indptr")[: bs + 1],
                weight_indices=self._view(dev, "weight_indices")[:bs],
                lora_ranks=self._view(dev, "lora_ranks")[:n_slots],
                scalings=self.dev_scalings[:n_slots],
                token_slot=self._view(dev, "token_slot")[:num_tokens],
                sorted_token_ids=self._view(dev, "sorted_token_ids"),
                chunk_slot=self._view(dev, "chunk_slot")[:max_chunks],
                chunk_start=self._view(dev, "chunk_start")[:max_chunks],
                chunk_len=self._view(dev, "chunk_len")[:max_chunks])
        return views

    def fill(self, bs: int, num_tokens: int, seg_lens: Sequence[int], weight_indices: Sequence[int],
             lora_ranks: Sequence[int], scalings: Sequence[float]) -> LoRABatchInfo:
        if bs > self.max_bs or num_tokens > self.max_tokens:
            raise ValueError(
                f"batch of {bs} rows / {num_tokens} tokens exceeds the buffers "
                f"({self.max_bs} rows / {self.max_tokens} tokens)")
        if len(lora_ranks) > self.max_slots:
            raise ValueError(f"{len(lora_ranks)} slots exceed the buffers' {self.max_slots}")
        # a decode call refills the same batch at every step: the device buffers, which only this
        # method writes, already hold it
        key = (bs, num_tokens, tuple(seg_lens), tuple(weight_indices), tuple(lora_ranks), tuple(scalings))
        if key == self._last_key:
            return self._last_info
        token_slot, sorted_ids, c_slot, c_start, c_len, slots = plan_chunks(
            weight_indices, seg_lens, self.block_m)
        # The chunk arrays this fill hands out are cut to what its token count can use: the
        # kernels' grids follow them, and a graph's token count is fixed, so a grid captured at
        # one count covers every later plan at that count (the buffer's tail stays "unused").
        max_chunks = max_chunks_for(num_tokens, self.block_m, self.max_loras)
        if len(c_slot) > max_chunks:  # cannot happen while distinct slots <= max_loras
            raise ValueError(
                f"{len(slots)} distinct adapters in one batch exceed max_loras_per_batch")
        turn, self._turn = self._turn, 1 - self._turn
        host, host_scalings, event = self._hosts[turn], self._host_scalings[turn], self._events[turn]
        array, scaling_array = self._host_arrays[turn], self._host_scaling_arrays[turn]
        if event is not None:
            event.synchronize()
        array.fill(0)
        scaling_array.fill(0)
        values = {
            "seg_lens": seg_lens,
            "seg_indptr": np.concatenate(([0], np.cumsum(seg_lens, dtype=np.int64))),
            "weight_indices": weight_indices,
            "lora_ranks": lora_ranks,
            "token_slot": token_slot,
            "sorted_token_ids": sorted_ids,
            "chunk_slot": c_slot,
            "chunk_start": c_start,
            "chunk_len": c_len,
        }
        for name, vals in values.items():
            if len(vals):
                off = self._offsets[name][0]
                array[off : off + len(vals)] = vals
        # padded tokens (graph buckets) belong to no adapter, and so do the chunks past the plan
        for name, used in (("token_slot", len(token_slot)), ("chunk_slot", len(c_slot))):
            off, n = self._offsets[name]
            array[off + used : off + n] = NO_ADAPTER
        if scalings:
            scaling_array[: len(scalings)] = scalings
        self.dev.copy_(host, non_blocking=True)
        self.dev_scalings.copy_(host_scalings, non_blocking=True)
        if event is not None:
            event.record()
        n_slots = len(lora_ranks)
        self._last_key = key
        self._last_info = LoRABatchInfo(bs=bs, num_tokens=num_tokens, block_m=self.block_m, max_chunks=max_chunks,
                                        slots_in_batch=slots, **self._views_for(bs, num_tokens, n_slots, max_chunks))
        return self._last_info
