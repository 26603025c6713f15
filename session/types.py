"""The value types the layers hand each other: chat messages, sampling parameters, usage, session ids.

Plain frozen dataclasses and pure functions, no I/O. The wire (``session.serving.protocol``) parses
into them; the engine, the model and the state layers read them.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, replace

from session.errors import InvalidSessionId

# ---------------------------------------------------------------- session ids

SESSION_ID_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
MAX_SESSION_ID_LEN = 256


def new_session_id(tag: str = "") -> str:
    """A uuid4, then ``-<tag>`` when given (the backend's routing tag): matches SageMaker's id pattern
    (token_urlsafe would not: it has underscores) and stays unguessable."""
    return f"{uuid.uuid4()}-{tag}" if tag else str(uuid.uuid4())


def validate_session_id(session_id: str) -> str:
    if len(session_id) > MAX_SESSION_ID_LEN or not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidSessionId(
            f"invalid session id {session_id[:64]!r}: must match {SESSION_ID_RE.pattern} "
            f"and be at most {MAX_SESSION_ID_LEN} characters"
        )
    return session_id


def redact(session_id: str | None) -> str:
    """A session id as logs show it: its first 8 characters and its routing tag, never the whole id
    (an id is a bearer credential: whoever reads it in a log could continue the session). Enough to
    follow one session through the logs; 32 bits are no use as a credential."""
    if not session_id or session_id == "NEW_SESSION" or len(session_id) <= 8:
        return session_id or "-"
    tag = session_id[37:] if len(session_id) > 37 and session_id[36] == "-" else ""
    return f"{session_id[:8]}...{'-' + tag if tag else ''}"


# ---------------------------------------------------------------- chat messages and sampling


@dataclass(frozen=True)
class ImagePart:
    url: str  # a data: URL (data:image/png;base64,...)


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    parts: tuple[TextPart | ImagePart, ...]
    # An assistant message's tool calls, as Hugging Face chat templates take them:
    # ({"type": "function", "id": ..., "function": {"name": ..., "arguments": {...}}}, ...)
    tool_calls: tuple[dict, ...] = ()
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the function's name (templates that print it)

    def template_content(self) -> list[dict]:
        """The content list a Hugging Face chat template expects (images as placeholders)."""
        return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.parts]

    def template_extras(self) -> dict:
        """The fields besides role and content that a chat template reads for tool use."""
        extras: dict = {}
        if self.tool_calls:
            extras["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            extras["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            extras["name"] = self.name
        return extras


MAX_TENANT_LEN = 128  # a tenant as the front names it: an id of at most 64 characters, or addr:<IPv6 address>
MIN_SAMPLING_TEMPERATURE = 1e-4
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


# How a JSON answer may be laid out: compact, a space after ":" and "," optional (what models were trained
# to write). Flexible whitespace lets a weak or noisy model spin on newlines until max_tokens, and an
# answer cut there is not JSON.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}


@dataclass(frozen=True)
class Constraint:
    """What a row's answer must match (``response_format``, a tool call, or our regex / grammar extensions).
    ``kind`` is the grammar engine's format: json_schema | regex | lark; ``source`` its canonical text (a
    schema as sorted JSON), so equal constraints share one compiled grammar."""

    kind: str
    source: str
    what: str = ""  # how errors name it: "response_format.json_schema", "tools", ...

    @classmethod
    def json_schema(cls, schema: dict, what: str, strict: bool = True) -> Constraint:
        """A JSON-schema constraint in canonical form (sorted keys: equal schemas share one grammar). The
        compile options are ours, a client's own "x-guidance" replaced. ``strict``: a keyword the grammar
        engine does not implement is a 400 naming it; not strict: it is ignored."""
        options = dict(JSON_STYLE, lenient=not strict)
        return cls(kind="json_schema", what=what,
                   source=json.dumps({**schema, "x-guidance": options}, sort_keys=True, ensure_ascii=False))

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0  # 0: every token
    min_tokens: int = 0  # EOS is banned until the answer has this many tokens
    ignore_eos: bool = False  # EOS is banned: the answer runs to max_tokens (benchmark clients)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token the answer already holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the answer so far
    repetition_penalty: float = 1.0  # transformers' / vLLM's: over the transcript and the answer
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the k likeliest
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        # Below this the sampled distribution is the argmax anyway, and logits / T would overflow.
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def processed(self) -> bool:
        """Whether anything changes the row's logits before sampling (beyond temperature, top-k, top-p)."""
        return bool(self.min_tokens or self.ignore_eos or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.constraint is not None)

    @property
    def plain(self) -> bool:
        """Nothing but temperature / top-p and no log-probabilities: the rows speculation takes as they are."""
        return not self.processed and self.logprobs is None and not self.top_k

    @property
    def speculable(self) -> bool:
        """The rows speculative decoding takes: plain ones, and greedy ones whose only processor is a
        grammar (drafts proposed and verified under its mask, ``SpeculativeDecoder``)."""
        if self.plain:
            return True
        return self.greedy and self.constraint is not None and replace(self, constraint=None).plain


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the ``top`` likeliest at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), likeliest first


# ---------------------------------------------------------------- what an answer cost


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the session's KV instead of recomputed

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
