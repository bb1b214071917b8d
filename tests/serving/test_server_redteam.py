"""Hostile and malformed requests against a live endpoint: each must get a 4xx in OpenAI's error
shape naming the problem, within seconds, with no stack trace or server path in it, and leave the
server healthy and serving (the engine's thread alive, no restart).

The server's cache holds 512 tokens (fewer than the tiny model's 2,048 positions), so prompts
that outgrow the cache, the classic way to kill the engine for every client, are among the cases.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("uvicorn")

from _server import LiveServer  # noqa: E402

CACHE_TOKENS = 512
OK = {"model": "upper", "prompt": "abc=", "max_tokens": 4}
CHAT_OK = {"model": "upper", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _changed(body: dict, changes: dict) -> dict:
    """``body`` with ``changes`` applied (a value of ``_DROP`` removes its key)."""
    body = dict(body)
    for key, value in changes.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def completion(**changes):
    return _changed(OK, changes)


def chat(**changes):
    return _changed(CHAT_OK, changes)


_DROP = object()
C, H = "/v1/completions", "/v1/chat/completions"

# (id, path, JSON body or raw bytes, expected status, a regex the error message must match)
CASES = [
    ("no-model", C, completion(model=_DROP), 400, "model is required"),
    ("model-null", C, completion(model=None), 400, "model"),
    ("model-number", C, completion(model=123), 400, "model"),
    ("model-empty", C, completion(model=""), 400, "model"),
    ("model-path", C, completion(model="../../etc/passwd"), 404, "does not exist"),
    ("model-unknown", C, completion(model="nope"), 404, "'nope' does not exist"),
    ("prompt-missing", C, completion(prompt=_DROP), 400, "prompt is required"),
    ("prompt-number", C, completion(prompt=123), 400, "prompt"),
    ("prompt-empty-list", C, completion(prompt=[]), 400, "prompt"),
    ("prompt-negative-id", C, completion(prompt=[1, 5, -1]), 400, "token id -1, outside the vocabulary"),
    ("prompt-huge-id", C, completion(prompt=[1, 10**9]), 400, "outside the vocabulary"),
    ("prompt-float-ids", C, completion(prompt=[1.5, 2]), 400, "prompt"),
    ("prompt-empty-inner", C, completion(prompt=[[1, 5], []]), 400, "prompt 1 is empty"),
    ("prompt-lone-surrogate", C, completion(prompt="ab\ud800c"), 400, "could not be tokenized"),
    ("prompt-over-cache", C, completion(prompt="a" * 600), 400, f"maximum context length is {CACHE_TOKENS}"),
    ("prompt-fills-cache", C, completion(prompt="a" * (CACHE_TOKENS - 1), max_tokens=_DROP), 400,
     "leaves none for the completion"),
    ("max-tokens-huge", C, completion(max_tokens=10**9), 400, "maximum context length"),
    ("max-tokens-zero", C, completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", C, completion(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-bool", C, completion(max_tokens=True), 400, "max_tokens"),
    ("max-tokens-string", C, completion(max_tokens="8"), 400, "max_tokens"),
    ("max-tokens-float", C, completion(max_tokens=8.5), 400, "max_tokens"),
    ("temperature-string", C, completion(temperature="hot"), 400, "temperature"),
    ("temperature-negative", C, completion(temperature=-1), 400, "temperature"),
    ("temperature-large", C, completion(temperature=3), 400, "temperature"),
    ("temperature-nan", C, b'{"model": "upper", "prompt": "a", "temperature": NaN}', 400, "NaN"),
    ("top-p-string", C, completion(top_p="x"), 400, "top_p"),
    ("top-p-two", C, completion(top_p=2), 400, "top_p"),
    ("top-p-zero", C, completion(top_p=0), 400, "top_p"),
    ("top-k-negative", C, completion(top_k=-2), 400, "top_k"),
    ("n-string", C, completion(n="x"), 400, r"\bn\b"),
    ("n-zero", C, completion(n=0), 400, r"\bn\b"),
    ("n-thousand", C, completion(n=1000), 400, "at most"),
    ("stream-string", C, completion(stream="yes"), 400, "stream"),
    ("stop-number", C, completion(stop=5), 400, "stop"),
    ("stop-empty", C, completion(stop=[""]), 400, "must not be empty"),
    ("stop-too-many", C, completion(stop=["x"] * 100), 400, "at most"),
    ("stop-token-out", C, completion(stop_token_ids=[10**6]), 400, "outside the vocabulary"),
    ("seed-string", C, completion(seed="x"), 400, "seed"),
    ("seed-huge", C, completion(seed=2**70), 400, "seed"),
    ("logprobs-large", C, completion(logprobs=10), 400, "logprobs"),
    ("penalty-large", C, completion(presence_penalty=5), 400, "presence_penalty"),
    ("logit-bias", C, completion(logit_bias={"1": 5}), 400, "not supported.*logit_bias"),
    ("echo", C, completion(echo=True), 400, "not supported.*echo"),
    ("best-of", C, completion(best_of=3), 400, "not supported.*best_of"),
    ("typo-field", C, completion(temprature=0.5), 400, "Unrecognized request argument supplied: temprature"),
    ("body-array", C, b"[1, 2]", 400, "JSON object"),
    ("body-not-json", C, b"not json", 400, "not valid JSON"),
    ("body-bad-utf8", C, b'{"model": "upper", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("body-nested", C, b"[" * 100000 + b"]" * 100000, 400, "nested too deeply|not valid JSON"),
    ("body-too-large", C, json.dumps(completion(prompt="a" * (3 * 2**20))).encode(), 413, "at most|limit"),
    ("chat-messages-strings", H, chat(messages=["hi"]), 400, "messages"),
    ("chat-messages-empty", H, chat(messages=[]), 400, "messages"),
    ("chat-messages-missing", H, chat(messages=_DROP), 400, "messages is required"),
    ("chat-no-role", H, chat(messages=[{"content": "hi"}]), 400, "role"),
    ("chat-no-content", H, chat(messages=[{"role": "user"}]), 400, "content"),
    ("chat-role-hacker", H, chat(messages=[{"role": "hacker", "content": "hi"}]), 400, "role"),
    ("chat-role-tool", H, chat(messages=[{"role": "tool", "content": "hi"}]), 400, "role"),
    ("chat-content-number", H, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("chat-image", H, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "text only"),
    ("chat-top-logprobs-alone", H, chat(top_logprobs=3), 400, "needs logprobs"),
    ("chat-top-logprobs-large", H, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("chat-huge-message", H, chat(messages=[{"role": "user", "content": "b" * 200_000}]), 400,
     "maximum context length"),
    ("chat-tools", H, chat(tools=[{"type": "function"}]), 400, "not supported.*tools"),
    ("chat-json-format", H, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("load-outside-root", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../../etc"}, 403, "outside"),
    ("load-absolute", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 403, "outside"),
    ("load-missing-folder", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nothing-here"}, 400,
     "could not be loaded"),
    ("load-bad-name", "/v1/load_lora_adapter", {"lora_name": "a/b", "lora_path": "x"}, 400, "invalid adapter name"),
    ("load-existing-name", "/v1/load_lora_adapter", {"lora_name": "upper", "lora_path": "x"}, 400, "already"),
    ("unload-unknown", "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "no adapter named"),
    ("unload-peft-adapter", "/v1/unload_lora_adapter", {"lora_name": "upper"}, 400, "only adapters loaded by name"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    live = LiveServer(str(tmp_path_factory.mktemp("adapters")),
                      ["--cache-tokens", str(CACHE_TOKENS), "--max-batch-tokens", "64", "--adapter-root", str(root)],
                      reference=False)
    yield live
    live.stop()


def _check_error(status, headers, content, expected, pattern):
    assert status == expected, (status, content)
    assert isinstance(content, dict) and "error" in content, content
    error = content["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    import re

    assert re.search(pattern, error["message"]), error["message"]
    text = json.dumps(content)
    for leak in ("Traceback", "site-packages", "/work/", "File \""):
        assert leak not in text, text


@pytest.mark.parametrize("name, path, body, expected, pattern", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_refused_cleanly(server, name, path, body, expected, pattern):
    began = time.monotonic()
    if isinstance(body, bytes):
        status, headers, content = server.post(path, raw=body)
    else:
        status, headers, content = server.post(path, body)
    assert time.monotonic() - began < 10, "the answer took too long"
    _check_error(status, headers, content, expected, pattern)
    health = server.health()
    assert health[0] == 200 and health[2]["status"] == "ok", health
    assert server.supervisor.restarts == 0


def test_unknown_route_and_method_answer_in_openai_shape(server):
    status, _, content = server.request("GET", "/v1/nope")
    assert status == 404 and "error" in content
    status, _, content = server.request("GET", "/v1/completions")
    assert status == 405 and "error" in content


def test_without_a_key_the_docs_and_schema_are_served(server):
    """(With a key they are not served: ``test_server_operations``.)"""
    status, _, content = server.request("GET", "/openapi.json")
    assert status == 200 and "/v1/completions" in content["paths"], status
    assert server.request("GET", "/docs")[0] == 200 and server.request("GET", "/redoc")[0] == 200


def test_the_server_still_answers_after_every_hostile_case(server):
    status, _, content = server.post(C, OK)
    assert status == 200 and content["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.supervisor.manager.is_running()


def test_a_prompt_at_the_cache_limit_is_served(server):
    """The largest request the cache holds (prompt + completion = its 512 tokens) runs, alone and
    next to others that then have to wait for its blocks."""
    prompt = "a" * (CACHE_TOKENS - 8 - 1)  # the tokenizer adds <s>
    status, _, content = server.post(C, {"model": "sum", "prompt": prompt, "max_tokens": 8})
    assert status == 200, content
    assert content["usage"]["prompt_tokens"] + 8 == CACHE_TOKENS
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: server.post(C, {"model": "upper", "prompt": "b" * 300 + str(i),
                                                          "max_tokens": 100}), range(4)))
    assert all(a[0] == 200 for a in answers), [a[2] for a in answers if a[0] != 200]
    assert server.health()[2]["status"] == "ok" and server.supervisor.restarts == 0


def test_unset_max_tokens_is_clamped_to_the_context(server):
    prompt = "c" * (CACHE_TOKENS - 5)
    status, _, content = server.post(C, {"model": "base", "prompt": prompt})
    assert status == 200, content
    assert content["usage"]["prompt_tokens"] + content["usage"]["completion_tokens"] <= CACHE_TOKENS
