"""Sampling per request through the endpoint: temperature, top-p / top-k, seeds, ``n``, stop
strings and stop token ids, penalties and log-probabilities in both of OpenAI's formats, with
rows of different settings in the same engine steps. Greedy answers equal PEFT's; sampled ones
equal the oracle of ``decode/test_sampling.py`` (PEFT's logits, the same selection)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("uvicorn")

from peft_fastlora.continuous.sampling import SamplingParams, select  # noqa: E402

from _server import LiveServer  # noqa: E402

C, H = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer(str(tmp_path_factory.mktemp("adapters")), ["--max-batch-tokens", "64"])
    yield live
    live.stop()


def _text(server, body):
    status, _, content = server.post(C if "prompt" in body else H, body)
    assert status == 200, content
    return content


def _oracle_tokens(server, prompt: str, adapter: str, params: SamplingParams, max_tokens: int):
    ids, out = server.prompt_ids(prompt), []
    adapter = "__base__" if adapter == "base" else adapter
    for position in range(max_tokens):
        logits = server.last_logits(ids + out, adapter)
        token = int(select(logits, [params], [position], [list(out)])[0])
        out.append(token)
        if token == server.tokenizer.eos_token_id:
            break
    return out


def test_a_sampled_request_equals_the_oracle(server):
    body = {"model": "sum", "prompt": "12+7=", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 42}
    text = _text(server, body)["choices"][0]["text"]
    expected = _oracle_tokens(server, "12+7=", "sum", SamplingParams(temperature=0.9, top_p=0.9, seed=42), 8)
    assert text == server.tokenizer.decode(expected, skip_special_tokens=True)


def test_seeds_reproduce_under_load_and_n_takes_consecutive_seeds(server):
    body = {"model": "reverse", "prompt": "seeded=", "max_tokens": 10, "temperature": 1.0, "seed": 7}
    first = _text(server, body)["choices"][0]["text"]
    noise = [{"model": m, "prompt": f"n{i}=", "max_tokens": 12, "temperature": 1.2, "top_k": 10}
             for i, m in enumerate(["base", "upper", "sum", "reverse"] * 2)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_text, server, b) for b in noise]
        again = _text(server, body)["choices"][0]["text"]
        [f.result() for f in futures]
    assert again == first
    both = _text(server, dict(body, n=2))["choices"]
    assert both[0]["text"] == first
    assert both[1]["text"] == _text(server, dict(body, seed=8))["choices"][0]["text"]


def test_temperature_zero_and_top_k_one_are_greedy(server):
    greedy = server.peft_text("hello=", "upper", 8)
    assert _text(server, {"model": "upper", "prompt": "hello=", "max_tokens": 8, "temperature": 0})[
        "choices"][0]["text"] == greedy
    assert _text(server, {"model": "upper", "prompt": "hello=", "max_tokens": 8, "temperature": 1.5, "top_k": 1,
                          "seed": 3})["choices"][0]["text"] == greedy


def test_penalties_equal_the_oracle(server):
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
    body = {"model": "base", "prompt": "aaaa", "max_tokens": 10, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    expected = _oracle_tokens(server, "aaaa", "base", params, 10)
    assert _text(server, body)["choices"][0]["text"] == server.tokenizer.decode(expected, skip_special_tokens=True)


def test_stop_strings_end_the_text_before_them(server):
    full = server.peft_text("abc=", "reverse", 20)
    stop = full[5:7]
    cut = full[:full.find(stop)]
    content = _text(server, {"model": "reverse", "prompt": "abc=", "max_tokens": 20, "stop": [stop, "@@"]})
    assert content["choices"][0]["text"] == cut and content["choices"][0]["finish_reason"] == "stop"
    events = server.events(C, {"model": "reverse", "prompt": "abc=", "max_tokens": 20, "stop": stop, "stream": True})
    chunks = [e for e in events if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_the_completion(server):
    tokens = server.peft(server.prompt_ids("xyz="), "upper", 12)
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    content = _text(server, {"model": "upper", "prompt": "xyz=", "max_tokens": 12, "stop_token_ids": [stop_id]})
    choice = content["choices"][0]
    assert choice["text"] == server.tokenizer.decode(tokens[:first], skip_special_tokens=True)
    assert choice["finish_reason"] == "stop" and content["usage"]["completion_tokens"] == first + 1


def test_completion_logprobs_format_and_values(server):
    content = _text(server, {"model": "sum", "prompt": "9+9=", "max_tokens": 4, "logprobs": 2})
    lp = content["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    ids, tokens = server.prompt_ids("9+9="), server.peft(server.prompt_ids("9+9="), "sum", 4)
    assert lp["tokens"] == [server.tokenizer.decode([t]) for t in tokens]
    for position, token in enumerate(tokens):
        expected = torch.log_softmax(server.last_logits(ids + tokens[:position], "sum")[0], -1)
        assert math.isclose(lp["token_logprobs"][position], expected[token].item(), abs_tol=1e-4)
        assert len(lp["top_logprobs"][position]) == 2


def test_chat_logprobs_streamed_and_not(server):
    body = {"model": "upper", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 5,
            "logprobs": True, "top_logprobs": 3}
    whole = _text(server, body)["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) >= 1 and all(len(c["top_logprobs"]) == 3 and isinstance(c["bytes"], list) for c in content)
    assert "".join(c["token"] for c in content) .startswith(whole["message"]["content"])
    events = server.events(H, dict(body, stream=True))
    streamed = [c for e in events if e != "[DONE]" for c in ((e["choices"][0].get("logprobs") or {}).get("content")
                                                           or [])]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [round(c["logprob"], 5) for c in streamed] == [round(c["logprob"], 5) for c in content]


def _streamed_logprobs(server, path, body):
    events = [e for e in server.events(path, dict(body, stream=True)) if e != "[DONE]"]
    return [e["choices"][0]["logprobs"] for e in events if e["choices"][0].get("logprobs")]


def test_completion_logprobs_end_where_a_stop_string_cuts_the_text(server):
    """The entries are the returned text's (a character tokenizer: one a character), streamed or
    not, while usage counts every token generated up to the one completing the stop string."""
    full = server.peft_text("abc=", "base", 20)
    stop, cut = full[6:9], full[:6]
    assert full.find(stop) == 6  # (the tiny random model repeats itself: a stop string found first there)
    body = {"model": "base", "prompt": "abc=", "max_tokens": 20, "stop": [stop], "logprobs": 2}
    content = _text(server, body)
    choice, lp = content["choices"][0], content["choices"][0]["logprobs"]
    assert choice["text"] == cut and choice["finish_reason"] == "stop"
    assert "".join(lp["tokens"]) == cut and lp["text_offset"] == list(range(len(cut)))
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(cut)
    assert content["usage"]["completion_tokens"] == len(cut) + len(stop)
    streamed = _streamed_logprobs(server, C, body)
    for key in ("tokens", "text_offset", "token_logprobs"):
        assert [x for part in streamed for x in part[key]] == lp[key], key


def test_chat_logprobs_end_where_a_stop_string_cuts_the_text(server):
    body = {"model": "sum", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 12,
            "logprobs": True, "top_logprobs": 2}
    full = _text(server, body)["choices"][0]["message"]["content"]
    stop, cut = full[4:6], full[:4]
    assert full.find(stop) == 4
    whole = _text(server, dict(body, stop=stop))["choices"][0]
    assert whole["message"]["content"] == cut and whole["finish_reason"] == "stop"
    assert "".join(c["token"] for c in whole["logprobs"]["content"]) == cut
    streamed = [c for part in _streamed_logprobs(server, H, dict(body, stop=stop)) for c in part["content"]]
    assert streamed == whole["logprobs"]["content"]


def test_mixed_settings_share_steps(server):
    """Greedy, sampled, penalised and logprob rows at once: each equals what it gets alone."""
    bodies = [{"model": "base", "prompt": "mix=", "max_tokens": 8},
              {"model": "upper", "prompt": "mix=", "max_tokens": 8, "temperature": 0.8, "seed": 5},
              {"model": "sum", "prompt": "mix=", "max_tokens": 8, "frequency_penalty": 1.0},
              {"model": "reverse", "prompt": "mix=", "max_tokens": 8, "logprobs": 1, "top_p": 0.5,
               "temperature": 1.0, "seed": 9}] * 3
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda b: _text(server, b)["choices"][0]["text"], bodies))
    alone = [_text(server, b)["choices"][0]["text"] for b in bodies[:4]]
    assert together == alone * 3
    assert together[0] == server.peft_text("mix=", "base", 8)
