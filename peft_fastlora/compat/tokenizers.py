"""transformers' tokenizers: decoding without the checks ``decode`` makes on every call."""

from __future__ import annotations

from typing import Callable, List


def skip_special_decoder(tokenizer) -> Callable[[List[int]], str]:
    """A function equal to ``tokenizer.decode(ids, skip_special_tokens=True)`` for a list of int ids.

    For a fast tokenizer that keeps transformers' own ``decode`` and ``_decode`` and does not clean
    up tokenization spaces, that is the Rust tokenizer's ``decode``: transformers' first walks the
    ids (``to_py_obj`` checks each one's type) and dispatches, which costs more than the Rust call
    on the few tokens a streamed answer decodes at a time. Any other tokenizer: its own ``decode``.
    """
    def plain(ids: List[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (a transformers that moved them: the plain call is always right)
        return plain
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode or tokenizer.clean_up_tokenization_spaces
            or not callable(getattr(backend, "decode", None))):
        return plain
    decode = backend.decode

    def rust(ids: List[int]) -> str:
        return decode(ids, skip_special_tokens=True)

    return rust
