"""A character-level tokenizer for the examples: one token per character, no downloads.

It is a ``tokenizers`` WordLevel model whose pre-tokenizer splits the text into single characters,
wrapped in transformers' ``PreTrainedTokenizerFast``. That gives the full Hugging Face tokenizer API
(padding, ``batch_decode``, ``save_pretrained`` / ``AutoTokenizer.from_pretrained``), so it can stand
in for a real tokenizer in the demo notebook, the serving script and the tests.
"""

from __future__ import annotations

import string
from typing import Iterable, Optional

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
DEFAULT_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " :=-+.,!?"


def build_char_tokenizer(chars: Optional[Iterable[str]] = None) -> PreTrainedTokenizerFast:
    """A char-level tokenizer over ``chars`` (default: letters, digits, space and a few symbols).

    Token ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3, then the characters in order.
    ``tokenizer(text)`` prepends ``<s>``; any character outside the vocabulary becomes ``<unk>``.
    Padding is on the left, as batched generation with a decoder-only model needs.
    """
    chars = list(dict.fromkeys(DEFAULT_CHARS if chars is None else chars))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char a token
    tok.decoder = decoders.Fuse()  # join the characters back without separators
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        padding_side="left", model_max_length=512)
