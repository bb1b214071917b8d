"""Operating the endpoint: an API key, a bounded number of requests in flight, metrics, adapters
loaded and unloaded while serving, failures inside the engine (confined to their step; the engine
restarted when its thread dies), concurrent clients that hang up mid-answer, and a clean shutdown.
Each against a live server on the loopback interface, greedy answers checked against PEFT."""

from __future__ import annotations

import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("uvicorn")

from _server import LiveServer  # noqa: E402

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
C = "/v1/completions"
POISON = 3  # <unk>: a prompt holding it makes the injected failure fire


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("root")


@pytest.fixture(scope="module")
def server(tmp_path_factory, root):
    live = LiveServer(str(tmp_path_factory.mktemp("adapters")),
                      ["--max-batch-tokens", "64", "--api-key", KEY, "--adapter-root", str(root),
                       "--max-pending", "6"], headers=AUTH)
    yield live
    live.stop()


def _wait(predicate, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _idle(server):
    _wait(lambda: server.service.pending == 0, "requests still counted in flight")


def _metric(server, name: str, **labels) -> float:
    status, _, text = server.request("GET", "/metrics")
    assert status == 200
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


# -- the key ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": "Basic " + KEY}])
def test_v1_routes_need_the_key(server, headers):
    for method, path, body in (("POST", C, {"model": "base", "prompt": "a", "max_tokens": 2}),
                               ("GET", "/v1/models", None)):
        status, _, content = server.request(method, path, body, headers={"Authorization": "", **headers})
        assert status == 401 and content["error"]["code"] == "invalid_api_key", content


def test_metrics_show_the_engine_loop(server):
    """The engine's steps and its thread's seconds by phase of its loop, growing with the work."""
    status, _, content = server.post(C, {"model": "upper", "prompt": "ab=", "max_tokens": 4})
    assert status == 200, content
    steps = _metric(server, "fastlora_engine_steps_total")
    seconds = {p: _metric(server, "fastlora_engine_seconds_total", phase=p)
               for p in ("schedule", "prepare", "forward", "outputs", "update")}
    assert steps >= 4 and seconds["forward"] > 0 and all(v > 0 for v in seconds.values()), (steps, seconds)
    assert server.post(C, {"model": "base", "prompt": "cd=", "max_tokens": 4})[0] == 200
    assert _metric(server, "fastlora_engine_steps_total") >= steps + 4
    assert _metric(server, "fastlora_engine_seconds_total", phase="forward") > seconds["forward"]


def test_health_and_metrics_need_no_key(server):
    assert server.request("GET", "/health", headers={"Authorization": ""})[0] == 200
    assert server.request("GET", "/metrics", headers={"Authorization": ""})[0] == 200
    assert server.request("HEAD", "/health", headers={"Authorization": ""})[0] == 200


def test_every_other_route_needs_the_key(server):
    """Each route the app serves, whatever its method, answers 401 without the key (a route added
    without the check fails here); FastAPI's docs and schema pages are not served at all."""
    open_routes, checked = {"/health", "/metrics"}, set()
    for route in server.app.routes:
        if route.path in open_routes:
            continue
        path = re.sub(r"\{[^}]*\}", "base", route.path)
        for method in sorted(route.methods):
            status, _, content = server.request(method, path, {}, headers={"Authorization": ""})
            assert status == 401, (method, route.path, status)
            assert method == "HEAD" or content["error"]["code"] == "invalid_api_key", (method, route.path)
            checked.add(route.path)
    assert {C, "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter"} <= checked, checked
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert server.request("GET", path, headers={"Authorization": ""})[0] == 404, path
        assert server.request("GET", path)[0] == 404, path  # with the key too


# -- limits and metrics ----------------------------------------------------------------------------
def test_requests_past_the_limit_get_429_then_are_served(server):
    _idle(server)
    held = [server.open_stream(C, {"model": "reverse", "prompt": f"hold{i}=", "max_tokens": 400, "stream": True})
            for i in range(3)]
    for stream in held:
        assert stream.status == 200 and stream.next_event() is not None
    # 3 in flight; a request of n=4 would make 7 > 6
    status, headers, content = server.post(C, {"model": "base", "prompt": "a", "max_tokens": 2, "n": 4})
    assert status == 429 and headers.get("retry-after") == "1", content
    for stream in held:
        stream.close()
    _idle(server)
    status, _, content = server.post(C, {"model": "base", "prompt": "a", "max_tokens": 2, "n": 4})
    assert status == 200 and len(content["choices"]) == 4


def test_metrics_move_as_requests_complete(server):
    _idle(server)
    before = {name: _metric(server, name) for name in ("fastlora_generation_tokens_total",
                                                       "fastlora_prompt_tokens_total",
                                                       "fastlora_time_to_first_token_seconds_count",
                                                       "fastlora_request_latency_seconds_count")}
    ok_before = _metric(server, "fastlora_http_requests_total", route=C, status="200")
    bad_before = _metric(server, "fastlora_http_requests_total", route=C, status="400")
    status, _, content = server.post(C, {"model": "sum", "prompt": "12+7=", "max_tokens": 6})
    assert status == 200
    assert server.post(C, {"model": "sum", "prompt": "12+7=", "max_tokens": 0})[0] == 400
    usage = content["usage"]
    assert _metric(server, "fastlora_generation_tokens_total") == before["fastlora_generation_tokens_total"] + \
        usage["completion_tokens"]
    assert _metric(server, "fastlora_prompt_tokens_total") == before["fastlora_prompt_tokens_total"] + \
        usage["prompt_tokens"]
    assert _metric(server, "fastlora_time_to_first_token_seconds_count") == \
        before["fastlora_time_to_first_token_seconds_count"] + 1
    assert _metric(server, "fastlora_request_latency_seconds_count") == \
        before["fastlora_request_latency_seconds_count"] + 1
    assert _metric(server, "fastlora_http_requests_total", route=C, status="200") == ok_before + 1
    assert _metric(server, "fastlora_http_requests_total", route=C, status="400") == bad_before + 1
    assert _metric(server, "fastlora_requests_running") == 0 and _metric(server, "fastlora_requests_waiting") == 0


# -- adapters while serving ------------------------------------------------------------------------
def test_load_serve_and_unload_an_adapter(server, root):
    shutil.copytree(f"{server.args.adapters}/sum", root / "sum-copy")
    status, _, content = server.post("/v1/load_lora_adapter", {"lora_name": "sum2", "lora_path": "sum-copy"})
    assert status == 200, content
    models = [m["id"] for m in server.request("GET", "/v1/models")[2]["data"]]
    assert "sum2" in models
    a = server.post(C, {"model": "sum2", "prompt": "3+4=", "max_tokens": 6})[2]["choices"][0]["text"]
    assert a == server.peft_text("3+4=", "sum", 6)  # the same weights as "sum"
    status, _, content = server.post("/v1/unload_lora_adapter", {"lora_name": "sum2"})
    assert status == 200, content
    assert server.post(C, {"model": "sum2", "prompt": "3+4=", "max_tokens": 6})[0] == 404
    assert "sum2" not in [m["id"] for m in server.request("GET", "/v1/models")[2]["data"]]


def test_unloading_fails_only_the_requests_using_the_adapter(server, root, monkeypatch):
    _idle(server)
    from peft_fastlora.server import adapters

    removal = adapters.unregister_adapter

    def slow_removal(*args):  # the failed request's handler runs before the unload's coroutine resumes
        removal(*args)
        time.sleep(0.5)

    monkeypatch.setattr(adapters, "unregister_adapter", slow_removal)
    shutil.copytree(f"{server.args.adapters}/reverse", root / "rev-copy")
    assert server.post("/v1/load_lora_adapter", {"lora_name": "rev2", "lora_path": "rev-copy"})[0] == 200
    doomed = server.open_stream(C, {"model": "rev2", "prompt": "long=", "max_tokens": 400, "stream": True})
    other = server.open_stream(C, {"model": "upper", "prompt": "keep=", "max_tokens": 60, "stream": True})
    assert doomed.next_event() is not None and other.next_event() is not None
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "rev2"})[0] == 200
    events = doomed.rest()
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["code"] == "adapter_unloaded", events[-3:]
    rest = other.rest()
    assert rest[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in rest)
    assert server.health()[2]["status"] == "ok" and server.supervisor.restarts == 0
    doomed.close()
    other.close()


# -- failures in the engine ------------------------------------------------------------------------
class _Poison:
    """A forward pre-hook on the served model's embedding: raises when the step holds the poison
    token, or on every step while ``always`` is set."""

    def __init__(self, server):
        self.always = False
        inner = server.supervisor.model.get_input_embeddings()
        self.handle = inner.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.always or bool((args[0] == POISON).any()):
            raise RuntimeError("injected failure: poisoned step")

    def remove(self):
        self.handle.remove()


def test_a_failing_step_fails_its_requests_only(server):
    _idle(server)
    manager = server.supervisor.manager
    poison = _Poison(server)
    try:
        status, _, content = server.post(C, {"model": "upper", "prompt": [1, POISON, 5], "max_tokens": 4})
    finally:
        poison.remove()
    assert status == 500 and "injected failure" in content["error"]["message"], content
    assert "Traceback" not in str(content)
    assert server.supervisor.manager is manager and manager.is_running()  # no restart
    assert server.supervisor.restarts == 0
    assert server.post(C, {"model": "upper", "prompt": "ok=", "max_tokens": 5})[2]["choices"][0]["text"] == \
        server.peft_text("ok=", "upper", 5)


def test_the_engine_is_restarted_when_its_thread_dies_mid_load(server):
    _idle(server)
    steps = _metric(server, "fastlora_engine_steps_total")  # (kept over the restart, below)
    poison = _Poison(server)
    try:
        streaming = server.open_stream(C, {"model": "reverse", "prompt": "stream=", "max_tokens": 400,
                                           "stream": True})
        assert streaming.next_event() is not None
        poison.always = True  # every step fails from now on: three in a row end the engine's thread
        events = streaming.rest()
        assert any(isinstance(e, dict) and "injected failure" in e.get("error", {}).get("message", "")
                   for e in events), events[-3:]
        streaming.close()
        for i in range(2):
            status, _, content = server.post(C, {"model": "base", "prompt": f"x{i}", "max_tokens": 3})
            assert status in (500, 503), content
        _wait(lambda: server.supervisor.restarts >= 1, "the engine was not restarted")
    finally:
        poison.remove()
    _wait(lambda: server.health()[0] == 200, "the server did not come back")
    assert server.supervisor.manager.is_running()
    for prompt, model in (("ok=", "upper"), ("12+3=", "sum"), ("abc", "base")):
        status, _, content = server.post(C, {"model": model, "prompt": prompt, "max_tokens": 6})
        assert status == 200 and content["choices"][0]["text"] == server.peft_text(prompt, model, 6)
    assert _metric(server, "fastlora_engine_restarts_total") >= 1
    assert _metric(server, "fastlora_engine_steps_total") > steps  # the dead manager's steps still counted


# -- many clients ----------------------------------------------------------------------------------
def test_concurrent_clients_a_third_hanging_up(server):
    """100 requests from 16 clients, every third streamed and dropped after its first event; the
    others' greedy answers equal the same prompts sent alone; nothing is left behind. The server
    takes 6 completions at a time: the clients retry on 429, as its Retry-After asks."""
    _idle(server)
    models = ["base", "upper", "sum", "reverse"]
    jobs = [(models[i % 4], f"p{i % 25}=", 6 + i % 5) for i in range(100)]

    def run(i):
        model, prompt, max_tokens = jobs[i]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        while True:
            if i % 3 == 0:
                stream = server.open_stream(C, dict(body, max_tokens=200, stream=True))
                first = stream.next_event() if stream.status == 200 else None
                stream.close()
                if stream.status != 429:
                    return ("dropped", first is not None)
            else:
                status, _, content = server.post(C, body, timeout=120)
                if status != 429:
                    return (status, content["choices"][0]["text"] if status == 200 else content)
            time.sleep(0.02)

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(run, range(100)))
    _idle(server)
    for i, (status, answer) in enumerate(results):
        if i % 3 == 0:
            assert status == "dropped" and answer
            continue
        assert status == 200, answer
        model, prompt, max_tokens = jobs[i]
        alone = server.post(C, {"model": model, "prompt": prompt, "max_tokens": max_tokens})[2]
        assert answer == alone["choices"][0]["text"], (i, model, prompt)
    for i in (1, 2, 4, 5):  # and a few against PEFT
        model, prompt, max_tokens = jobs[i]
        assert results[i][1] == server.peft_text(prompt, model, max_tokens)
    manager = server.supervisor.manager
    assert not manager.output_router.result_handlers  # no handler kept for a dropped request
    assert len(manager.fastlora_sampling) == 0 and server.service.pending == 0
    assert server.supervisor.restarts <= 1  # the one of the test above, if it ran first


def test_shutdown_lets_requests_in_flight_finish(tmp_path):
    live = LiveServer(str(tmp_path), ["--max-batch-tokens", "64"], reference=False)
    stream = live.open_stream(C, {"model": "upper", "prompt": "bye=", "max_tokens": 40, "stream": True})
    assert stream.next_event() is not None
    stopper = threading.Thread(target=live.stop)
    stopper.start()
    events = stream.rest()
    stopper.join(timeout=60)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length"), events[-3:]
    assert not live.thread.is_alive()
    assert live.service.pending == 0
    assert torch.is_grad_enabled()  # the engine's thread set nothing process-wide


def test_the_example_demo_runs(capsys):
    import serve_openai

    assert serve_openai.main(["--tiny", "--device", "cpu", "--demo"]) == 0
    out = capsys.readouterr().out
    for line in ("greedy  upper:", "sampled sum (n=2, seed=1):", "streamed base:", "loaded  upper2",
                 "after unloading, models: ['base', 'reverse', 'sum', 'upper']"):
        assert line in out, out
