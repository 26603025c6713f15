"""Constrained decoding: a row's answer held to a JSON schema, a regex or a Lark grammar (llguidance).

docs/STRUCTURED_OUTPUT.md says why llguidance and what it costs. The pieces:

- ``GrammarCompiler``: built on first use from the tokenizer (the vocabulary scan, ~0.3 s); compiles a
  ``Constraint`` into a ``Grammar`` on the caller's thread (never the engine's), caching the compiled
  matcher by the constraint's hash (LRU). Compile work is bounded by llguidance's default parser limits
  (``LLParserLimits``); a grammar over them fails as a 400 (the worst-case time is not measured yet).
- ``Grammar``: a compiled constraint; ``start()`` gives a fresh matcher for one row (a deep copy:
  microseconds, the compiled lexer is shared).
- ``fill_masks`` / ``apply_masks``: the step's bitmask, one int32 row of ceil(V/32) words per constrained
  row, filled on the host into a preallocated (pinned on CUDA) tensor, copied to the logits' device
  without blocking and unpacked there: no extra host sync in the step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from cachetools import LRUCache

from session.errors import BadRequest
from session.types import Constraint

if TYPE_CHECKING:  # llguidance is imported when a compiler is made
    from llguidance import LLMatcher

DEFAULT_MAX_CACHED = 256


class Grammar:
    """One compiled constraint. ``start`` hands each row its own matcher (any thread)."""

    def __init__(self, constraint: Constraint, matcher: LLMatcher):
        self.constraint = constraint
        self._matcher = matcher  # never consumes: the template every row's matcher copies

    def start(self) -> LLMatcher:
        return self._matcher.deep_copy()


class GrammarCompiler:
    """Who calls this: the serving layer, on the request's own thread before it reaches the engine
    (``Engine.compile_grammar``); thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], max_cached: int = DEFAULT_MAX_CACHED):
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.limits = llguidance.LLParserLimits(verbose_errors=False)  # an error never echoes the grammar back
        self._cache: LRUCache = LRUCache(maxsize=max_cached)  # constraint key -> Grammar
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, constraint: Constraint) -> Grammar:
        """The constraint's Grammar, compiled now or taken from the cache; BadRequest naming what is wrong."""
        key = constraint.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self.num_cache_hits += 1
                return cached
        grammar = Grammar(constraint, self._matcher(constraint))
        with self._lock:
            self._cache[key] = grammar
            self.num_compiled += 1
        return grammar

    def special_token_ids(self, texts: Sequence[str], hf_tokenizer) -> dict[str, int]:
        """Which of ``texts`` the vocabulary holds as one special token (llguidance's view: a grammar
        must name such a token by id, ``<[id]>``; a literal never matches it) -> its id."""
        found = {}
        for text in texts:
            token_id = hf_tokenizer.convert_tokens_to_ids(text)
            if (isinstance(token_id, int) and token_id != hf_tokenizer.unk_token_id and token_id < self.vocab_size
                    and self.tokenizer.is_special_token(token_id)):
                found[text] = token_id
        return found

    def _matcher(self, constraint: Constraint) -> LLMatcher:
        llg = self._llg
        try:
            if constraint.kind == "json_schema":
                text = llg.LLMatcher.grammar_from_json_schema(constraint.source)
            elif constraint.kind == "regex":
                text = llg.LLMatcher.grammar_from_regex(constraint.source)
            elif constraint.kind == "lark":
                text = llg.grammar_from("grammar", constraint.source)  # Lark, or GBNF converted to Lark
            else:
                raise BadRequest(f"unknown constraint kind {constraint.kind!r}")
        except ValueError as exc:
            raise BadRequest(f"{constraint.what or constraint.kind} is not valid: {exc}") from None
        matcher = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise BadRequest(f"{constraint.what or constraint.kind} is not supported: {_short(matcher.get_error())}")
        return matcher


def _short(error: str) -> str:
    return error if len(error) <= 400 else error[:400] + "..."


# ---------------------------------------------------------------- masks


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(matchers: Sequence[LLMatcher], vocab_size: int, pin: bool = False) -> torch.Tensor:
    """The allowed next tokens of each matcher: int32 [N, ceil(V/32)], bit j of word w is token 32w+j.
    Host memory (pinned for a CUDA step); llguidance writes it directly."""
    masks = torch.empty((len(matchers), mask_words(vocab_size)), dtype=torch.int32, pin_memory=pin)
    row_bytes = masks.shape[1] * 4
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(masks[i].data_ptr(), row_bytes)
    return masks


_BITS: dict[torch.device, torch.Tensor] = {}


def unpack_masks(masks: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """int32 [N, W] bitmasks -> bool [N, V] on ``device`` (copied without blocking, unpacked there)."""
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS.setdefault(device, torch.arange(32, dtype=torch.int32, device=device))
    words = masks.to(device, non_blocking=True)
    return ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with the tokens each listed row's mask forbids made impossible (out of place)."""
    allowed = unpack_masks(masks, logits.shape[-1], logits.device)  # [N, V]
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
