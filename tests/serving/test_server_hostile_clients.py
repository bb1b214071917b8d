"""Clients that push a live endpoint where its limits meet: more concurrent work than the engine's
cache holds, sampling settings at the edge of what is accepted, malformed parts the validation
must name, bodies that cost work before they are refused, requests held while the engine
restarts, and what an operator's probes and metrics see meanwhile. Each answer must be right
(greedy ones equal to the same request alone, seeded ones reproducible) and the engine must keep
serving, with no restart.

The server's cache holds 512 tokens, so three requests of 200 prompt tokens and 200 completion
tokens cannot all stay in it: the engine frees the newest one's cache and requeues it (a "soft
reset") while the others go on.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvicorn")

from _server import LiveServer  # noqa: E402

CACHE_TOKENS = 512
C, H = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer(str(tmp_path_factory.mktemp("adapters")),
                      ["--cache-tokens", str(CACHE_TOKENS), "--max-batch-tokens", "64",
                       "--adapter-root", str(tmp_path_factory.mktemp("root"))], reference=False)
    yield live
    live.stop()


def _ok(server, body):
    status, _, content = server.post(C if "prompt" in body else H, body, timeout=120)
    assert status == 200, content
    return content


def _together(server, bodies):
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: server.post(C, body, timeout=120), bodies))


def _assert_healthy(server):
    assert server.health()[2]["status"] == "ok" and server.supervisor.restarts == 0
    assert server.supervisor.manager.is_running()


# -- more work than the cache holds ------------------------------------------------------------
def _overflowing(**sampling):
    return [dict({"model": model, "prompt": letter * 200, "max_tokens": 200}, **sampling)
            for model, letter in (("upper", "a"), ("sum", "b"), ("reverse", "c"))]


def test_requests_that_overflow_the_cache_together_are_all_served(server):
    """The engine soft-resets one of them (requeued under the same id); it must keep its adapter:
    losing it ended the engine's thread, failing every request it held."""
    bodies = _overflowing()
    answers = _together(server, bodies)
    assert [a[0] for a in answers] == [200] * 3, [a[2] for a in answers]
    for body, (_, _, content) in zip(bodies, answers):
        assert content["usage"]["completion_tokens"] == 200 or content["choices"][0]["finish_reason"] == "stop"
        assert content["choices"][0]["text"] == _ok(server, body)["choices"][0]["text"], body["model"]
    _assert_healthy(server)


def test_a_soft_reset_keeps_a_seeded_requests_draws_and_penalties(server):
    """A sampled request requeued by the engine goes on drawing where it was (its position and
    penalties count the tokens it generated before), so it draws what it draws alone."""
    bodies = [dict(b, seed=i) for i, b in enumerate(_overflowing(temperature=1.0, frequency_penalty=0.5))]
    answers = _together(server, bodies)
    assert [a[0] for a in answers] == [200] * 3, [a[2] for a in answers]
    for body, (_, _, content) in zip(bodies, answers):
        assert content["choices"][0]["text"] == _ok(server, body)["choices"][0]["text"], body["model"]
    _assert_healthy(server)


# -- sampling settings at the edge -------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 1e-40}, {"temperature": 5e-324},
                                      {"temperature": 2.0, "top_p": 1e-300}],
                         ids=["temperature-1e-40", "temperature-5e-324", "top-p-1e-300"])
def test_settings_below_float32s_range_are_greedy(server, sampling):
    """A temperature or top_p that float32 cannot hold (a denormal, or 0) draws the most likely
    token, as the limit of the setting does: it drew token 0 (or the lowest id whose logit was
    above 0) on every step."""
    body = {"model": "upper", "prompt": "abc=", "max_tokens": 8}
    greedy = _ok(server, body)["choices"][0]["text"]
    assert _ok(server, dict(body, seed=3, **sampling))["choices"][0]["text"] == greedy


# -- work refused before it is done ----------------------------------------------------------
def test_too_many_prompts_are_refused_before_any_is_tokenized(server, monkeypatch):
    """A body of 300,000 short prompts (1.8 MB, under the body limit) was tokenized whole before
    the count (at most 16 completions) refused it: seconds of CPU each, and eight such requests
    held every worker thread, so that a plain request waited 40 s."""
    calls = []
    encode = server.service._encode
    monkeypatch.setattr(server.service, "_encode", lambda text: calls.append(1) or encode(text))
    status, _, content = server.post(C, {"model": "upper", "prompt": ["ab"] * 1000, "max_tokens": 2})
    assert status == 400 and "1000 completions asked" in content["error"]["message"], content
    status, _, content = server.post(C, {"model": "upper", "prompt": ["ab"] * 9, "n": 2, "max_tokens": 2})
    assert status == 400 and "18 completions asked" in content["error"]["message"], content
    assert not calls
    status, _, content = server.post(C, {"model": "upper", "prompt": ["ab"] * 8, "n": 2, "max_tokens": 2})
    assert status == 200 and len(content["choices"]) == 16 and len(calls) == 8, content


# -- errors that name the problem ------------------------------------------------------------
@pytest.mark.parametrize("path, changes, pattern", [
    # the one bad id of a batch of token-id prompts (was: "prompt: Input should be a valid string")
    (C, {"prompt": [[1, 5], [1, True]]}, r"prompt must be one of: str, list\[str\], list\[int\], "
                                         r"list\[list\[int\]\] \(prompt\.1\.1: Input should be a valid integer\)"),
    (C, {"prompt": "a", "stop": ["x", 5]}, r"stop must be one of: str, list\[str\] \(stop\.1: "),
    (H, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     r"messages\.0\.content\.0\.text: Input should be a valid string"),
    # a text part without its text (was: "is of type 'text'; this server takes text only")
    (H, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, r"content part 0 .* has no text"),
], ids=["prompt-batch-bad-id", "stop-list-number", "chat-part-text-number", "chat-part-no-text"])
def test_errors_name_the_element_at_fault(server, path, changes, pattern):
    body = dict({"model": "upper", "max_tokens": 2}, **changes)
    status, _, content = server.post(path, body)
    assert status == 400 and re.search(pattern, content["error"]["message"]), content
    assert " more problems" not in content["error"]["message"]  # the other forms are not more problems


def test_a_nul_in_an_adapter_path_is_refused_by_name(server):
    """The file system's calls raise ValueError for a NUL, which was answered as a 500."""
    status, _, content = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "ab\u0000c"})
    assert status == 400 and "NUL" in content["error"]["message"] and content["error"]["param"] == "lora_path", content
    assert server.health()[2]["status"] == "ok"


def test_a_folder_that_is_no_adapter_is_named_as_the_client_gave_it(server):
    status, _, content = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "."})
    message = content["error"]["message"]
    assert status == 400 and "'.' has no adapter_config.json" in message and "''" not in message, content


@pytest.mark.parametrize("path", [C, H])
def test_stream_options_without_a_stream_are_refused(server, path):
    """As OpenAI's API refuses them (the usage chunk they ask for was silently not sent)."""
    body = {"model": "upper", "max_tokens": 2, "stream_options": {"include_usage": True}}
    body.update({"prompt": "a"} if path == C else {"messages": [{"role": "user", "content": "a"}]})
    status, _, content = server.post(path, body)
    assert status == 400 and content["error"]["param"] == "stream_options", content
    events = server.events(path, dict(body, stream=True))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2


# -- what the operator sees ------------------------------------------------------------------
def _gauge(server, name: str) -> float:
    text = server.request("GET", "/metrics")[2]
    return float(re.search(re.escape(name) + r" ([0-9.e+-]+)", text).group(1))


def test_a_whole_answer_being_generated_counts_as_running(server):
    """A whole (not streamed) answer gets no output from the engine before it ends: it was
    counted waiting, and running stayed 0, for as long as it generated."""
    body = {"model": "upper", "prompt": "abc=", "max_tokens": 480}
    worker = threading.Thread(target=lambda: server.post(C, body, timeout=120))
    worker.start()
    seen = set()
    while worker.is_alive():
        seen.add((_gauge(server, "fastlora_requests_running"), _gauge(server, "fastlora_requests_waiting")))
        time.sleep(0.05)
    worker.join()
    assert (1.0, 0.0) in seen, seen
    assert _gauge(server, "fastlora_requests_running") == 0 and _gauge(server, "fastlora_requests_waiting") == 0


def test_large_prompts_do_not_hold_the_worker_threads_of_other_requests(server, monkeypatch):
    """Prompts of megabytes take seconds to tokenize: eight at once held every worker thread the
    event loop shares, and a plain request waited behind them (11 s on the tiny model's
    tokenizer). Large prompts now take turns on a thread of their own."""
    release = threading.Event()
    encode = server.service._encode

    def slow_for_large(text):
        if len(text) > 100_000:
            assert release.wait(30)  # a tokenizer that takes its time
        return encode(text)

    monkeypatch.setattr(server.service, "_encode", slow_for_large)
    with ThreadPoolExecutor(8) as pool:
        large = [pool.submit(server.post, C, {"model": "upper", "prompt": "ab" * 60_000, "max_tokens": 2})
                 for _ in range(8)]
        time.sleep(0.5)
        try:
            began = time.monotonic()
            status, _, content = server.post(C, {"model": "upper", "prompt": "abc=", "max_tokens": 4}, timeout=5)
            assert status == 200 and time.monotonic() - began < 3, content
        finally:
            release.set()
        for future in large:
            status, _, content = future.result()
            assert status == 400 and content["error"]["code"] == "context_length_exceeded", content


def test_requests_that_waited_for_a_restart_still_keep_to_max_pending(server, monkeypatch):
    """Requests arriving while the engine restarts wait for it; they were checked against
    max_pending before the wait only, so that all of them were let in once it came back."""
    supervisor, service = server.supervisor, server.service
    monkeypatch.setattr(service, "config", service.config.replace(max_pending=2))
    gate = threading.Event()
    real = supervisor.manager_for_request

    async def after_a_restart():
        while not gate.is_set():  # (the event loop goes on: the others arrive meanwhile)
            await asyncio.sleep(0.01)
        return await real()

    monkeypatch.setattr(supervisor, "manager_for_request", after_a_restart)
    body = {"model": "upper", "prompt": "abc=", "max_tokens": 60}
    with ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(server.post, C, body) for _ in range(6)]
        time.sleep(1.0)
        gate.set()
        statuses = sorted(a.result()[0] for a in answers)
    assert statuses.count(200) <= 2 and statuses.count(429) >= 4, statuses


@pytest.mark.parametrize("name, expected", [("upper", 200), ("base", 200), ("nope", 404), ("../upper", 404)])
def test_one_model_can_be_retrieved(server, name, expected):
    """OpenAI's GET /v1/models/{model} (the openai client's models.retrieve) answered 404 "Not
    Found" for every model, served or not."""
    status, _, content = server.request("GET", f"/v1/models/{name}")
    assert status == expected, content
    if expected == 200:
        assert content["id"] == name and content["object"] == "model"
    else:
        assert content["error"]["code"] == "model_not_found" and repr(name) in content["error"]["message"]


def test_health_answers_a_head_probe(server):
    """A load balancer's HEAD probe got 405 from a healthy server."""
    status, _, content = server.request("HEAD", "/health")
    assert status == 200 and content == ""


def test_a_reader_that_stops_reading_holds_one_engine_output_a_choice():
    """Each engine output holds the whole completion so far; a stream whose client stops reading
    (its socket full) must not keep one a step, which would grow with the square of the answer's
    length. Its request keeps each choice's newest output; the reader resumes from it."""
    from peft_fastlora.server.service import _Run

    class Output:
        def __init__(self, tokens):
            self.generated_tokens = tokens

    run = _Run(None, None, "cmpl-x", None, "upper", False)
    for step in range(1, 2001):  # 2,000 steps of two choices nobody reads
        for index in (0, 1):
            run.deliver(index, Output(list(range(step))))
    taken = asyncio.run(run._arrivals(None))
    assert sorted(i for i, _ in taken) == [0, 1]
    assert all(len(out.generated_tokens) == 2000 for _, out in taken)
    assert run._latest == {}  # nothing else held
