"""The OpenAI-compatible endpoint against a live local server, with the ``openai`` client.

The server is ``examples/serve_openai.py --tiny`` (random tiny Llama, character tokenizer, three
saved adapters) run by uvicorn in a thread. Each greedy answer is compared with PEFT's own
``generate`` of that prompt alone with that adapter, on an unpatched copy loaded from the same files.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from _server import ADAPTERS, LiveServer  # noqa: E402


@pytest.fixture(scope="module", params=["peft", "registered"])
def server(tmp_path_factory, request):
    """The adapters loaded into PEFT, or registered by name into two slots (``--register``)."""
    extra = ["--register", "--slots", "2"] if request.param == "registered" else []
    live = LiveServer(str(tmp_path_factory.mktemp("adapters")), ["--max-batch-tokens", "32"] + extra)
    assert live.names == ADAPTERS
    yield live
    live.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_base_and_adapters(client):
    assert sorted(m.id for m in client.models.list().data) == sorted(["base"] + ADAPTERS)


@pytest.mark.parametrize("model", ["base"] + ADAPTERS)
def test_completion_equals_peft(server, client, model):
    r = client.completions.create(model=model, prompt="hello=", max_tokens=10)
    assert r.choices[0].text == server.peft_text("hello=", model, 10)
    assert r.model == model and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(server.prompt_ids("hello="))
    assert r.usage.completion_tokens == 10 or r.choices[0].finish_reason == "stop"


def test_streaming_equals_non_streaming(client):
    whole = client.completions.create(model="upper", prompt="abc=", max_tokens=12).choices[0].text
    chunks = list(client.completions.create(model="upper", prompt="abc=", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 12  # the usage chunk comes last


def test_chat_streaming_and_not(server, client):
    messages = [{"role": "user", "content": "sum 1 2"}]
    whole = client.chat.completions.create(model="sum", messages=messages, max_tokens=9)
    ids = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = server.tokenizer.decode(server.peft(list(ids), "sum", 9), skip_special_tokens=True)
    assert whole.choices[0].message.content == expected
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
        assert text == server.peft_text(prompt, model, 8), (model, prompt)


def test_several_prompts_and_choices_in_one_request(server, client):
    r = client.completions.create(model="reverse", prompt=["ab=", "xyz="], max_tokens=6, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # greedy: both choices of a prompt are its PEFT answer
        assert c.text == server.peft_text(["ab=", "xyz="][c.index // 2], "reverse", 6)
    assert r.usage.prompt_tokens == len(server.prompt_ids("ab=")) + len(server.prompt_ids("xyz="))


def test_unknown_adapter_is_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.completions.create(model="nope", prompt="a", max_tokens=2)


def test_client_disconnect_cancels_the_request(server, client, monkeypatch):
    manager = server.supervisor.manager
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
    assert cancelled == [first.id + "-0"]  # the request's one choice
    # the server goes on serving
    r = client.completions.create(model="upper", prompt="ok=", max_tokens=4)
    assert r.choices[0].text == server.peft_text("ok=", "upper", 4)
    assert first.id + "-0" not in manager.output_router.result_handlers  # nothing kept for it
    deadline = time.monotonic() + 10
    while server.service.pending:
        assert time.monotonic() < deadline, "the cancelled request is still counted in flight"
        time.sleep(0.05)
