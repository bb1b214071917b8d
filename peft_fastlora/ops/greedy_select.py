"""A greedy decode step's token selection in one launch: what transformers' loop does after the
forward, from the logits to the next token and the rows still running.

transformers' greedy loop spends about 25 small launches between two decode steps: the logits'
float32 copy, the length processors' ``arange`` / ``isin`` / ``clone`` / ``where``, ``argmax``
(one block per row: a few SMs read a 128k-wide row while the rest of the GPU waits), the padding
of finished rows, the ``cat`` of the new column and the stopping criteria. Here one kernel does
the selection, for rows of ``(chunks, rows)`` programs:

- each program reads a segment of one row (any float dtype, compared in float32, which orders
  the float32 copy transformers takes exactly) in a loop of tile-wide loads, drops the suppressed
  ids (the EOS ids a minimum length forbids: set to -inf, as ``torch.where`` does), and keeps in
  each lane its largest value and the first column holding it (a value replaces the lane's only
  if larger; the lane's first NaN replaces any number: NaN ranks above everything, ``argmax``'s
  rule). A few programs a row, each looping, cost less than one short program per tile: the
  per-element work is float32 compares, and the cross-lane reduction runs once a segment.
- at the end each lane packs its best into one int64 key (an order-preserving integer of the
  value above the column's complement, -0.0 made 0.0), so the largest key is the largest value at
  its first column, and the program reduces its lanes' keys.
- it folds its key into the row's slot with ``atomic_max`` and takes a ticket; the row's last
  program reads and resets the slot and the ticket (so the workspace is ready for the next launch),
  writes the token (``pad`` for a row already finished when there is an EOS criterion) and clears
  the row's ``unfinished`` flag where the token is one of the stop ids.

The slots and tickets (``SelectWorkspace``) start reset and every launch leaves them so: launches
that share a workspace must run one after another (one stream).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..kernel_support import tl, triton
from ..kernel_support import FLOAT_DTYPES, kernel_runs_on

# (segment, tile, warps, stages): columns a program reads, columns a loop step loads, warps, load
# pipeline depth (``config_for``; ``greedy_select``'s ``config`` overrides it)
SelectConfig = Tuple[int, int, int, int]


def config_for(rows: int) -> Tuple[int, int, int, int]:
    """The launch for ``rows`` rows (the fastest measured at an 8B vocabulary): a few rows want many
    programs a row (a short tail), many rows a few long loops."""
    if rows < 2:  # one tile a program: the old one-load form's launch shape
        return 1024, 1024, 8, 1
    if rows < 7:
        return 2048, 2048, 8, 1
    if rows < 64:
        return 8192, 1024, 4, 3
    return 32768, 2048, 8, 1


def block_for(rows: int, config: Optional[SelectConfig] = None) -> int:
    """Logits a program of a ``rows``-row launch reads."""
    return (config or config_for(rows))[0]


MAX_IDS = 16  # suppressed / stop ids a launch takes (more: the caller keeps transformers' loop)
EMPTY_KEY = -(2 ** 63)  # a slot with no key yet: below every packed key


@triton.jit
def segment_of(logits_ptr, vocab, stride_lr, SEGMENT: tl.constexpr, TILE: tl.constexpr):
    """A program's segment of its row (grid: segments, rows): (row, the segment's first column,
    its columns within the vocabulary, a pointer to its first logit, a tile's lanes)."""
    segment = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    start = segment * SEGMENT
    return row, start, tl.minimum(SEGMENT, vocab - start), logits_ptr + row * stride_lr + start, tl.arange(0, TILE)


@triton.jit
def _greedy_select_kernel(
    # pointers
    logits_ptr,  # (rows, vocab), unit stride on vocab
    unfinished_ptr,  # (rows,) int64 0 / 1: read; cleared where the token stops the row (HAS_STOP)
    token_ptr,  # (rows,) int64 through stride_t: the selected tokens
    pad_ptr,  # () int64: the token of a finished row (HAS_STOP)
    suppress_ptr,  # (N_SUPPRESS,) int64: ids set to -inf first
    stop_ptr,  # (N_STOP,) int64: ids that finish a row
    slot_ptr,  # (rows,) int64: the row's best key so far, EMPTY_KEY between launches
    ticket_ptr,  # (rows,) int32: programs of the row done, 0 between launches
    # dimensions and strides
    vocab, stride_lr, stride_t,
    # meta-parameters
    N_SUPPRESS: tl.constexpr,
    N_STOP: tl.constexpr,
    HAS_STOP: tl.constexpr,  # an EOS criterion: finished rows take pad, stop ids finish rows
    EMPTY: tl.constexpr,  # EMPTY_KEY
    SEGMENT: tl.constexpr,  # columns a program reads
    TILE: tl.constexpr,  # columns a loop step loads
    STAGES: tl.constexpr,  # the loads' pipeline depth (1: none)
):
    row, start, n, row_ptr, lanes = segment_of(logits_ptr, vocab, stride_lr, SEGMENT, TILE)
    top = tl.full([TILE], float("-inf"), tl.float32)
    # a lane that never takes a value (all -inf, or past the row's end) keeps its first column:
    # where -inf is the segment's maximum, that column is right
    at = lanes
    for t in tl.range(0, n, TILE, num_stages=STAGES):
        x = tl.load(row_ptr + t + lanes, mask=t + lanes < n, other=float("-inf")).to(tl.float32)
        for i in tl.static_range(N_SUPPRESS):
            x = tl.where(start + t + lanes == tl.load(suppress_ptr + i), float("-inf"), x)
        # strictly larger (an equal value later in the lane loses), or the lane's first NaN
        take = (x > top) | ((x != x) & (top == top))
        top = tl.where(take, x, top)
        at = tl.where(take, t + lanes, at)
    x = top + 0.0  # -0.0 + 0.0 is +0.0: the two zeros get one key
    bits = x.to(tl.int32, bitcast=True)
    # order-preserving: negative floats flip their magnitude bits; NaN above +inf
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x != x, 0x7FFFFFFF, key)
    low32 = tl.full([], 0xFFFFFFFF, tl.int64)
    low = low32 - (start + at).to(tl.int64)  # the first column ranks highest among equal values
    tl.atomic_max(slot_ptr + row, tl.max((key.to(tl.int64) << 32) + low, axis=0))
    if tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        best = tl.atomic_xchg(slot_ptr + row, EMPTY)
        tl.atomic_xchg(ticket_ptr + row, 0)
        token = low32 - (best & low32)
        if HAS_STOP:
            running = tl.load(unfinished_ptr + row)
            token = tl.where(running != 0, token, tl.load(pad_ptr))
            stops = token < 0  # False, as a tensor
            for i in tl.static_range(N_STOP):
                stops = stops | (token == tl.load(stop_ptr + i))
            tl.store(unfinished_ptr + row, tl.where(stops, 0, running))
        tl.store(token_ptr + row * stride_t, token)


class SelectWorkspace:
    """Per-row slots and tickets of ``greedy_select`` on one device, reset between launches."""

    def __init__(self, device, rows: int):
        self.slots = torch.full((max(rows, 1),), EMPTY_KEY, dtype=torch.int64, device=device)
        self.tickets = torch.zeros(max(rows, 1), dtype=torch.int32, device=device)


_workspaces: Dict[torch.device, SelectWorkspace] = {}


def workspace_for(device: torch.device, rows: int) -> SelectWorkspace:
    """The device's shared workspace, grown to ``rows`` (allocated outside any graph capture: the
    token selection runs between steps)."""
    ws = _workspaces.get(device)
    if ws is None or ws.slots.numel() < rows:
        ws = _workspaces[device] = SelectWorkspace(device, rows)
    return ws


def _ids(ids: Optional[torch.Tensor], device, name: str) -> torch.Tensor:
    if ids is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    ids = ids.reshape(-1)
    if ids.dtype != torch.int64 or ids.device != device or ids.numel() > MAX_IDS:
        raise ValueError(f"greedy_select: {name} must be at most {MAX_IDS} int64 ids on {device}, "
                         f"got {ids.numel()} {ids.dtype} on {ids.device}")
    return ids


def greedy_select(logits: torch.Tensor, tokens: torch.Tensor, unfinished: Optional[torch.Tensor] = None,
                  pad: Optional[torch.Tensor] = None, stop_ids: Optional[torch.Tensor] = None,
                  suppress_ids: Optional[torch.Tensor] = None,
                  workspace: Optional[SelectWorkspace] = None, config: Optional[SelectConfig] = None) -> torch.Tensor:
    """The next tokens of a greedy step: transformers' loop from the logits on.

    Args:
        logits: (rows, vocab) float, unit stride on vocab (the forward's last position).
        tokens: (rows,) int64, any stride (a column of the ids buffer): written.
        unfinished: (rows,) int64 0 / 1, the rows still running; with ``stop_ids`` read and
            updated in place (a row whose token is a stop id finishes).
        pad: () int64, the token of a row that had finished (with ``stop_ids``).
        stop_ids: the EOS criterion's ids (None: no EOS criterion, rows never finish here).
        suppress_ids: ids set to -inf before the argmax (a minimum length not yet reached).
        workspace: slots and tickets of at least ``rows`` (None: the device's shared one, which a
            larger launch replaces: a launch captured in a CUDA graph needs its own).
        config: the launch shape (``SelectConfig``; None: ``config_for(rows)``).
    Returns:
        ``tokens``.
    """
    if logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"greedy_select: logits must be (rows, vocab) float with unit stride on vocab, "
                         f"got {tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    rows, vocab = logits.shape
    dev = logits.device
    if tokens.shape != (rows,) or tokens.dtype != torch.int64 or tokens.device != dev:
        raise ValueError(f"greedy_select: tokens must be ({rows},) int64 on {dev}, got {tuple(tokens.shape)} "
                         f"{tokens.dtype} on {tokens.device}")
    has_stop = stop_ids is not None
    if has_stop and (unfinished is None or unfinished.shape != (rows,) or unfinished.dtype != torch.int64
                     or unfinished.device != dev or not unfinished.is_contiguous()
                     or pad is None or pad.numel() != 1 or pad.dtype != torch.int64 or pad.device != dev):
        raise ValueError(f"greedy_select: stop ids need unfinished ({rows},) int64 contiguous and a pad () int64, "
                         f"on {dev}")
    stop = _ids(stop_ids, dev, "stop_ids")
    suppress = _ids(suppress_ids, dev, "suppress_ids")
    if not kernel_runs_on(logits, tokens):
        raise ValueError(f"greedy_select: no Triton kernel runs on {dev} here")
    if config is not None and not (len(config) == 4 and all(isinstance(v, int) and v > 0 for v in config)
                                   and config[1] & (config[1] - 1) == 0):
        raise ValueError(f"greedy_select: config must be (segment, tile, warps, stages), positive ints with a "
                         f"power-of-2 tile, got {config!r}")
    if rows == 0:
        return tokens
    ws = workspace if workspace is not None else workspace_for(dev, rows)
    if ws.slots.numel() < rows:
        raise ValueError(f"greedy_select: a workspace of {ws.slots.numel()} rows for {rows} rows")
    segment, tile, warps, stages = config or config_for(rows)
    _greedy_select_kernel[(triton.cdiv(vocab, segment), rows)](
        logits, unfinished if has_stop else tokens, tokens, pad if has_stop else tokens, suppress, stop,
        ws.slots, ws.tickets,
        vocab, logits.stride(0), tokens.stride(0),
        N_SUPPRESS=suppress.numel(), N_STOP=stop.numel(), HAS_STOP=has_stop, EMPTY=EMPTY_KEY,
        SEGMENT=segment, TILE=min(tile, segment), STAGES=stages, num_warps=warps,
    )
    return tokens


def greedy_select_reference(logits, tokens, unfinished=None, pad=None, stop_ids=None, suppress_ids=None):
    """transformers' own steps, in torch (what ``greedy_select`` must equal)."""
    scores = logits.float()
    if suppress_ids is not None:
        vocab = torch.arange(scores.shape[-1], device=scores.device)
        scores = torch.where(torch.isin(vocab, suppress_ids), float("-inf"), scores)
    nxt = torch.argmax(scores, dim=-1)
    if stop_ids is not None:
        nxt = nxt * unfinished + pad * (1 - unfinished)
        unfinished.copy_(unfinished & ~torch.isin(nxt, stop_ids))
    tokens.copy_(nxt)
    return tokens


__all__ = ["MAX_IDS", "block_for", "config_for", "SelectWorkspace", "greedy_select", "greedy_select_reference",
           "workspace_for"]
