"""An OpenAI-compatible HTTP endpoint for many adapters, over transformers' continuous batching.

``create_app(model, tokenizer)`` returns a FastAPI app: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streaming and not), ``GET /v1/models``, ``GET /health``. The
request's ``"model"`` names the adapter (``base_name`` for none), as multi-LoRA servers do. One
continuous-batching manager (the patched model's, see ``continuous/engine.py``) serves every
request; it starts and stops with the app.

transformers' own ``serve`` is not extended: it loads models by id, keeps one manager per model id
(switching adapters would restart it) and passes nothing per request but the token ids.

Decoding follows the server's ``generation_config``: a request that asks for other sampling
settings, several choices, stop strings or log-probabilities is refused (400), never answered with
settings it did not ask for.
"""


import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Optional

from .. import _compat

BASE = "__base__"
_UNSUPPORTED = ("stop", "logprobs", "top_logprobs", "logit_bias", "tools", "functions", "suffix", "echo",
                "best_of", "presence_penalty", "frequency_penalty", "seed", "response_format")


class RequestError(Exception):
    """A bad request: HTTP status, OpenAI error type and code."""

    def __init__(self, message: str, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.code = status, code


def create_app(model, tokenizer, *, generation_config=None, continuous_batching_config=None,
               base_name: str = "base", max_tokens_default: int = 16, adapters=None):
    """The app serving a ``fastlora.patch``-ed PeftModel's adapters.

    Args:
        model: the patched model (its continuous batching takes one adapter per request).
        tokenizer: encodes prompts and chat messages (``apply_chat_template``), decodes outputs.
        generation_config: how every request decodes (default: the model's, greedy if unset).
        continuous_batching_config: the engine's sizes (see transformers' ``ContinuousBatchingConfig``).
        base_name: the ``"model"`` that means no adapter.
        max_tokens_default: ``max_tokens`` of a request that sets none (OpenAI's default is 16).
        adapters: the adapter names served (default: every adapter of the model, PEFT's and the
            registered ones); others are answered like unknown ones.
    """
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse
    except ImportError as e:
        raise ImportError("the HTTP endpoint needs fastapi and uvicorn: pip install 'peft-fastlora[serve]'") from e
    from ..patch import get_state

    state = get_state(model)
    if state is None or state.continuous is None or state.continuous.blocker is not None:
        why = "the model is not patched" if state is None or state.continuous is None else state.continuous.blocker
        raise ValueError(f"create_app needs a fastlora-patched model with continuous batching on ({why})")
    gen = generation_config if generation_config is not None else model.generation_config
    if getattr(gen, "eos_token_id", None) is None:
        gen.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
    server = _Server(model, tokenizer, gen, base_name, max_tokens_default, adapters)

    @asynccontextmanager
    async def lifespan(app):
        server.manager = model.init_continuous_batching(generation_config=gen,
                                                        continuous_batching_config=continuous_batching_config)
        server.manager.start()
        try:
            yield
        finally:
            server.manager.stop(block=True, timeout=30)

    app = FastAPI(title="peft_fastlora", lifespan=lifespan)
    app.state.fastlora = server

    @app.exception_handler(RequestError)
    async def bad_request(request, exc: RequestError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse({"error": {"message": str(exc), "type": kind, "code": exc.code, "param": None}},
                            status_code=exc.status)

    @app.get("/health")
    async def health():
        running = server.manager is not None and server.manager.is_running()
        return JSONResponse({"status": "ok" if running else "down"}, status_code=200 if running else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "peft_fastlora"}
            for name in [base_name] + server.adapters()]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise RequestError("prompt must be a string or a list of token ids (one prompt per request)")
        return await server.answer(request, body, ids, chat=False, streaming=StreamingResponse)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("this server's tokenizer has no chat template: use /v1/completions")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return await server.answer(request, body, list(ids), chat=True, streaming=StreamingResponse)

    return app


async def _json(request) -> dict:
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


class _Server:
    """The manager and everything a request needs besides the HTTP layer."""

    def __init__(self, model, tokenizer, gen, base_name, max_tokens_default, adapters=None):
        self.model, self.tokenizer, self.gen = model, tokenizer, gen
        self.base_name, self.max_tokens_default = base_name, max_tokens_default
        self.served = None if adapters is None else sorted(adapters)
        self.manager = None

    def adapters(self):
        from ..patch import get_state

        if self.served is not None:
            return self.served
        state = get_state(self.model)
        registered = state.stored if state is not None else ()
        return sorted(set(getattr(self.model, "peft_config", None) or ()) | set(registered))

    def adapter_of(self, name) -> str:
        if name == self.base_name:
            return BASE
        if not isinstance(name, str) or name not in self.adapters():
            raise RequestError(f"The model {name!r} does not exist: this server has {self.base_name!r} and "
                               f"the adapters {', '.join(self.adapters()) or '(none)'}", 404, "model_not_found")
        return name

    def check_options(self, body: dict) -> int:
        """max_tokens of the request; 400 for what this server cannot honour."""
        asked = [k for k in _UNSUPPORTED if body.get(k) not in (None, False, [], {})]
        if int(body.get("n", 1) or 1) != 1:
            asked.append("n")
        sampling = bool(getattr(self.gen, "do_sample", False))
        for key, mine in (("temperature", self.gen.temperature if sampling else 0.0),
                          ("top_p", self.gen.top_p if sampling else 1.0)):
            value = body.get(key)
            if value is not None and not (float(value) == float(mine) or (not sampling and key == "top_p")):
                asked.append(f"{key}={value} (this server decodes with {key}={mine})")
        if asked:
            raise RequestError("not supported by this server: " + ", ".join(asked))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        limit = self.max_tokens_default if limit is None else limit
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {limit!r}")
        return limit

    async def answer(self, request, body, ids, chat: bool, streaming):
        adapter = self.adapter_of(body.get("model"))
        max_tokens = self.check_options(body)
        if not ids:
            raise RequestError("the prompt is empty")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        results: asyncio.Queue = asyncio.Queue()
        manager = self.manager
        # the handler first: a request that finishes at once must still find it
        manager.register_result_handler(rid, results.put_nowait)
        try:
            # add_request may wait for room in the engine's queue: off the event loop
            added = await asyncio.to_thread(manager.add_request, ids, request_id=rid, max_new_tokens=max_tokens,
                                            streaming=bool(body.get("stream")), adapter_name=adapter)
        except BaseException:
            _compat.cb_drop_result_handler(manager, rid)
            raise
        if added is None:
            _compat.cb_drop_result_handler(manager, rid)
            raise RequestError("the server is shutting down", 503)
        reply = _Reply(rid, body["model"], chat, len(ids), max_tokens, self.tokenizer)
        if body.get("stream"):
            return streaming(self._stream(request, rid, results, reply), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
        return await self._whole(request, rid, results, reply)

    def _cancel(self, rid):
        self.manager.cancel_request(rid)
        _compat.cb_drop_result_handler(self.manager, rid)

    async def _next(self, request, rid, results):
        """The next output of ``rid``; None when the client went away (the request is cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(results.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self._cancel(rid)
                    return None

    async def _whole(self, request, rid, results, reply):
        while True:
            out = await self._next(request, rid, results)
            if out is None:
                return None
            if out.is_finished():
                if out.error is not None:
                    raise RequestError(f"generation failed: {out.error}", 500)
                return reply.whole(out.generated_tokens)

    async def _stream(self, request, rid, results, reply):
        finished = False
        try:
            if reply.chat:
                yield reply.event(reply.chunk({"role": "assistant", "content": ""}, None))
            while not finished:
                out = await self._next(request, rid, results)
                if out is None:
                    return
                finished = out.is_finished()
                if finished and out.error is not None:
                    yield reply.event({"error": {"message": f"generation failed: {out.error}",
                                                 "type": "server_error"}})
                    return
                text = reply.new_text(out.generated_tokens)
                if text:
                    yield reply.event(reply.chunk(text, None))
                if finished:
                    yield reply.event(reply.chunk("" if not reply.chat else {}, reply.finish_reason(out.generated_tokens),
                                                  usage=reply.usage(out.generated_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the send failed): stop generating for it
                self._cancel(rid)


class _Reply:
    """The OpenAI JSON of one request."""

    def __init__(self, rid, model_name, chat, prompt_tokens, max_tokens, tokenizer):
        self.rid, self.model_name, self.chat = rid, model_name, chat
        self.prompt_tokens, self.max_tokens, self.tokenizer = prompt_tokens, max_tokens, tokenizer
        self.created = int(time.time())
        self._sent = ""

    def finish_reason(self, tokens) -> str:
        return "length" if len(tokens) >= self.max_tokens else "stop"

    def usage(self, tokens) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(tokens),
                "total_tokens": self.prompt_tokens + len(tokens)}

    def text(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def new_text(self, tokens) -> str:
        """What the decoded text gained since the last chunk (held back while a character is
        incomplete: decoding a prefix may end in a replacement character)."""
        text = self.text(tokens)
        if text.endswith("\ufffd") or not text.startswith(self._sent):
            return ""
        new, self._sent = text[len(self._sent):], text
        return new

    def whole(self, tokens) -> dict:
        text = self.text(tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = self.finish_reason(tokens)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": [choice],
                "usage": self.usage(tokens)}

    def chunk(self, content, finish_reason, usage=None) -> dict:
        if self.chat:
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        out = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"
