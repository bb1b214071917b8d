"""The page table of each engine step, for the attention that reads the paged cache in place.

The in-place kernel (``ops.paged_varlen``) finds request i's keys through its pages: a few
entries a request (its context over the page size), built on the host before each forward from
the engine's own block tables and copied to the GPU in one transfer. The engine's alternative,
a slot index for every key read (``read_index``), is a Python list as long as all the contexts of
the step together, made and copied at every step: with many long requests in flight, host time
that the engine's thread, which sets the pace of a busy server, spends on nothing else.

The device buffer is allocated once per batch processor, so a CUDA graph captured over it reads
each step's table; it is filled on the stream the engine computes on, before the step's forward
(replayed or not), so a step launched earlier (async batching) has read its own table by then.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from ..compat.engine import cb_capacity, cb_key_length_cap, cb_page_groups, cb_step_key_counts
from ..ops.paged_varlen import Pages


class StepPages:
    """Args:
        processor: the engine's batch processor (its cache's full-attention groups, its capacity).
        device: where the kernel reads the table.
    """

    def __init__(self, processor, device: torch.device):
        self.groups, self._layer_group = cb_page_groups(processor.cache)
        sizes = {g.size for g in self.groups}
        if len(sizes) > 1:  # one table's offsets serve every group
            raise RuntimeError(f"fastlora: the engine's full-attention groups have pages of different sizes "
                               f"({sorted(sizes)}); the in-place attention needs one")
        self._size = sizes.pop() if sizes else 1
        max_requests = cb_capacity(processor)[1]
        self._cu_len = max_requests + 2  # padded steps pass up to max_requests sequences
        # the engine bounds the keys a step reads (its read index's length); each request's last
        # page may be partly filled
        self.capacity = cb_key_length_cap(processor) // self._size + max_requests + 1
        length = self._cu_len + len(self.groups) * self.capacity
        self._host = torch.zeros(length, dtype=torch.int32)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(length, dtype=torch.int32, device=device)
        self._pages: List[Pages] = []
        for i, group in enumerate(self.groups):
            start = self._cu_len + i * self.capacity
            self._pages.append(Pages(self._device[start:start + self.capacity], self._device[:self._cu_len],
                                     group.size))

    def of_layer(self, layer_idx: int) -> Optional[Pages]:
        """The pages of a layer's group (None: the layer is not a full-attention one)."""
        group = self._layer_group.get(layer_idx)
        return None if group is None else self._pages[group]

    def load(self, processor) -> None:
        """The table of the step about to run, into the device buffer (on the current stream)."""
        if not self.groups:
            return
        ids, keys = cb_step_key_counts(processor)
        size = self._size
        counts = [-(-k // size) for k in keys]
        cu = self._host_np[:self._cu_len]
        cu[0] = 0
        np.cumsum(counts, out=cu[1:len(counts) + 1])
        total = int(cu[len(counts)])
        cu[len(counts) + 1:] = total
        if total > self.capacity:
            raise RuntimeError(f"fastlora: the step reads {total} pages of keys, more than the {self.capacity} "
                               "its page table holds")
        for i, group in enumerate(self.groups):
            blocks = _blocks_of(group.tables(), ids, counts, total)
            start = self._cu_len + i * self.capacity
            np.multiply(blocks, group.stride, out=self._host_np[start:start + total], casting="unsafe")
        # the offsets and every group's pages in one transfer (between the groups, stale entries no
        # request of this step reaches); from pageable memory the copy has left the host buffer
        # when it returns, so the next step may refill it at once
        end = self._cu_len + (len(self.groups) - 1) * self.capacity + total
        self._device[:end].copy_(self._host[:end], non_blocking=True)


def _blocks_of(tables: Dict[str, list], ids: List[str], counts: List[int], total: int) -> np.ndarray:
    """The first ``counts[i]`` block ids of each request ``ids[i]``, concatenated."""
    flat: list = []
    for rid, n in zip(ids, counts):
        flat.extend(tables[rid][:n])
    if len(flat) != total:
        raise RuntimeError(f"fastlora: the engine's block tables hold {len(flat)} of the {total} pages the step "
                           "reads")
    return np.asarray(flat, dtype=np.int64)
