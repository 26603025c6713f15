"""The OpenAI answer bodies: a chat completion and its stream chunks, a text completion and its
chunks, their ids and log-probabilities.

Pure functions and a dataclass; no I/O. Called by the answer shapers (``answers``) for each choice,
chunk and body they make.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from session.types import Usage


@dataclass
class CompletionIds:
    """Identifiers shared by a completion and all of its stream chunks."""

    model: str
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def text(cls, model: str) -> CompletionIds:
        """A /v1/completions answer's ids ("cmpl-...")."""
        return cls(model=model, id="cmpl-" + uuid.uuid4().hex)


def logprobs_body(entries: list[dict] | None) -> dict | None:
    """OpenAI's choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...]} (None: not asked)."""
    return None if entries is None else {"content": entries, "refusal": None}


def message_choice(index: int, content: str | None, finish_reason: str, logprobs: list[dict] | None = None,
                   tool_calls: list[dict] | None = None) -> dict:
    """One of a chat completion's ``choices``; ``tool_calls`` (``ToolCall.to_openai``) only when the model called."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": index, "message": message, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs_body(logprobs)
    return choice


def completion_body(ids: CompletionIds, choices: list[dict], usage: Usage, session_id: str | None) -> dict:
    body = {
        "id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
        "choices": choices,
        "usage": usage.to_dict(),
    }
    if session_id is not None:
        body["session_id"] = session_id
    return body


def chunk_body(ids: CompletionIds, delta: dict | None, finish_reason: str | None = None,
               usage: Usage | None = None, logprobs: list[dict] | None = None, index: int = 0) -> dict:
    """One stream chunk of choice ``index``; ``delta`` None: the usage-only last chunk (``choices: []``)."""
    choices = []
    if delta is not None:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = logprobs_body(logprobs)
        choices.append(choice)
    body = {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage.to_dict()
    return body


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One of a /v1/completions answer's (or chunk's) ``choices``."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion_body(ids: CompletionIds, choices: list[dict], usage: Usage | None) -> dict:
    """A /v1/completions answer, or (``usage`` None) one of its stream's chunks; a chunk with usage and
    ``choices`` [] is the stream's last when ``include_usage`` was asked."""
    body = {"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage.to_dict()
    return body


def legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """Chat-shaped log-probability entries (``{token, logprob, top_logprobs}``) in /v1/completions'
    older shape; ``offset``: where the first token's text starts in the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
