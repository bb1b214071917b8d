"""A site's LoRA delta computed beside its 8-bit base matmul.

Over bitsandbytes' 8-bit layers the shrink cannot ride the base GEMM as a folded site's does, and
the base output does not feed the delta. So at decode the delta is computed into a buffer of its
own on a second stream, forked from the current one before the input's quantization and joined
before the dequantization, which adds it in its own launch (``ops.int8_dequant``): inside a
CUDA graph the two are parallel branches, and the LoRA launches run on the SMs and bandwidth that a
decode-sized int8 GEMM leaves unused instead of after it. Off CUDA the same steps run in turn.

Only the 8-bit path takes it: bitsandbytes' 4-bit matmul keeps every SM busy, and beside it both
ran slower than one after the other (``docs/what-was-tried.md``).

At most one LoRA launch is in flight at a time (the fused kernel's workspace is one per device):
the branch starts after everything the current stream has queued and is joined before anything
it queues next. The delta's buffer is allocated on the current stream, so that its memory is
reused only after the join.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch


class SideStreams:
    """One side stream per CUDA device, made before any capture (``prepare``): a stream made
    while a graph is being captured would not be part of it."""

    def __init__(self):
        self._streams: Dict[int, torch.cuda.Stream] = {}

    def prepare(self, devices: Iterable[torch.device]) -> None:
        for device in devices:
            device = torch.device(device)
            if device.type == "cuda":
                index = torch.cuda.current_device() if device.index is None else device.index
                if index not in self._streams:
                    self._streams[index] = torch.cuda.Stream(device=index)

    def stream_for(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        """The device's side stream; None off CUDA or for a device ``prepare`` did not see."""
        if device.type != "cuda":
            return None
        return self._streams.get(torch.cuda.current_device() if device.index is None else device.index)


class LoraBeside:
    """Every row's LoRA delta of one forward of a site, (rows, the site's output width) in the
    input's dtype: ``start`` queues it on the side stream, ``join`` returns it once the current
    stream waits for it. ``pool``: the site's ``SitePool`` for the input's dtype; ``bi``: the
    call's batch info; rows with no adapter get zeros."""

    def __init__(self, streams: SideStreams, backend, pool, x2: torch.Tensor, bi):
        self._backend, self._pool, self._x2, self._bi = backend, pool, x2, bi
        self._side = streams.stream_for(x2.device)
        self._main = torch.cuda.current_stream(x2.device) if self._side is not None else None
        self.delta = torch.empty(x2.shape[0], pool.packed.offsets[-1], dtype=x2.dtype, device=x2.device)

    def _compute(self) -> None:
        pool = self._pool
        self.delta.zero_()
        self._backend.run_packed_lora(self._x2, pool.packed, base_output=self.delta, layer_ranks=pool.ranks,
                                      layer_scalings=pool.scalings, batch_info=self._bi)

    def start(self) -> None:
        if self._side is None:
            self._compute()
            return
        self._side.wait_stream(self._main)
        with torch.cuda.stream(self._side):
            self._compute()

    def join(self) -> torch.Tensor:
        if self._side is not None:
            self._main.wait_stream(self._side)
        return self.delta
