"""An OpenAI-compatible HTTP endpoint for many adapters, over transformers' continuous batching.

``create_app(model, tokenizer)`` returns a FastAPI app: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed or not), ``GET /v1/models``, ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, ``GET /health`` and ``GET /metrics``. A request's ``"model"``
names the adapter (``base_name`` for none), as multi-LoRA servers do. One continuous-batching
manager (the patched model's, see ``continuous/engine.py``) serves every request; it starts and
stops with the app and is restarted if it dies (``supervisor.py``).

Every request is validated before anything is queued (``schemas.py``; the model's context in
``service.py``): a bad one gets a 4xx in OpenAI's error shape naming the field, and no request can
take the engine down. Sampling is per request (``continuous/sampling.py``).

transformers' own ``serve`` is not extended: it loads models by id, keeps one manager per model id
(switching adapters would restart it) and passes nothing per request but the token ids.
"""

from __future__ import annotations

import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from transformers import GenerationConfig

from ..patch import get_state
from .adapters import AdapterCatalog
from .config import ServerConfig
from .errors import APIError
from .metrics import Metrics
from .schemas import ChatCompletionRequest, CompletionRequest, LoadAdapterRequest, UnloadAdapterRequest, parse
from .service import CompletionService, default_sampling
from .supervisor import EngineSupervisor

logger = logging.getLogger("peft_fastlora")
_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
           "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class _JSON(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate a client sent, echoed in an error, still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def create_app(model, tokenizer, config: Optional[ServerConfig] = None, *, generation_config=None,
               continuous_batching_config=None, adapters: Optional[Sequence[str]] = None,
               base_name: Optional[str] = None, max_tokens_default: Optional[int] = None) -> FastAPI:
    """The app serving a ``fastlora.patch``-ed PeftModel's adapters.

    Args:
        model: the patched model (its continuous batching takes one adapter per request).
        tokenizer: encodes prompts and chat messages (``apply_chat_template``), decodes outputs.
        config: the server's settings (``ServerConfig``: limits, API key, adapter root, ...).
        generation_config: EOS and the default sampling of a request that sets none (default: the
            model's; greedy if it does not sample). Fields that would process every row's logits
            (``repetition_penalty``, ...) are refused.
        continuous_batching_config: the engine's sizes (transformers' ``ContinuousBatchingConfig``).
        adapters: the adapter names served (default: every adapter of the model, PEFT's and the
            registered ones); others are answered like unknown ones.
        base_name, max_tokens_default: shorthands for the ``config`` fields of those names.

    With ``config.api_key`` set, every route but ``/health`` and ``/metrics`` (probes and scrapers)
    needs the key, and FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` are not served (404)
    rather than put behind it: the key is checked by each of this app's routes, and those pages are
    FastAPI's, opened in a browser that sends no ``Authorization`` header (the two pages fetch
    ``/openapi.json`` themselves), so behind the key they would only be broken pages. Without a key
    they are served as FastAPI serves them.
    """
    state = get_state(model)
    if state is None or state.continuous is None or state.continuous.blocker is not None:
        why = "the model is not patched" if state is None or state.continuous is None else state.continuous.blocker
        raise ValueError(f"create_app needs a fastlora-patched model with continuous batching on ({why})")
    config = config if config is not None else ServerConfig()
    shorthands = {k: v for k, v in (("base_name", base_name), ("max_tokens_default", max_tokens_default))
                  if v is not None}
    config = config.replace(**shorthands) if shorthands else config
    gen = generation_config if generation_config is not None else model.generation_config
    defaults = default_sampling(gen)
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    engine_gen = _engine_generation_config(gen, eos_ids, tokenizer)

    metrics = Metrics()
    catalog = AdapterCatalog(model, adapters, config.base_name, config.adapter_root)
    supervisor = EngineSupervisor(model, engine_gen, continuous_batching_config, config, metrics)
    service = CompletionService(model, tokenizer, config, catalog, supervisor, metrics, defaults, eos_ids)

    @asynccontextmanager
    async def lifespan(app):
        await supervisor.start()
        try:
            yield
        finally:
            await supervisor.stop(in_flight=lambda: service.pending)

    # with a key, FastAPI's own pages (/docs, /redoc, /openapi.json) are not served: see the docstring
    pages = {} if config.api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="peft_fastlora", lifespan=lifespan, default_response_class=_JSON, **pages)
    app.state.fastlora = service
    app.add_middleware(_CountResponses, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _JSON(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return _JSON(APIError(str(exc.detail), exc.status_code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        logger.exception("fastlora server: unexpected error on %s", request.url.path)
        return _JSON(APIError("internal server error", 500).body(), status_code=500)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("utf-8", "replace")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given, config.api_key.encode("utf-8")):
            raise APIError("invalid or missing API key (Authorization: Bearer <key>)", 401, code="invalid_api_key")

    async def body_of(request: Request, schema):
        authorize(request)
        return parse(schema, await _read_json(request, config.max_body_bytes))

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers' probes may send HEAD)
    async def health():
        report = supervisor.health()
        return _JSON(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "peft_fastlora"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card(name) for name in [config.base_name] + catalog.names()]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):  # OpenAI's "retrieve model" (client.models.retrieve)
        authorize(request)
        catalog.adapter_of(name)  # 404 naming the models served, for one not served
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return _respond(await service.completions(request, await body_of(request, CompletionRequest)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return _respond(await service.chat(request, await body_of(request, ChatCompletionRequest)))

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(request: Request):
        body = await body_of(request, LoadAdapterRequest)
        await catalog.load(body.lora_name, body.lora_path)
        return {"status": "loaded", "lora_name": body.lora_name}

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(request: Request):
        body = await body_of(request, UnloadAdapterRequest)
        await catalog.unload(body.lora_name)
        return {"status": "unloaded", "lora_name": body.lora_name}

    return app


def _respond(result):
    if result is None or isinstance(result, dict):
        return result
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _engine_generation_config(gen, eos_ids, tokenizer):
    """What the engine decodes with: greedy, no logits processor (the per-request sampling redoes
    the rows that sample), the server's EOS."""
    pad = gen.pad_token_id if gen.pad_token_id is not None else tokenizer.pad_token_id
    return GenerationConfig(do_sample=False, eos_token_id=eos_ids or -1, pad_token_id=pad,
                            max_new_tokens=gen.max_new_tokens)


async def _read_json(request: Request, limit: int):
    """The request's JSON body; 413 past ``limit`` bytes (read no further), 400 for what is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"the body has {int(declared)} bytes; this server takes at most {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"the body is over this server's limit of {limit} bytes", 413)
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise APIError("the body is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise APIError("the body's JSON is nested too deeply") from None
    except ValueError as e:
        raise APIError(f"the body is not valid JSON: {e}") from None


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


class _CountResponses:
    """ASGI middleware: every HTTP response counted by route and status (``fastlora_http_requests``)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path")
        route = path if path in _ROUTES else "/v1/models/{model}" if str(path).startswith("/v1/models/") else "other"
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
