"""A completion's text as the endpoint streams it (``server.choices.Choice``), against the whole
completion decoded at once: byte-level BPE (characters split across tokens) and a SentencePiece-
style tokenizer (a word's leading space carried by its token), with and without stop strings. The
stream decodes a short window a token, so its cost stays flat as an answer grows."""

from __future__ import annotations

import random
import time

import pytest

from peft_fastlora.server.choices import Choice

TEXT = ("Héllo wörld! Ça va? 中文字符 and emoji 🙂🚀 mixed with code: "
        "def f(x): return x ** 2 # ok\n"
        "Ünïcödé everywhere, naïve café, smörgåsbord, 東京, Ελληνικά, русский текст. ") * 3


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _stream(tokenizer, ids, stop=(), end_ids=()):
    """(the text streamed, the choice) of ``ids`` arriving one token at a time."""
    choice = Choice(0, "r", 3, len(ids), list(stop), list(end_ids), tokenizer)
    streamed = ""
    for i in range(len(ids)):
        ended = choice.update(ids[:i + 1], i == len(ids) - 1, None)
        streamed += choice.new_text()
        if ended:
            break
    return streamed, choice


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_streamed_text_is_the_whole_decode(make):
    tokenizer = make()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 50
    pieces = [tokenizer.decode(ids[i:i + 1]) for i in range(len(ids))]
    assert any("\ufffd" in p for p in pieces) or make is _metaspace  # characters split across tokens
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for cut in (len(ids), 37, 101):  # ends mid-character too
        streamed, choice = _stream(tokenizer, ids[:cut])
        assert streamed == choice.text() == tokenizer.decode(ids[:cut], skip_special_tokens=True), cut
    assert _stream(tokenizer, ids)[0] == whole


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_random_tokens_stream_what_they_decode_to(make):
    tokenizer = make()
    rng = random.Random(3)
    for trial in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 80))]
        streamed, choice = _stream(tokenizer, ids)
        assert streamed == choice.text() == tokenizer.decode(ids, skip_special_tokens=True), (trial, ids)


def test_stop_strings_cut_the_stream_where_the_whole_text_would_be_cut():
    tokenizer = _byte_level()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for stop in (["🚀"], ["café", "zzz"], ["x ** 2"], ["\n"]):
        streamed, choice = _stream(tokenizer, ids, stop=stop)
        whole = tokenizer.decode(ids)
        expected = whole[:min(whole.find(s) for s in stop if s in whole)]
        assert choice.finished and choice.finish_reason == "stop", stop
        assert streamed == choice.text() == expected, stop


def test_a_tokens_cost_stays_flat_as_the_answer_grows():
    """Decoding the whole completion at every token made a 4,000-token answer cost quadratically;
    the incremental window keeps the late tokens about as cheap as the early ones."""
    tokenizer = _byte_level()
    ids = (tokenizer.encode(TEXT, add_special_tokens=False) * 40)[:4000]
    choice = Choice(0, "r", 3, len(ids), [], [], tokenizer)
    times = []
    for i in range(len(ids)):
        t = time.perf_counter()
        choice.update(ids[:i + 1], False, None)
        choice.new_text()
        times.append(time.perf_counter() - t)
    early, late = sorted(times[200:700])[250], sorted(times[3500:4000])[250]  # medians
    assert late < 4 * early, (early, late)


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_outputs_arriving_several_tokens_at_a_time_end_where_one_at_a_time_would(make):
    """A reader that fell behind takes only the engine's newest output (the whole completion so
    far): a stop string found in it keeps the tokens up to the one that completed it, the same
    tokens, text and count as updates one token at a time."""
    tokenizer = make()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(5)
    for stop in (["wörld"], ["café", "!"], ["x ** 2"], ["東京"]):
        _, one_by_one = _stream(tokenizer, ids, stop=stop)
        assert one_by_one.finish_reason == "stop" and one_by_one.completion_tokens < len(ids)
        for trial in range(5):
            choice, n = Choice(0, "r", 3, len(ids), stop, [], tokenizer), 0
            while not choice.finished:
                n = min(len(ids), n + rng.randrange(1, 40))
                choice.update(ids[:n], n == len(ids), None)
            assert choice.tokens == one_by_one.tokens, (stop, trial)
            assert choice.text() == one_by_one.text() and choice.finish_reason == "stop"
