"""The OpenAI-compatible endpoint against a live local server, with the ``openai`` client.

The server is ``examples/serve_openai.py --tiny`` (random tiny Llama, character tokenizer, three
saved adapters) run by uvicorn in a thread. Each answer is compared with PEFT's own ``generate`` of
that prompt alone with that adapter, on an unpatched copy loaded from the same files.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import serve_many_adapters as files  # noqa: E402
import serve_openai  # noqa: E402

ADAPTERS = ["reverse", "sum", "upper"]


@pytest.fixture(scope="module", params=["peft", "registered"])
def server(tmp_path_factory, request):
    """The adapters loaded into PEFT, or registered by name into two GPU slots (``--register``)."""
    extra = ["--register", "--slots", "2"] if request.param == "registered" else []
    args = serve_openai.parse_args(["--tiny", "--device", "cpu", "--max-batch-tokens", "32"] + extra)
    files.make_tiny_files(args, str(tmp_path_factory.mktemp("adapters")))
    app, names = serve_openai.build_app(args)
    assert names == ADAPTERS
    # the reference is built before the server starts: its random weights come from the global RNG
    # (seeded), which the engine's thread could otherwise draw from in between (a flaky mismatch)
    register, args.register = args.register, False
    ref, tokenizer, _ = files.load_model(args)  # unpatched: PEFT's own path, the same folders loaded
    args.register = register
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield dict(url=f"http://127.0.0.1:{port}/v1", app=app, ref=ref, tokenizer=tokenizer)
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"], api_key="unused", max_retries=0, timeout=60)


def _peft(server, ids, adapter, max_tokens):
    ref, tok = server["ref"], server["tokenizer"]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=[adapter],
                           max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def _prompt_ids(server, prompt):
    return server["tokenizer"](prompt)["input_ids"]


def test_models_lists_base_and_adapters(client):
    assert sorted(m.id for m in client.models.list().data) == sorted(["base"] + ADAPTERS)


@pytest.mark.parametrize("model", ["base"] + ADAPTERS)
def test_completion_equals_peft(server, client, model):
    r = client.completions.create(model=model, prompt="hello=", max_tokens=10)
    adapter = "__base__" if model == "base" else model
    assert r.choices[0].text == _peft(server, _prompt_ids(server, "hello="), adapter, 10)
    assert r.model == model and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(_prompt_ids(server, "hello="))


def test_streaming_equals_non_streaming(client):
    whole = client.completions.create(model="upper", prompt="abc=", max_tokens=12).choices[0].text
    chunks = list(client.completions.create(model="upper", prompt="abc=", max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_and_not(server, client):
    messages = [{"role": "user", "content": "sum 1 2"}]
    whole = client.chat.completions.create(model="sum", messages=messages, max_tokens=9)
    ids = server["app"].state.fastlora.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert whole.choices[0].message.content == _peft(server, list(ids), "sum", 9)
    stream = client.chat.completions.create(model="sum", messages=messages, max_tokens=9, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content


def test_concurrent_requests_to_different_adapters(server, client):
    jobs = [(ADAPTERS[i % 3] if i % 4 else "base", f"q{i}=") for i in range(12)]

    def ask(job):
        model, prompt = job
        return client.completions.create(model=model, prompt=prompt, max_tokens=8).choices[0].text

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(ask, jobs))
    for (model, prompt), text in zip(jobs, answers):
        adapter = "__base__" if model == "base" else model
        assert text == _peft(server, _prompt_ids(server, prompt), adapter, 8), (model, prompt)


def test_unknown_adapter_is_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.completions.create(model="nope", prompt="a", max_tokens=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=2), "not supported.*\\bn\\b"),
    (dict(temperature=0.7), "temperature=0.7"),
    (dict(stop=["x"]), "not supported.*stop"),
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
])
def test_what_the_server_cannot_honour_is_refused(client, kwargs, match):
    args = dict(model="upper", prompt="a", max_tokens=2)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError, match=match):
        client.completions.create(**args)


def test_client_disconnect_cancels_the_request(server, client, monkeypatch):
    manager = server["app"].state.fastlora.manager
    cancelled = []
    cancel = manager.cancel_request
    monkeypatch.setattr(manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid))[1])
    stream = client.completions.create(model="reverse", prompt="a long answer=", max_tokens=400, stream=True)
    first = next(iter(stream))
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 30
    while not cancelled:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    assert cancelled == [first.id]
    # the server goes on serving
    r = client.completions.create(model="upper", prompt="ok=", max_tokens=4)
    assert r.choices[0].text == _peft(server, _prompt_ids(server, "ok="), "upper", 4)
    handlers = manager.output_router.result_handlers
    assert first.id not in handlers  # nothing kept for the cancelled request
