"""The static KV caches fastlora owns for its decode graphs, with bounded memory.

A graph replays the addresses it was captured with, so the cache a graph writes into must stay
put. ``StaticCacheStore`` keeps one ``StaticCache`` per batch bucket, grown to the longest
length that bucket has needed, and every one of them is a *view* of one buffer per layer: only
one ``generate`` call runs on a model at a time and each call resets its cache, so the buckets
can share the memory. The store therefore holds the KV memory of the largest call it served
(rows x length), not the sum over buckets and lengths; ``budget_bytes`` caps it (a call that
would need more decodes eagerly, with the reason).

Growing the shared buffer replaces every cache (the runner then drops every graph); growing one
bucket's length replaces that bucket's cache only. Lengths are rounded up to at most four sizes
per octave (and at least 256 tokens), so a growing server settles on few sizes.

The caches' layers also accept a prefill of fewer rows than they hold (the real batch fills the
first rows, the rest are padding rows of the bucket), and plain full-attention layers write a
step's keys and values with one kernel (``ops.kv_cache``) where it applies.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..compat.generate import is_plain_static_layer, sliding_window, static_cache_layout, static_cache_over
from ..kernel_support import kernel_runs_on
from ..ops.kv_cache import kv_cache_write
from ..ops.rotary_kv import rotary_kv_write

MIN_LENGTH = 256


def round_length(n: int) -> int:
    """``n`` rounded up to a multiple of a quarter of its octave, at least ``MIN_LENGTH``."""
    n = max(int(n), MIN_LENGTH)
    step = max(64, 1 << (n.bit_length() - 3))
    return -(-n // step) * step


class CacheUnavailable(RuntimeError):
    """No static cache for this call (over the budget, or out of memory); the call decodes eagerly."""


@dataclass
class _Entry:
    rows: int
    length: int
    serial: int
    cache: object


class StaticCacheStore:
    """Static caches for one model, one per batch bucket, sharing one buffer per layer.

    Args:
        model: the transformers model whose ``generate`` receives the caches.
        kernel_writes: full-attention layers write with ``ops.kv_cache`` where it applies.
        budget_bytes: most bytes the shared buffers may take (None: what the largest call needs).
    """

    def __init__(self, model: nn.Module, kernel_writes: bool = True, budget_bytes: Optional[int] = None):
        self.model = model
        self.kernel_writes = kernel_writes
        self.budget_bytes = budget_bytes
        self.layout = static_cache_layout(model)  # per layer: (kv heads, k dim, v dim)
        self.window = sliding_window(model)  # longest call the graphs serve (None: any)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.capacity_tokens = 0  # rows x length the shared buffers hold
        self._buffers: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._entries: Dict[int, _Entry] = {}  # bucket rows -> its cache
        self._lengths: Dict[int, int] = {}  # bucket rows -> longest length it needed (kept on growth)
        self._serial = 0
        # the KV-write kernel's ticket (ops.kv_cache): one for every layer, since the layers' writes
        # run one after another and each leaves it at zero; allocated here, outside any capture
        with torch.inference_mode(False):
            self._ticket = torch.zeros(1, dtype=torch.int32, device=self.device)

    # -- sizes --------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        esize = torch.empty((), dtype=self.dtype).element_size()
        return sum(h * (dk + dv) for h, dk, dv in self.layout) * esize

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._buffers)

    def shapes(self) -> Dict[int, int]:
        """Bucket rows -> length of the cache kept for that bucket."""
        return {rows: e.length for rows, e in sorted(self._entries.items())}

    def live_serials(self) -> set:
        return {e.serial for e in self._entries.values()}

    def length_of(self, cache) -> Optional[int]:
        """The length (tokens per row) of one of this store's caches (None for any other cache)."""
        for e in self._entries.values():
            if e.cache is cache:
                return e.length
        return None

    def serial_of(self, cache) -> Optional[int]:
        """The serial of one of this store's caches (None for any other cache)."""
        for e in self._entries.values():
            if e.cache is cache:
                return e.serial
        return None

    # -- the caches ---------------------------------------------------------------------------
    def cache_for(self, rows: int, needed_len: int, reset: bool = True):
        """A static cache holding ``rows`` rows of at least ``needed_len`` tokens (reset)."""
        length = self._new_length(rows, needed_len)
        if length is None:
            cache = self._entries[rows].cache
            if reset:
                cache.reset()
            return cache
        tokens = rows * length
        if tokens > self.capacity_tokens:
            self._grow(tokens)
        self._serial += 1
        entry = _Entry(rows, length, self._serial, self._view_cache(rows, length))
        self._entries[rows] = entry
        self._lengths[rows] = length
        return entry.cache

    def would_grow(self, rows: int, needed_len: int) -> bool:
        """Whether ``cache_for(rows, needed_len)`` replaces the shared buffers (and with them every
        cache): whoever holds the old caches can let them go first, so the peak is the new size."""
        try:
            length = self._new_length(rows, needed_len)
        except CacheUnavailable:
            return False
        return length is not None and rows * length > self.capacity_tokens

    def _new_length(self, rows: int, needed_len: int) -> Optional[int]:
        """The length of the cache to make for this call (None: the one kept serves); raises
        ``CacheUnavailable`` where none may be made."""
        if self.window is not None and needed_len > self.window:
            # full-attention layers equal sliding ones only while no token leaves the window
            raise CacheUnavailable(f"the call needs {needed_len} tokens, past the model's "
                                   f"{self.window}-token sliding window")
        entry = self._entries.get(rows)
        if entry is not None and entry.length >= needed_len:
            return None
        length = round_length(max(needed_len, self._lengths.get(rows, 0)))
        if self.budget_bytes is not None and rows * length * self.bytes_per_token() > self.budget_bytes:
            raise CacheUnavailable(
                f"a static cache of {rows} rows x {length} tokens needs "
                f"{rows * length * self.bytes_per_token() / 2**20:.1f} MiB, over cache_budget_bytes="
                f"{self.budget_bytes}")
        return length

    def clear(self):
        """Drop every cache, the shared buffers and the lengths learnt."""
        self._drop_buffers()
        self._lengths.clear()

    def _drop_buffers(self):
        self._entries.clear()
        self._buffers = []
        self.capacity_tokens = 0

    def _grow(self, tokens: int):
        self._drop_buffers()  # free the old buffers first: the peak is the new size, not old + new
        try:
            with torch.inference_mode(False):
                self._buffers = [
                    (torch.zeros(tokens * h * dk, dtype=self.dtype, device=self.device),
                     torch.zeros(tokens * h * dv, dtype=self.dtype, device=self.device))
                    for h, dk, dv in self.layout]
        except torch.OutOfMemoryError as e:
            self._drop_buffers()
            raise CacheUnavailable(
                f"out of memory allocating a static cache of {tokens} tokens "
                f"({tokens * self.bytes_per_token() / 2**20:.1f} MiB)") from e
        self.capacity_tokens = tokens

    def _view_cache(self, rows: int, length: int):
        views = []
        for (h, dk, dv), (kbuf, vbuf) in zip(self.layout, self._buffers):
            views.append((kbuf[: rows * h * length * dk].view(rows, h, length, dk),
                          vbuf[: rows * h * length * dv].view(rows, h, length, dv)))
        cache = static_cache_over(self.model, length, views)
        for layer in cache.layers:  # a cache of ours, never the user's: nothing to restore later
            layer.update = _FirstRowsUpdate(layer)
            layer._fastlora_kernel_writes = self.kernel_writes
            layer._fastlora_ticket = self._ticket
        return cache


def make_static_cache(model: nn.Module, max_cache_len: int, batch_size: int, kernel_writes: bool = True):
    """A stand-alone static cache of ``batch_size`` rows for ``model`` (tests and profiling)."""
    return StaticCacheStore(model, kernel_writes).cache_for(batch_size, max_cache_len)


class _FirstRowsUpdate:
    """``update`` of a store's cache layer: ``_update_first_rows`` on the layer, held weakly. A
    method bound to the layer and stored on it would make every layer a reference cycle, freed only
    by Python's cyclic collector: a released cache's buffers (the whole KV memory) would stay
    allocated until that ran, and the calls that the release made room for would run out of memory."""

    __slots__ = ("_layer",)

    def __init__(self, layer):
        self._layer = weakref.ref(layer)

    def __call__(self, *args, **kwargs):
        return _update_first_rows(self._layer(), *args, **kwargs)

    def __deepcopy__(self, memo):  # a copied layer's update is the copy's, as a bound method's would be
        return _FirstRowsUpdate(copy.deepcopy(self._layer(), memo))


def _update_first_rows(layer, key_states, value_states, *args, **kwargs):
    """``update`` of a static cache layer that also accepts fewer rows than it holds (it fills the
    first ones). Where ``ops.kv_cache`` takes the tensors, the write and the length increment are one
    kernel, instead of transformers' five; otherwise transformers' update runs."""
    if kernel_writes(layer, key_states, value_states):

        return _kernel_update(layer, key_states, lambda ticket: kv_cache_write(
            key_states, value_states, layer.keys, layer.values, layer.cumulative_length, ticket=ticket))
    rows, full_k, full_v = key_states.shape[0], layer.keys, layer.values
    if rows == full_k.shape[0]:
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    layer.keys, layer.values = full_k[:rows], full_v[:rows]  # views: writes land in the full tensors
    try:
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    finally:
        layer.keys, layer.values = full_k, full_v


def kernel_writes(layer, key, value) -> bool:
    """Whether ``layer`` is one of a store's layers that ``ops.kv_cache`` writes, for these states."""
    return getattr(layer, "_fastlora_kernel_writes", False) and _kv_kernel_applies(layer, key, value)


def _kernel_update(layer, key_states, write):
    """Run ``write(ticket)``, a kernel writing the step's states at the layer's fill length (and
    advancing it, given the ticket); returns the layer's keys and values cut to the step's rows."""
    ticket = getattr(layer, "_fastlora_ticket", None)
    if ticket is not None and ticket.device != key_states.device:  # (a layer on another device)
        ticket = None
    out = write(ticket)
    if ticket is None:
        layer.cumulative_length.add_(key_states.shape[-2])
    rows, full_k, full_v = key_states.shape[0], layer.keys, layer.values
    kv = (full_k, full_v) if rows == full_k.shape[0] else (full_k[:rows], full_v[:rows])
    return kv if out is None else (out,) + kv


def rotary_update(layer, query_states, key_states, value_states, cos, sin):
    """``apply_rotary_pos_emb`` then this layer's ``update``, as one kernel (``ops.rotary_kv``):
    returns (rotated q, keys, values) as the two would. The caller has checked ``kernel_writes``
    and that ``ops.rotary`` takes the rotary's inputs."""

    return _kernel_update(layer, key_states, lambda ticket: rotary_kv_write(
        query_states, key_states, value_states, cos, sin, layer.keys, layer.values, layer.cumulative_length,
        ticket=ticket))


def _kv_kernel_applies(layer, key, value) -> bool:
    # only transformers' plain static layer: a sliding-window layer rolls its window instead
    if not is_plain_static_layer(layer):
        return False
    keys, length = getattr(layer, "keys", None), getattr(layer, "cumulative_length", None)
    if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor):
        return False
    if not isinstance(length, torch.Tensor) or length.numel() != 1 or length.device != keys.device:
        return False
    if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
        return False
    if key.dim() != 4 or key.shape != value.shape or key.shape[0] > keys.shape[0]:
        return False
    if key.shape[1:2] + key.shape[3:] != keys.shape[1:2] + keys.shape[3:] or key.shape[2] > keys.shape[2]:
        return False
    if len({key.dtype, value.dtype, keys.dtype, layer.values.dtype}) != 1 or key.device != keys.device:
        return False
    if any(t.stride(-1) != 1 for t in (key, value, keys, layer.values)):
        return False
    return kernel_runs_on(key, value, keys)


def cache_state_tensors(cache) -> list:
    """The small tensors a static cache advances in place at each update (its fill lengths).

    A decode step run for warm-up or capture advances them; the graph runner saves and restores them
    so that the real step writes where it should.
    """
    out = []
    for layer in getattr(cache, "layers", []) or []:
        t = getattr(layer, "cumulative_length", None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out
