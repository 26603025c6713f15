"""How a request's answers are shaped: ``_ChatAnswer`` (a chat completion: content, or content and
tool calls parsed out of it) and ``_TextAnswer`` (a /v1/completions answer), each as one body or as
stream chunks; and ``_total_usage``, the usage of a request's ``n`` rows together.

No I/O. The chat service (``api``) picks the shaper for each request and asks it for a plain answer's
body; ``RowStreams.chunks`` asks it for a stream's chunks, event by event, on the front door's loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from session.engine.events import Finished, TextDelta
from session.serving.answer_bodies import (
    CompletionIds,
    chunk_body,
    completion_body,
    legacy_logprobs,
    message_choice,
    text_choice,
    text_completion_body,
)
from session.serving.chat_request import ChatRequest
from session.serving.tool_calls import ToolCall, streamable_prefix
from session.serving.tools import ToolSupport, finish_reason
from session.types import Usage

if TYPE_CHECKING:  # row_streams imports this module
    from session.serving.row_streams import _Choice


class _ChatAnswer:
    """A chat completion's answers: content, or content and tool calls parsed out of it."""

    def __init__(self, request: ChatRequest, tools: ToolSupport | None):
        self.request = request
        self.choice_mode = request.tool_choice
        self.tools = tools if request.tool_choice.mode != "none" else None

    def ids(self, model: str) -> CompletionIds:
        return CompletionIds(model=model)

    def choice(self, index: int, finished: Finished, shape_logprobs) -> dict:
        content, calls = self._parsed(finished.text)
        return message_choice(index, content, finish_reason(finished.finish_reason, calls, self.choice_mode),
                              shape_logprobs(finished.logprobs), [call.to_openai() for call in calls])

    def body(self, ids: CompletionIds, choices: list[dict], usage: Usage, session_id: str | None) -> dict:
        return completion_body(ids, choices, usage, session_id)

    def first_chunks(self, ids: CompletionIds, choice: _Choice) -> list[dict]:
        return [chunk_body(ids, {"role": "assistant", "content": ""}, index=choice.index)]

    def usage_chunk(self, ids: CompletionIds, usage: Usage) -> dict:
        return chunk_body(ids, None, usage=usage)

    def _parsed(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return (text, []) if self.tools is None else self.tools.answer(text, self.choice_mode)

    def chunks(self, choice: _Choice, event, ids: CompletionIds, shape_logprobs) -> list[dict]:
        """The chunks one event of ``choice`` makes. Content goes out as it comes, but for what may be a
        tool call (``streamable_prefix``), which is settled when the answer is finished: its calls as
        ``delta.tool_calls``, one chunk each."""
        wants_logprobs = self.request.sampling.logprobs is not None
        out = []
        if isinstance(event, TextDelta):
            choice.text += event.text
            choice.logprobs += event.logprobs
            end = len(choice.text) if self.tools is None else self._streamable(choice.text, self.tools)
            if end > choice.num_text_sent:
                logprobs = shape_logprobs(choice.logprobs[choice.num_logprobs_sent:]) if wants_logprobs else None
                choice.num_logprobs_sent = len(choice.logprobs)
                out.append(chunk_body(ids, {"content": choice.text[choice.num_text_sent:end]}, logprobs=logprobs,
                                      index=choice.index))
                choice.num_text_sent = end
            return out
        assert isinstance(event, Finished)
        content, calls = self._parsed(event.text)
        owed = _unsent(content, event.text[:choice.num_text_sent])
        if owed:
            out.append(chunk_body(ids, {"content": owed}, index=choice.index))
        out += [chunk_body(ids, {"tool_calls": [call.to_openai(k)]}, index=choice.index)
                for k, call in enumerate(calls)]
        # the engine sets Finished.logprobs whenever the request asked for them
        rest = shape_logprobs(list((event.logprobs or ())[choice.num_logprobs_sent:])) if wants_logprobs else None
        out.append(chunk_body(ids, {}, finish_reason=finish_reason(event.finish_reason, calls, self.choice_mode),
                              logprobs=rest, index=choice.index))
        return out

    def _streamable(self, text: str, tools: ToolSupport) -> int:
        if self.choice_mode.mode in ("required", "function"):
            return 0  # the answer is calls, all of it
        return streamable_prefix(text, tools.fmt)


def _unsent(content: str | None, sent: str) -> str:
    """What the stream still owes of the answer's final ``content`` (``choice``'s message content) after
    ``sent``: None (a forced call, even one cut short) owes nothing; text after a call is owed. Content
    around calls is stripped, so ``sent`` may carry spaces it lacks."""
    if content is None:
        return ""
    for prefix in (sent, sent.lstrip(), sent.strip()):
        if content.startswith(prefix):
            return content[len(prefix):]
    return ""


class _TextAnswer:
    """A /v1/completions answer: the prompt's continuation as text (after the prompt, with ``echo``)."""

    def __init__(self, request: ChatRequest, echo: str):
        self.request = request
        self.echo = echo

    def ids(self, model: str) -> CompletionIds:
        return CompletionIds.text(model)

    def choice(self, index: int, finished: Finished, shape_logprobs) -> dict:
        entries = shape_logprobs(finished.logprobs)
        logprobs = None if entries is None else legacy_logprobs(entries, len(self.echo))
        return text_choice(index, self.echo + finished.text, finished.finish_reason, logprobs)

    def body(self, ids: CompletionIds, choices: list[dict], usage: Usage, session_id: str | None) -> dict:
        return text_completion_body(ids, choices, usage)

    def first_chunks(self, ids: CompletionIds, choice: _Choice) -> list[dict]:
        choice.num_text_sent = len(self.echo)
        return [text_completion_body(ids, [text_choice(choice.index, self.echo, None)], None)] if self.echo else []

    def usage_chunk(self, ids: CompletionIds, usage: Usage) -> dict:
        return text_completion_body(ids, [], usage)

    def chunks(self, choice: _Choice, event, ids: CompletionIds, shape_logprobs) -> list[dict]:
        wants_logprobs = self.request.sampling.logprobs is not None
        entries = () if not wants_logprobs else event.logprobs if isinstance(event, TextDelta) else \
            event.logprobs[choice.num_logprobs_sent:]
        logprobs = legacy_logprobs(shape_logprobs(list(entries)), choice.num_text_sent) if wants_logprobs else None
        choice.num_logprobs_sent += len(entries)
        if isinstance(event, TextDelta):
            choice.num_text_sent += len(event.text)
            return [text_completion_body(ids, [text_choice(choice.index, event.text, None, logprobs)], None)]
        return [text_completion_body(ids, [text_choice(choice.index, "", event.finish_reason, logprobs)], None)]


def _total_usage(usages: list[Usage]) -> Usage:
    """The n rows' usage: the prompt counted once (OpenAI's), the answers' tokens summed, and the most
    prompt tokens any row found cached."""
    return Usage(prompt_tokens=usages[0].prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=max(u.cached_tokens for u in usages))
