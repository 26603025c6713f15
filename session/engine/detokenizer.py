"""Token ids to text, incrementally: what a streamed answer has made final so far.

Who calls this: the output processor, once per sampled token of a sequence (session/engine/outputs.py).
"""

from __future__ import annotations

from collections.abc import Callable


def text_of(tokenizer, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)``, straight to the Rust tokenizer where
    transformers' wrapper adds nothing to it (its fast tokenizer's own ``_decode``, no clean-up of
    spaces): the wrapper's argument handling cost more than the decode itself, twice per token."""
    def own(ids: list[int]) -> str:  # the wrapper's decode
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode
        return own
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
            and backend is not None and hasattr(backend, "decode")):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return own


class Detokenizer:
    """Incremental decoding of one answer (the prefix-window method of TGI and vLLM).

    ``prefix_offset .. read_offset`` are tokens already turned into text; they are decoded again with
    each new token only as left context, so that tokenizers which drop a word's leading space at the
    start of a string (SentencePiece) and byte-fallback pieces that complete a character later both
    produce the same text as decoding the whole answer at once.
    """

    def __init__(self, tokenizer, decode: Callable[[list[int]], str] | None = None):
        self.decode = decode or text_of(tokenizer)  # ``decode``: text_of(tokenizer), made once by the caller
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; returns the new text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        prefix = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the answer: the text still held back (an incomplete character decodes as
        U+FFFD, exactly as decoding the whole answer would)."""
        prefix = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += full[len(prefix):]
        return full[len(prefix):]
