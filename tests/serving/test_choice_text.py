"""A completion's text as the endpoint streams it (``server.choices.Choice``), against the whole
completion decoded at once: byte-level BPE (characters split across tokens) and a SentencePiece-
style tokenizer (a word's leading space carried by its token), with and without stop strings. The
stream decodes a short window a token, so its cost stays flat as an answer grows."""

from __future__ import annotations

import random
import time

import pytest

from peft_fastlora.compat.tokenizers import skip_special_decoder
from peft_fastlora.continuous.sampling import TokenLogprobs
from peft_fastlora.server.choices import Answer, Choice, completion_logprobs, event

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


def _entries(ids):
    """Log-probability records of ``ids`` as the engine keeps them (one a generated token)."""
    return [TokenLogprobs(token=t, logprob=-float(i), top=[(t, -float(i))]) for i, t in enumerate(ids)]


def _logprobs_streamed(tokenizer, ids, stop, rng=None):
    """(the choice, its entries, their offsets) streamed as ``service`` asks, the outputs arriving
    one token at a time (or ``rng``'s number of tokens at a time: a reader that fell behind)."""
    choice = Choice(0, "r", 3, len(ids), list(stop), [], tokenizer)
    entries, offsets, n = [], [], 0
    while not choice.finished:
        n = min(len(ids), n + (rng.randrange(1, 12) if rng else 1))
        choice.update(ids[:n], n == len(ids), None)
        choice.new_text()
        offset, new = choice.logprobs_offset, choice.new_logprobs(_entries(ids))
        offsets += completion_logprobs(new, tokenizer, offset)["text_offset"]
        entries += new
    return choice, entries, offsets


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_logprobs_of_an_answer_cut_at_a_stop_string_are_its_texts(make):
    """The entries are those of the tokens that begin before the cut: the fewest whose text starts
    with the answer's (the token straddling the cut kept, those of the stop string dropped), the
    same streamed or not; usage still counts the tokens up to the one completing the stop string."""
    tokenizer = make()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    straddled = 0
    for stop in (["wörld"], ["rld"], ["café", "zzz"], ["x ** 2"], ["東京"], ["é eve"], ["Héllo"]):
        choice = Choice(0, "r", 3, len(ids), stop, [], tokenizer)
        choice.update(ids, False, None)  # the whole output at once, the engine going on
        text = choice.text()
        assert choice.finish_reason == "stop" and text == whole[:min(whole.find(s) for s in stop if s in whole)]
        kept = choice.new_logprobs(_entries(ids))
        k = len(kept)
        assert [e.token for e in kept] == ids[:k] and k <= choice.completion_tokens, stop
        assert tokenizer.decode(ids[:k]).startswith(text), stop  # every token of the text keeps its entry
        assert k == 0 or not tokenizer.decode(ids[:k - 1]).startswith(text), stop  # and no other
        straddled += len(tokenizer.decode(ids[:k])) > len(text)
        n = choice.completion_tokens
        assert stop[0] in tokenizer.decode(ids[:n]) and stop[0] not in tokenizer.decode(ids[:n - 1])
        for rng in (None, random.Random(7)):
            streamed, entries, offsets = _logprobs_streamed(tokenizer, ids, stop, rng)
            assert streamed.text() == text and entries == kept, stop
            assert offsets == completion_logprobs(kept, tokenizer)["text_offset"], stop
    assert straddled  # a stop string beginning inside a token was among them


def test_logprobs_text_offsets_lie_in_the_text_cut_at_a_stop_string():
    """Tokens of whole characters: the offsets lie in the text and the tokens' texts join to it
    (the straddling token's text running past its end)."""
    tokenizer = _byte_level()
    text = "everywhere, naïve café, and code: def f(x): return x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(tokenizer.decode([t]) for t in ids) == text
    straddled = 0
    for stop in (["rywh"], ["afé"], ["everywhere"], [", "], ["turn"], ["ev"]):
        choice = Choice(0, "r", 3, len(ids), stop, [], tokenizer)
        for i in range(len(ids)):
            if choice.update(ids[:i + 1], False, None):
                break
        lp = completion_logprobs(choice.new_logprobs(_entries(ids)), tokenizer)
        cut = choice.text()
        assert cut == text[:text.find(stop[0])]
        assert all(0 <= o < len(cut) for o in lp["text_offset"]), (stop, lp["text_offset"], cut)
        assert "".join(lp["tokens"]).startswith(cut), stop
        straddled += len("".join(lp["tokens"])) > len(cut)
    assert straddled == 2  # "rywh" and "afé" begin inside a token


def test_logprobs_without_a_stop_string_are_every_generated_tokens_but_the_end_token():
    tokenizer = _byte_level()
    ids = tokenizer.encode("naïve café", add_special_tokens=False)
    end = tokenizer.encode("!", add_special_tokens=False)[0]
    choice = Choice(0, "r", 3, 50, [], [end], tokenizer)
    choice.update(ids + [end], True, None)
    assert choice.finish_reason == "stop" and choice.completion_tokens == len(ids) + 1
    assert [e.token for e in choice.new_logprobs(_entries(ids + [end]))] == ids


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_the_streams_decoder_is_the_tokenizers_decode(make):
    """The Rust tokenizer's decode where transformers' adds nothing to it; the tokenizer's own
    decode where it does (spaces cleaned up, a class of its own)."""
    tokenizer = make()
    rng = random.Random(5)
    samples = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 12))] for _ in range(50)]
    samples.append(tokenizer.encode(TEXT, add_special_tokens=False))

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = make()
    shouting.__class__ = Shouting
    cleaning = make()
    cleaning.clean_up_tokenization_spaces = True
    assert skip_special_decoder(tokenizer).__name__ == "rust"
    for tok in (tokenizer, shouting, cleaning):
        if tok is not tokenizer:
            assert skip_special_decoder(tok).__name__ == "plain"
        decode = skip_special_decoder(tok)
        for ids in samples:
            assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_text_chunk_is_the_json_of_its_chunk(chat):
    """The stream's text chunks, rendered around the text once per answer, are the bytes
    ``json.dumps`` makes of the chunk: quotes, control characters, non-ASCII text, lone
    surrogates, odd model names."""
    texts = [" token", 'a"b\\c\n\t/', "Héllo 中文 🙂", "\ud800 lone", "\x00\x1f\x7f", "</s>", "{}[],:"]
    for model in ("base", 'my "adapter"/v2', "naïve-ü"):
        answer = Answer("cmpl-0123", model, chat, _byte_level())
        for index in (0, 3, 127):
            for text in texts:
                assert answer.text_event(index, text) == event(answer.chunk(index, text, None)), (model, text)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_decode_each_token_alone_once(chat):
    """A streamed answer with log-probabilities decodes each token's own text once, for its offset
    and its entry together (not once for each); the chunks' entries equal those of the whole."""
    tokenizer = _byte_level()
    ids = tokenizer.encode(TEXT[:200], add_special_tokens=False)
    entries = _entries(ids)
    alone = []
    decode = tokenizer.decode

    def counting(tokens, *args, **kwargs):
        if len(tokens) == 1:
            alone.append(tokens[0])
        return decode(tokens, *args, **kwargs)

    tokenizer.decode = counting
    answer = Answer("r", "m", chat, tokenizer)
    choice = Choice(0, "r", 3, len(ids), [], [], tokenizer)
    chunks = []
    for i in range(len(ids)):
        choice.update(ids[:i + 1], i == len(ids) - 1, None)
        choice.new_text()
        offset, new = choice.logprobs_offset, choice.new_logprobs(entries)
        chunks.append(answer.logprobs(new, offset, choice.token_text))
    assert sorted(alone) == sorted(set(ids)), "a token's text was decoded alone more than once"
    key = "content" if chat else "tokens"
    streamed = [item for c in chunks for item in c[key]]
    assert streamed == answer.logprobs(entries, 0)[key]
