"""Per-request sampling for the continuous-batching engine.

transformers' engine samples every row of a step with one generation config. A server answers
requests that each ask for their own temperature, nucleus, penalties, seed and log-probabilities,
so fastlora takes the step's logits after the engine's own (greedy) selection and, for the rows
whose request asked for anything else, selects again:

- penalties (presence, frequency) over the tokens the request generated so far, as OpenAI defines them;
- temperature 0 keeps the argmax (of the penalised logits); otherwise the logits are divided by the
  temperature, cut to the top-k and to the nucleus (top-p), and a token is drawn with the Gumbel-max
  trick: ``argmax(z + g)`` with ``g`` Gumbel noise is an exact draw from ``softmax(z)``;
- the noise is a counter-based hash of (seed, position in the output, token id): a seeded request
  draws the same tokens whatever else shares its steps, and no generator state is kept;
- log-probabilities are those of the model's own distribution (``log_softmax`` of the raw logits),
  for the chosen token and the ``logprobs`` most likely ones.

Rows with no sampling parameters (or default ones: greedy, no penalty, no log-probabilities) keep
the engine's token: greedy requests stay equal to PEFT's greedy ``generate``.
"""

from __future__ import annotations

import math
import secrets
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request selects its tokens.

    Args:
        temperature: 0 for greedy (the argmax); above 0, the softmax temperature.
        top_p: nucleus: the smallest set of most likely tokens whose probability reaches it (1: all).
        top_k: the k most likely tokens only (0: all).
        seed: draws are a function of (seed, position, token): the same seed gives the same tokens.
            None: a random seed is drawn when the request is added.
        presence_penalty: subtracted from the logit of every token the request already generated.
        frequency_penalty: subtracted once per earlier occurrence in the request's output.
        logprobs: None for none; k >= 0: the chosen token's log-probability and the k most likely.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None

    def __post_init__(self):
        def number(name, low, high, low_open=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value < low or value > high or (low_open and value == low):
                raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")

        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, low_open=True)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        for name, high in (("top_k", 2**31 - 1), ("logprobs", MAX_LOGPROBS)):
            value = getattr(self, name)
            if value is None and name == "logprobs":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ValueError(f"{name} must be an integer in [0, {high}], got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Whether the engine's greedy token is the answer (nothing to redo)."""
        return (self.greedy and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and self.logprobs is None)

    def with_seed(self) -> "SamplingParams":
        """This, with a random seed where none was given (a sampled request needs one)."""
        if self.seed is not None or self.greedy:
            return self
        return SamplingParams(self.temperature, self.top_p, self.top_k, secrets.randbits(63),
                              self.presence_penalty, self.frequency_penalty, self.logprobs)


@dataclass
class TokenLogprobs:
    """The log-probability of one generated token and of the most likely alternatives."""

    token: int
    logprob: float
    top: List[Tuple[int, float]]


# ---- counter-based noise -----------------------------------------------------------------------
# splitmix64 over int64 tensors: multiplication wraps modulo 2**64 as in C, and right shifts are
# made logical by masking the sign extension away.
def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_POSITION_SALT = _signed(0x632BE59BD9B4E019)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise on an int64 tensor."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` uniforms in (0, 1), a pure function of each row's (seed, position) and
    the token id: splitmix64's stream seeded by the row, read at the token's index."""
    base = mix64(seeds.to(torch.int64) ^ mix64(positions.to(torch.int64) + _POSITION_SALT))
    tokens = torch.arange(1, vocab + 1, device=seeds.device, dtype=torch.int64)
    bits = _shift_right(mix64(base[:, None] + tokens[None, :] * _GOLDEN), 40)  # the top 24 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device``; to a GPU through pinned memory, so the engine
    thread does not wait for the GPU's queued work (the allocator keeps the pinned block until the
    copy is done)."""
    host = torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# ---- selection --------------------------------------------------------------------------------
def _penalise(logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]],
              last: Optional[torch.Tensor] = None):
    """Subtract each row's presence and frequency penalties over its earlier output tokens (and
    ``last[row]``, one more on the device, where it is >= 0)."""
    penalised = [bool(p.presence_penalty or p.frequency_penalty) for p in params]
    rows = [i for i, on in enumerate(penalised) if on and outputs[i]]
    if not rows and (last is None or not any(penalised)):
        return logits
    vocab, device = logits.shape[-1], logits.device
    flat = [r * vocab + t for r in rows for t in outputs[r] if 0 <= t < vocab]
    counts = torch.zeros(logits.numel(), dtype=logits.dtype, device=device)
    if flat:
        counts.index_add_(0, to_device(flat, torch.int64, device), torch.ones(len(flat), dtype=logits.dtype,
                                                                              device=device))
    if last is not None:
        take = (last >= 0) & (last < vocab) & to_device(penalised, torch.bool, device)
        at = torch.arange(len(params), device=device) * vocab + last.clamp(0, vocab - 1)
        counts.index_add_(0, at, take.to(logits.dtype))
    counts = counts.view(logits.shape)
    presence = to_device([p.presence_penalty for p in params], logits.dtype, device)
    frequency = to_device([p.frequency_penalty for p in params], logits.dtype, device)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def _cut(z: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``z`` with the tokens outside each row's top-k and nucleus at -inf."""
    vocab = z.shape[-1]
    limited = [0 < p.top_k < vocab for p in params]
    if any(limited):
        widest = max(p.top_k for p, cut in zip(params, limited) if cut)
        index = to_device([p.top_k - 1 if cut else 0 for p, cut in zip(params, limited)], torch.int64, z.device)
        kth = torch.topk(z, widest, dim=-1).values.gather(1, index[:, None])
        kth = kth.masked_fill(~to_device(limited, torch.bool, z.device)[:, None], float("-inf"))
        z = z.masked_fill(z < kth, float("-inf"))  # ties with the k-th are kept
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        limit = to_device(top_p, probs.dtype, z.device)[:, None]
        drop_sorted = before >= limit
        drop_sorted[:, 0] = False  # the most likely token stays (a top_p below float32's range is 0)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def select(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
           outputs: Sequence[Sequence[int]], last: Optional[torch.Tensor] = None
           ) -> Tuple[torch.Tensor, List[Optional[TokenLogprobs]]]:
    """The next token of each row, and its log-probabilities where asked.

    Args:
        logits: ``[rows, vocab]`` float32, the model's raw logits.
        params: each row's ``SamplingParams`` (a sampled row's seed set).
        positions: each row's position in its output (tokens generated before this one).
        outputs: each row's output tokens so far (for the penalties).
        last: ``[rows]`` int64 on the logits' device, one more output token per row, after
            ``outputs`` (-1: none): one not read back from the device yet.
    Returns:
        ``[rows]`` int64 tokens on the logits' device, and per row a ``TokenLogprobs`` or None.
    """
    logits = logits.float()
    z = _penalise(logits, params, outputs, last)
    tokens = torch.argmax(z, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        device = logits.device
        rows = to_device(sampled, torch.int64, device)
        chosen = [params[i] for i in sampled]
        # each row shifted so that its largest logit is 0 and the temperature kept a normal float: a
        # tiny temperature then sends the other logits to -inf, never the largest to inf (or 0 / 0)
        temperature = to_device([p.temperature for p in chosen], z.dtype, device).clamp_min(torch.finfo(z.dtype).tiny)
        picked = z.index_select(0, rows)
        cut = _cut((picked - picked.amax(dim=-1, keepdim=True)) / temperature[:, None], chosen)
        seeds = to_device([p.seed for p in chosen], torch.int64, device)
        steps = to_device([positions[i] for i in sampled], torch.int64, device)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, z.shape[-1])))
        tokens = tokens.index_copy(0, rows, torch.argmax(cut + gumbel, dim=-1))
    return tokens, _logprobs(logits, tokens, params)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              params: Sequence[SamplingParams]) -> List[Optional[TokenLogprobs]]:
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: List[Optional[TokenLogprobs]] = [None] * len(params)
    if not asked:
        return out
    rows = torch.tensor(asked, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, rows)[:, None])[:, 0].tolist()
    k = max(params[i].logprobs for i in asked)
    top_values, top_ids = (torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    picked = tokens.index_select(0, rows).tolist()
    for j, i in enumerate(asked):
        n = params[i].logprobs
        out[i] = TokenLogprobs(picked[j], chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
    return out


# ---- per-request records ------------------------------------------------------------------------
class RequestSampling:
    """Request id -> ``SamplingParams`` and the log-probabilities produced so far, for one
    manager's requests (written from any thread, read by the engine's). A request without an
    entry keeps the engine's token."""

    def __init__(self):
        self._params: Dict[str, SamplingParams] = {}
        self._logprobs: Dict[str, List[TokenLogprobs]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._params)

    def assign(self, request_id: str, params: SamplingParams) -> None:
        if params.plain:
            return
        with self._lock:
            self._params[request_id] = params.with_seed()
            if params.logprobs is not None:
                self._logprobs[request_id] = []

    def params_of(self, request_ids: Sequence[str]) -> List[Optional[SamplingParams]]:
        with self._lock:
            return [self._params.get(rid) for rid in request_ids]

    def record(self, request_id: str, entry: TokenLogprobs) -> None:
        with self._lock:
            record = self._logprobs.get(request_id)
            if record is not None:
                record.append(entry)

    def logprobs(self, request_id: str, first: int = 0) -> List[TokenLogprobs]:
        """The request's log-probabilities from its ``first`` generated token on."""
        with self._lock:
            return list(self._logprobs.get(request_id, ())[first:])

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the parameters of requests that will not be stepped again (their log-probabilities
        stay until ``release``: the reader may not have read them yet)."""
        with self._lock:
            for rid in request_ids:
                self._params.pop(rid, None)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._params.pop(request_id, None)
            self._logprobs.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._params.clear()
            self._logprobs.clear()
