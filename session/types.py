"""The value types the layers hand each other: chat messages, sampling parameters, usage, session ids.

Plain frozen dataclasses and pure functions, no I/O. The wire (``session.serving.protocol``) parses
into them; the engine, the model and the state layers read them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

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
    role: str  # system | user | assistant
    parts: tuple[TextPart | ImagePart, ...]

    def template_content(self) -> list[dict]:
        """The content list a Hugging Face chat template expects (images as placeholders)."""
        return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.parts]


MIN_SAMPLING_TEMPERATURE = 1e-4
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        # Below this the sampled distribution is the argmax anyway, and logits / T would overflow.
        return self.temperature < MIN_SAMPLING_TEMPERATURE


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
