"""One completion of a request (a ``choice``) as the engine produces it: its tokens turned into
the text a client sees, stop strings and stop token ids applied, log-probabilities in OpenAI's
two formats, and the JSON of answers and stream chunks."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence

from ..compat.tokenizers import skip_special_decoder
from ..continuous.sampling import TokenLogprobs


_CONTEXT_TOKENS = 4  # tokens decoded before a window's new ones


class Choice:
    """Args:
        index: the choice's place in the answer.
        request_id: its engine request.
        prompt_tokens: its prompt's length.
        max_tokens: its limit.
        stop: stop strings (the text ends before the first one found).
        end_token_ids: the tokens that end it (EOS and the request's stop token ids); the text
            leaves the last one out.
        tokenizer: decodes its tokens.
    """

    def __init__(self, index: int, request_id: str, prompt_tokens: int, max_tokens: int, stop: Sequence[str],
                 end_token_ids: Sequence[int], tokenizer):
        self.index, self.request_id = index, request_id
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.stop, self.end_token_ids, self.tokenizer = list(stop), set(end_token_ids), tokenizer
        self._decode_ids = skip_special_decoder(tokenizer)
        self._token_texts: Dict[int, str] = {}  # each token's text alone: its offset, then its entry
        self.tokens: List[int] = []
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.accepted = time.perf_counter()
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None
        self._sent = ""  # text already streamed
        self._logprobs_sent = 0
        self.logprobs_offset = 0  # the text offset of the next entry ``new_logprobs`` returns
        self._logprobs_end: Optional[int] = None  # the entries of an answer cut at a stop string
        # streamed with stop strings, a token's entry waits until the text it begins in is sent:
        # (kept tokens, their text's length) of the decodes whose text is not all sent yet (token
        # k begins where the first k end), and how many tokens begin in the text sent
        self._starts = deque([(0, 0)])
        self._logprobs_ready = 0
        # incremental decoding: the text of the kept tokens before ``_read`` is ``_committed``;
        # each new token decodes a short window from ``_prefix`` (a few tokens back, so that a
        # tokenizer joining words sees their context) instead of the whole completion
        self._prefix = self._read = 0
        self._committed = ""
        self._before: Optional[str] = None  # the text of the tokens from ``_prefix`` to ``_read``
        self._seen = (0, "")  # (kept tokens, their text) of the last decode
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string may still be forming

    def update(self, tokens: Sequence[int], engine_finished: bool, error: Optional[str]) -> bool:
        """Take the engine's output; True when the choice just finished (by a stop string here
        while the engine goes on, the caller cancels its request). A list of ``tokens`` is kept,
        not copied (each engine output holds a list of its own, which nothing changes after): a
        copy would cost each token the length of the whole completion."""
        if self.finished:
            return False
        now = time.perf_counter()
        had = len(self.tokens)
        if len(tokens) > had:
            self.first_token = self.first_token or now
            self.last_token = now
        self.tokens = tokens if type(tokens) is list else list(tokens)
        if error is not None:
            self.finished, self.error = True, error
            return True
        if self.stop and self._stop_index(self._decoded()) is not None:
            self._end_at_stop(had)
            self.finished, self.finish_reason = True, "stop"
            return True
        if engine_finished:
            self.finished = True
            self.finish_reason = "stop" if self.tokens and self.tokens[-1] in self.end_token_ids else "length"
            return True
        return False

    def _end_at_stop(self, had: int) -> None:
        """Keep the tokens up to the first whose text completes a stop string (of those after the
        first ``had``): the engine's outputs may arrive several tokens at a time, and the answer's
        tokens, usage and log-probabilities must not depend on how far its reader fell behind."""
        kept = self._kept_tokens()
        hi = len(kept)  # the text of kept[:hi] holds a stop string (so does any longer prefix's)
        lo = min(had + 1, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._stop_index(self._decode(kept[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        self.tokens = self.tokens[:hi]
        self._logprobs_end = self._covering(kept[:hi], self._cut(self._decode(kept[:hi])))

    def _covering(self, tokens: Sequence[int], text: str) -> int:
        """How many of ``tokens`` begin before the end of ``text`` (their text's prefix): the fewest
        whose text starts with it."""
        lo, hi = 0, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._decode(tokens[:mid]).startswith(text):
                hi = mid
            else:
                lo = mid + 1
        return hi

    # -- text ------------------------------------------------------------------------------------
    def _kept_tokens(self) -> List[int]:
        tokens = self.tokens
        if tokens and tokens[-1] in self.end_token_ids:
            tokens = tokens[:-1]
        return tokens

    def _decode(self, tokens) -> str:
        return self._decode_ids(tokens)

    def _decoded(self) -> str:
        """The text of the kept tokens, decoded incrementally (a window of new tokens a call, not
        the whole completion: the cost of a token stays flat however long the answer grows). A
        window ending in an incomplete character is not committed until the character is whole."""
        kept = self._kept_tokens()
        if len(kept) == self._seen[0]:
            return self._seen[1]
        if len(kept) < self._read:  # cannot happen (tokens only grow): decode afresh
            self._prefix = self._read = 0
            self._committed, self._before = "", None
        if self._before is None:  # the context's text, the same until the next commit
            self._before = self._decode(kept[self._prefix:self._read])
        window = self._decode(kept[self._prefix:])
        text = self._committed + window[len(self._before):]
        if not window.endswith("\ufffd"):
            self._committed, self._before = text, None
            self._prefix, self._read = max(self._read - _CONTEXT_TOKENS, 0), len(kept)
        self._seen = (len(kept), text)
        return text

    def _stop_index(self, text: str) -> Optional[int]:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _cut(self, text: str) -> str:
        cut = self._stop_index(text) if self.stop else None
        return text if cut is None else text[:cut]

    def text(self) -> str:
        """The answer's text: once finished, the whole completion decoded at once (exact whatever
        the tokenizer does at window edges); before, the streamed text."""
        if self.finished:
            return self._cut(self._decode(self._kept_tokens()))
        return self._cut(self._decoded())

    def new_text(self) -> str:
        """What the streamed text gained since the last call, holding back what a stop string or
        an incomplete character may still change."""
        new = self._release()
        if self.stop and not self.finished:  # (finished, ``new_logprobs`` knows where the text ends)
            if not self._starts or self._read > self._starts[-1][0]:  # the last decode's committed tokens
                self._starts.append((self._read, len(self._committed)))
            while self._starts and self._starts[0][1] < len(self._sent):
                self._logprobs_ready = max(self._logprobs_ready, self._starts.popleft()[0] + 1)
        return new

    def _release(self) -> str:
        text = self._cut(self._decoded())
        if not self.finished:
            if text.endswith("\ufffd"):
                return ""
            text = text[:len(text) - self._hold] if self._hold else text
        if not text.startswith(self._sent) or len(text) <= len(self._sent):
            return ""
        new, self._sent = text[len(self._sent):], text
        return new

    # -- accounting ------------------------------------------------------------------------------
    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    def time_per_output_token(self) -> Optional[float]:
        if self.first_token is None or len(self.tokens) < 2:
            return None
        return (self.last_token - self.first_token) / (len(self.tokens) - 1)

    def new_logprobs(self, entries: Sequence[TokenLogprobs]) -> List[TokenLogprobs]:
        """The entries of the tokens not reported yet (``entries``: the request's from its first
        token; streamed, call it after ``new_text``).

        The entries describe the answer's text: an end token has none, and an answer cut at a stop
        string keeps those of the tokens whose text begins before the cut (the one straddling it
        included; those wholly inside the stop string or after it dropped): the fewest tokens whose
        decoded text starts with the answer's. Where each token decodes alone to its part of the
        text, every text offset then lies in the text and the tokens' texts joined start with it.
        ``usage`` still counts the tokens generated, up to the one that completed the stop string.
        Streamed with stop strings, an entry waits until the text its token begins in is sent, as
        that text waits for a stop string that may still form: the entries streamed are the
        answer's."""
        limit = self._logprobs_end if self._logprobs_end is not None else len(self._kept_tokens())
        if self.stop and not self.finished:
            limit = min(limit, self._logprobs_ready)
        new = list(entries[self._logprobs_sent:limit])
        self._logprobs_sent += len(new)
        self.logprobs_offset += sum(len(self.token_text(e.token)) for e in new)
        return new

    def token_text(self, token: int) -> str:
        """A token's text decoded alone (a log-probability entry's text and offset), once."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text


def chat_logprobs(entries: Sequence[TokenLogprobs], tokenizer, token_text: Optional[Callable] = None) -> dict:
    token_text = token_text or (lambda t: tokenizer.decode([t]))

    def one(token, logprob):
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for e in entries:
        item = one(e.token, e.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprobs], tokenizer, offset: int = 0,
                        token_text: Optional[Callable] = None) -> dict:
    """OpenAI's completion format; a token's ``text_offset`` is ``offset`` plus the lengths of the
    texts of the tokens before it, each decoded alone (as vLLM counts). ``token_text``: a token's
    text, where the caller keeps them (default: decoded here)."""
    token_text = token_text or (lambda t: tokenizer.decode([t]))
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_text(e.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


class Answer:
    """The OpenAI JSON of one request's choices."""

    def __init__(self, request_id: str, model_name: str, chat: bool, tokenizer):
        self.id, self.model_name, self.chat, self.tokenizer = request_id, model_name, chat, tokenizer
        self.created = int(time.time())
        # a stream's text chunks differ only in their index and text: the JSON around them is
        # rendered once, as ``json.dumps`` renders it (``text_event``)
        self._text_head = json.dumps(self._envelope())[:-1] + ', "choices": [{"index": '
        self._text_mid = ', "delta": {"content": ' if chat else ', "text": '
        self._text_tail = ('}' if chat else '') + ', "logprobs": null, "finish_reason": null}]}\n\n'

    def logprobs(self, entries: Optional[Sequence[TokenLogprobs]], offset: int = 0,
                 token_text: Optional[Callable] = None):
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.tokenizer, token_text)
        return completion_logprobs(entries, self.tokenizer, offset, token_text)

    def whole(self, choices: Sequence[Choice], prompt_tokens: int, logprobs) -> dict:
        out = []
        for c in choices:
            lp = self.logprobs(logprobs.get(c.index), 0, c.token_text) if logprobs is not None else None
            if self.chat:
                item = {"index": c.index, "message": {"role": "assistant", "content": c.text()}, "logprobs": lp}
            else:
                item = {"index": c.index, "text": c.text(), "logprobs": lp}
            item["finish_reason"] = c.finish_reason
            out.append(item)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": out,
                "usage": usage(prompt_tokens, choices)}

    def chunk(self, index: int, text: Optional[str], finish_reason: Optional[str], logprobs=None,
              role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._envelope(), "choices": [choice]}

    def text_event(self, index: int, text: str) -> str:
        """``event(self.chunk(index, text, None))``, the same bytes: a streamed chunk of text
        without log-probabilities, the one event a streamed token costs."""
        return f"data: {self._text_head}{index}{self._text_mid}{json.dumps(text)}{self._text_tail}"

    def usage_chunk(self, prompt_tokens: int, choices: Sequence[Choice]) -> dict:
        return {**self._envelope(), "choices": [], "usage": usage(prompt_tokens, choices)}

    def _envelope(self) -> dict:
        """The fields every stream chunk starts with."""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name}


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict:
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
