"""Completions and chat completions: a validated request turned into engine requests (one per
choice), checked against the model's limits before anything is queued, and answered whole or as a
stream of server-sent events."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from typing import Dict, List, Optional, Sequence

from ..compat.engine import cb_active_count, cb_drop_result_handler
from ..compat.modules import input_vocab_size, position_limit
from ..continuous.sampling import SamplingParams
from .adapters import AdapterCatalog
from .choices import Answer, Choice, event
from .config import ServerConfig
from .errors import APIError, engine_failure
from .metrics import Metrics
from .schemas import ChatCompletionRequest, CompletionRequest
from .supervisor import EngineSupervisor

# fields of a generation config that would make the engine process every row's logits: the
# per-request sampling replaces the engine's, so a server refuses to start with them set
_ENGINE_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                      "min_new_tokens": None, "min_length": 0, "suppress_tokens": None,
                      "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                      "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None,
                      "encoder_repetition_penalty": 1.0, "sequence_bias": None, "num_beams": 1,
                      "num_return_sequences": 1, "renormalize_logits": False,
                      "exponential_decay_length_penalty": None, "watermarking_config": None}
_POLL_S = 0.5  # how often a whole (not streamed) answer checks that its client is still there
# prompts of more characters than this are tokenized on one thread of their own, one at a time:
# a few bodies of megabytes would otherwise hold every worker thread the event loop shares
# (every other request's tokenization and submission) for seconds
_LARGE_PROMPT_CHARS = 1 << 16


def default_sampling(generation_config) -> SamplingParams:
    """What a request that sets no sampling field gets: the server's generation config."""
    unsupported = [f"{k}={getattr(generation_config, k)!r}" for k, neutral in _ENGINE_PROCESSORS.items()
                   if getattr(generation_config, k, None) not in (None, neutral)]
    if unsupported:
        raise ValueError("create_app: the generation config sets " + ", ".join(unsupported) + ", which the "
                         "endpoint's per-request sampling does not apply; leave them unset")
    if not getattr(generation_config, "do_sample", False):
        return SamplingParams()
    top_k = generation_config.top_k
    return SamplingParams(temperature=float(generation_config.temperature or 1.0),
                          top_p=float(generation_config.top_p or 1.0), top_k=int(top_k or 0))


class CompletionService:
    """Args:
        model: the patched model. tokenizer: encodes prompts and messages, decodes outputs.
        config: the server's settings. catalog: the adapters served. supervisor: the engine.
        metrics: the instruments. defaults: the sampling of a request that sets none.
        eos_token_ids: the tokens that end every completion.
    """

    def __init__(self, model, tokenizer, config: ServerConfig, catalog: AdapterCatalog,
                 supervisor: EngineSupervisor, metrics: Metrics, defaults: SamplingParams,
                 eos_token_ids: Sequence[int]):
        self.tokenizer, self.config, self.catalog = tokenizer, config, catalog
        self.supervisor, self.metrics, self.defaults = supervisor, metrics, defaults
        self.eos_token_ids = [int(t) for t in eos_token_ids if t is not None and int(t) >= 0]
        self.vocab = input_vocab_size(model)
        self.position_limit = position_limit(model)
        self.pending = 0  # choices accepted and not finished
        self._large: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # read when scraped: a whole answer's choices deliver nothing before they end, so the
        # engine's batch tells which of them run
        metrics.running.set_function(self.running)
        metrics.waiting.set_function(lambda: self.pending - self.running())

    def running(self) -> int:
        """The choices in flight that the engine holds in its batch (the others wait in its queue)."""
        manager = self.supervisor.manager
        return min(self.pending, cb_active_count(manager)) if manager is not None else 0

    def context_length(self) -> int:
        """The most tokens (prompt and completion) one request may hold."""
        limits = [n for n in (self.supervisor.cache_tokens, self.position_limit, self.config.max_model_len) if n]
        return min(limits)

    # -- from a request to choices -------------------------------------------------------------
    async def completions(self, request, body: CompletionRequest):
        self._refuse_unsupported(body)
        adapter = self.catalog.adapter_of(body.model)
        batch = isinstance(body.prompt, list) and bool(body.prompt) and not isinstance(body.prompt[0], int)
        self._check_choices((len(body.prompt) if batch else 1) * body.n)  # before tokenizing them all
        chars = len(body.prompt) if isinstance(body.prompt, str) else \
            sum(len(p) for p in body.prompt if isinstance(p, (str, list)))
        prompts = await self._tokenize(chars, self._completion_prompts, body.prompt)
        return await self._run(request, body, adapter, prompts, chat=False, logprobs=body.logprobs)

    async def chat(self, request, body: ChatCompletionRequest):
        self._refuse_unsupported(body)
        adapter = self.catalog.adapter_of(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError("this server's tokenizer has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await self._tokenize(sum(len(m["content"]) for m in messages) + len(messages), self._chat_prompt,
                                   messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await self._run(request, body, adapter, [ids], chat=True, logprobs=logprobs,
                               max_tokens=body.max_completion_tokens or body.max_tokens)

    async def _tokenize(self, chars: int, fn, *args):
        """``fn(*args)`` off the event loop: on the shared worker threads, or past
        ``_LARGE_PROMPT_CHARS`` on the one thread of large prompts."""
        if chars <= _LARGE_PROMPT_CHARS:
            return await asyncio.to_thread(fn, *args)
        if self._large is None:
            self._large = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastlora-large-prompts")
        return await asyncio.get_running_loop().run_in_executor(self._large, fn, *args)

    @staticmethod
    def _refuse_unsupported(body) -> None:
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError("not supported by this server: " + ", ".join(unsupported), param=unsupported[0])
        if body.stream_options is not None and not body.stream:  # (as OpenAI's API answers it)
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def _completion_prompts(self, prompt) -> List[List[int]]:
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of "
                           "such lists, and not empty", param="prompt")
        for i, ids in enumerate(prompts):
            if not ids:
                raise APIError(f"prompt {i} is empty", param="prompt")
            bad = next((t for t in ids if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise APIError(f"prompt {i} has token id {bad}, outside the vocabulary [0, {self.vocab})",
                               param="prompt")
        return prompts

    def _encode(self, text: str) -> List[int]:
        try:
            return list(self.tokenizer(text)["input_ids"])
        except Exception as e:  # noqa: BLE001  (lone surrogates and the like: the client's text)
            raise APIError(f"the prompt could not be tokenized ({type(e).__name__})", param="prompt") from None

    def _chat_prompt(self, messages: list) -> List[int]:
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001  (a template that refuses the conversation, bad text)
            raise APIError(f"the messages could not be formatted with the chat template: "
                           f"{engine_failure(str(e)) or type(e).__name__}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if not ids:
            raise APIError("the messages formatted to an empty prompt", param="messages")
        return list(ids)

    def _limits(self, prompts: List[List[int]], asked: Optional[int]) -> int:
        context = self.context_length()
        longest = max(len(p) for p in prompts)
        if asked is not None:
            if longest + asked > context:
                raise APIError(f"This model's maximum context length is {context} tokens. However, you requested "
                               f"{longest + asked} tokens ({longest} in the prompt, {asked} in the completion). "
                               "Please reduce the prompt or the completion.", param="max_tokens",
                               code="context_length_exceeded")
            return asked
        if longest >= context:
            raise APIError(f"This model's maximum context length is {context} tokens. However, the prompt has "
                           f"{longest} tokens, which leaves none for the completion.", param="prompt",
                           code="context_length_exceeded")
        return min(self.config.max_tokens_default, context - longest)

    def _sampling(self, body, logprobs: Optional[int], n_choices: int) -> List[SamplingParams]:
        d = self.defaults
        top_k = d.top_k if body.top_k is None else max(body.top_k, 0)
        common = dict(temperature=d.temperature if body.temperature is None else body.temperature,
                      top_p=d.top_p if body.top_p is None else body.top_p, top_k=top_k,
                      presence_penalty=body.presence_penalty or 0.0,
                      frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs)
        try:
            if body.seed is None:
                return [SamplingParams(**common) for _ in range(n_choices)]
            # choice i of a seeded request: the seed + i, kept in int64
            return [SamplingParams(seed=(body.seed + i + 2**63) % 2**64 - 2**63, **common) for i in range(n_choices)]
        except ValueError as e:
            raise APIError(str(e)) from None

    def _check_choices(self, n_choices: int) -> None:
        if n_choices > self.config.max_choices:
            raise APIError(f"{n_choices} completions asked (prompts x n); this server answers at most "
                           f"{self.config.max_choices} per request", param="n")

    def _check_pending(self, n_choices: int) -> None:
        if self.pending + n_choices > self.config.max_pending:
            raise APIError("the server is at its limit of requests in flight; retry later", 429,
                           headers={"Retry-After": "1"})

    def _stops(self, body) -> tuple:
        stop = body.stop_strings()
        ids = list(body.stop_token_ids or [])
        if len(stop) + len(ids) > self.config.max_stop:
            raise APIError(f"at most {self.config.max_stop} stop strings and stop token ids", param="stop")
        if any(not s for s in stop):
            raise APIError("stop strings must not be empty", param="stop")
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise APIError(f"stop token id {bad} is outside the vocabulary [0, {self.vocab})", param="stop_token_ids")
        return stop, ids

    # -- running choices ---------------------------------------------------------------------------
    async def _run(self, request, body, adapter: str, prompts: List[List[int]], chat: bool,
                   logprobs: Optional[int], max_tokens: Optional[int] = None):
        max_tokens = self._limits(prompts, max_tokens if chat else body.max_tokens)
        n_choices = len(prompts) * body.n
        self._check_choices(n_choices)
        stop, stop_ids = self._stops(body)
        sampling = self._sampling(body, logprobs, n_choices)
        self._check_pending(n_choices)
        manager = await self.supervisor.manager_for_request()
        self._check_pending(n_choices)  # again: others may have been accepted while a restart was waited for
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        run = _Run(self, manager, rid, Answer(rid, body.model, chat, self.tokenizer), adapter, logprobs is not None)
        end_ids = self.eos_token_ids + stop_ids
        for i in range(n_choices):
            ids = prompts[i // body.n]
            run.choices.append(Choice(i, f"{rid}-{i}", len(ids), max_tokens, stop, end_ids, self.tokenizer))
        run.prompt_tokens = sum(len(p) for p in prompts)
        await run.submit(prompts, body.n, sampling, streamed=bool(body.stream or stop), end_ids=end_ids)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return run.stream(request, include_usage)
        return await run.whole(request)


class _Run:
    """The choices of one request in the engine, from submission to their end."""

    def __init__(self, service: CompletionService, manager, rid: str, answer: Answer, adapter: str,
                 logprobs: bool):
        self.service, self.manager, self.rid, self.answer = service, manager, rid, answer
        self.adapter, self.want_logprobs = adapter, logprobs
        self.choices: List[Choice] = []
        self.prompt_tokens = 0
        # each choice's newest engine output not yet taken: an output holds the whole completion so
        # far, so a newer one replaces it and a client that stops reading holds one output a choice
        # (a queue of every step's output would grow with the square of the completion's length)
        self._latest: Dict[int, object] = {}
        self._arrived = asyncio.Event()
        self._open: Dict[str, Choice] = {}  # choices accepted and not ended

    async def submit(self, prompts, n: int, sampling: List[SamplingParams], streamed: bool, end_ids) -> None:
        metrics, manager = self.service.metrics, self.manager
        for choice in self.choices:  # the handlers first: a request that ends at once must find one
            manager.register_result_handler(choice.request_id, lambda out, i=choice.index: self.deliver(i, out))
            self._open[choice.request_id] = choice
        self.service.pending += len(self.choices)
        metrics.prompt_tokens.inc(self.prompt_tokens)
        try:
            for choice in self.choices:
                ids = prompts[choice.index // n]
                try:
                    added = await asyncio.to_thread(
                        manager.add_request, ids, request_id=choice.request_id, max_new_tokens=choice.max_tokens,
                        streaming=streamed, record_timestamps=True, eos_token_id=list(end_ids) or None,
                        adapter_name=self.adapter, sampling=sampling[choice.index])
                except ValueError:  # the adapter was unloaded since the request was validated
                    raise APIError(f"The model {self.answer.model_name!r} does not exist (any more)", 404,
                                   code="model_not_found", param="model") from None
                if added is None:  # the manager refuses: it is stopping, or died just now
                    raise APIError("the engine is restarting; try again shortly", 503, headers={"Retry-After": "5"})
        except BaseException:
            self.close("cancelled")
            raise

    def _end(self, choice: Choice, outcome: str) -> None:
        if self._open.pop(choice.request_id, None) is None:
            return
        metrics = self.service.metrics
        self.service.pending -= 1
        metrics.completions.labels(outcome).inc()
        metrics.generation_tokens.inc(choice.completion_tokens)
        if choice.first_token is not None:
            metrics.latency.observe(choice.last_token - choice.accepted)
            per_token = choice.time_per_output_token()
            if per_token is not None:
                metrics.tpot.observe(per_token)
        records = getattr(self.manager, "fastlora_sampling", None)
        if records is not None:
            records.release(choice.request_id)
        if outcome == "ok":
            self.service.supervisor.served_one()

    def close(self, outcome: str) -> None:
        """End every open choice: cancelled in the engine (the client went away, or one failed)."""
        for choice in list(self._open.values()):
            self.manager.cancel_request(choice.request_id)
            cb_drop_result_handler(self.manager, choice.request_id)
            self._end(choice, outcome)

    def _take(self, index: int, out) -> Choice:
        """Apply one engine output to its choice."""
        choice = self.choices[index]
        had_token = choice.first_token is not None
        timestamps = getattr(out, "timestamps", None)
        ended = choice.update(out.generated_tokens, out.is_finished(),
                              None if out.error is None else engine_failure(out.error))
        if timestamps:  # the engine's own time of the first token
            choice.first_token, choice.last_token = timestamps[0], timestamps[-1]
        if not had_token and choice.first_token is not None:
            self.service.metrics.ttft.observe(max(0.0, choice.first_token - choice.accepted))
        if ended and not out.is_finished():  # a stop string: the engine would go on
            self.manager.cancel_request(choice.request_id)
            cb_drop_result_handler(self.manager, choice.request_id)
        return choice

    def _failure(self, choice: Choice) -> APIError:
        if self.service.supervisor.status == "stopping":
            return APIError("the server shut down before this request completed", 503)
        if self.adapter != "__base__" and self.service.catalog.was_unloaded(self.adapter):
            return APIError(f"adapter {self.adapter!r} was unloaded while this request was in flight", 409,
                            code="adapter_unloaded")
        return APIError(f"generation failed: {choice.error}", 500, code="generation_failed")

    def _logprobs_of(self, choice: Choice):
        if not self.want_logprobs:
            return None
        records = getattr(self.manager, "fastlora_sampling", None)
        return choice.new_logprobs(records.logprobs(choice.request_id) if records is not None else [])

    def deliver(self, index: int, out) -> None:
        """The engine's result handler (on the event loop): choice ``index``'s newest output."""
        self._latest[index] = out
        self._arrived.set()

    async def _arrivals(self, request):
        """Every choice's newest output since the last call, as (index, output), waiting for one
        where none has come; None when the client went away. (``request`` None: a stream, which a
        send to a client that went away ends.)"""
        while not self._latest:  # (no timer when one is waiting: the common case under load)
            self._arrived.clear()
            if request is None:
                await self._arrived.wait()
                continue
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
        items, self._latest = list(self._latest.items()), {}
        return items

    async def whole(self, request) -> dict:
        logprobs = {} if self.want_logprobs else None
        try:
            while self._open:
                items = await self._arrivals(request)
                if items is None:
                    self.close("cancelled")
                    return None
                for item in items:
                    choice = self._take(*item)
                    if choice.finished and choice.request_id in self._open:
                        if choice.error is not None:
                            self._end(choice, "failed")
                            raise self._failure(choice)
                        if logprobs is not None:  # read before _end lets the records go
                            logprobs[choice.index] = self._logprobs_of(choice)
                        self._end(choice, "ok")
            return self.answer.whole(self.choices, self.prompt_tokens, logprobs)
        finally:
            self.close("cancelled")

    async def stream(self, request, include_usage: bool):
        answer, done = self.answer, False
        try:
            if answer.chat:
                for choice in self.choices:
                    yield event(answer.chunk(choice.index, None, None, role=True))
            while self._open:
                # a stream that fell behind the engine catches up in one chunk a choice, not one a token
                taken = [self._take(*item) for item in await self._arrivals(None)]  # (one output a choice)
                for choice in taken:
                    if choice.error is not None:
                        self._end(choice, "failed")
                        yield event(self._failure(choice).body())
                        yield "data: [DONE]\n\n"
                        return
                    # (entries may lag the text, held for a stop string: their offsets run on from those sent)
                    text, offset = choice.new_text(), choice.logprobs_offset
                    entries = self._logprobs_of(choice)
                    if entries is None and text:
                        yield answer.text_event(choice.index, text)
                    elif text or entries:
                        yield event(answer.chunk(choice.index, text, None,
                                                 answer.logprobs(entries, offset, choice.token_text)))
                    if choice.finished and choice.request_id in self._open:
                        self._end(choice, "ok")
                        yield event(answer.chunk(choice.index, None if answer.chat else "", choice.finish_reason))
            if include_usage:
                yield event(answer.usage_chunk(self.prompt_tokens, self.choices))
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:  # the client went away or the send failed: stop generating for it
                self.close("cancelled")
