"""OpenAI-style tool calling: the request's ``tools``/``tool_choice``, the model's call format, the
calls parsed out of an answer, and the grammar that forces an answer to be calls.

Pure functions and frozen dataclasses; no I/O, no torch. The chat service calls them in this order:

1. ``parse_tools`` / ``parse_tool_choice`` while parsing the request (a BadRequest names the field).
2. ``detect_tool_format`` and ``template_renders_tools`` once per model, from its chat template; a
   template that ignores ``tools`` gets ``tools_system_prompt`` added to the system message instead.
3. ``tool_call_grammar`` for ``tool_choice`` "required" or a named function: a Lark grammar for the
   constrained-decoding compiler (llguidance), which holds the answer to that format and schema.
4. While streaming, ``streamable_prefix`` says how much of the answer-so-far is surely content; at the
   end ``parse_tool_calls`` splits the finished answer into content and calls.

The answer text handed to ``streamable_prefix`` and ``parse_tool_calls`` must be decoded with special
tokens kept: "[TOOL_CALLS]" or "<|python_tag|>" are special tokens in their vocabularies, and the
parser looks for their text.

Its modules, by job: ``tool_fields`` (the request's fields), ``tool_format`` (the model's format),
``tool_prompt`` (tools in a template that ignores them), ``tool_calls`` (parsing and streaming),
``tool_grammar`` (the forcing grammar). This one holds ``ToolSupport``, which puts them together for
one served model, and ``finish_reason``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from session.serving.tool_calls import ToolCall, parse_tool_calls
from session.serving.tool_fields import Tool, ToolChoice
from session.serving.tool_format import ToolFormat, detect_tool_format, template_renders_tools
from session.serving.tool_grammar import tool_call_grammar
from session.serving.tool_prompt import _untooled, _with_system_text, tools_system_prompt
from session.types import Constraint, Message


@dataclass(frozen=True)
class ToolSupport:
    """What one served model does with tools, found once from its chat template and vocabulary
    (``ToolSupport.of``); the chat service asks it for each request that has tools or tool messages."""

    fmt: ToolFormat
    renders_tools: bool  # the template reads ``tools`` and renders tool calls and results itself
    special_token_ids: dict = field(default_factory=dict, hash=False)  # marker text -> its special token id

    @classmethod
    def of(cls, chat_template: str | None, special_token_ids: dict[str, int]) -> ToolSupport:
        """``special_token_ids``: which of ``MARKERS`` the vocabulary holds as one special token."""
        return cls(detect_tool_format(chat_template), template_renders_tools(chat_template), special_token_ids)

    def prompt(self, messages: tuple[Message, ...], tools: tuple[Tool, ...],
               opening: bool) -> tuple[tuple[Message, ...], list[dict] | None]:
        """The messages a turn renders and the ``tools`` its template gets. A template that renders
        tools gets them as they are (in an opening: a follow-up's transcript holds them already); for
        one that does not, the tools are described in the system message (``tools_system_prompt``), an
        assistant's calls written as text in ``fmt`` and each tool result as a user turn in
        <tool_response> tags (Hermes' convention), so the model sees what it called and got back."""
        if self.renders_tools:
            return messages, [tool.to_template() for tool in tools] if opening and tools else None
        messages = tuple(_untooled(message, self.fmt) for message in messages)
        if opening and tools:
            messages = _with_system_text(messages, tools_system_prompt(tools, self.fmt))
        return messages, None

    def grammar(self, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> Constraint | None:
        """The constraint that makes the answer calls ("required" or a named function), else None."""
        text = tool_call_grammar(tools, choice, self.fmt, parallel, self.special_token_ids)
        return None if text is None else Constraint("lark", text, "tools")

    def answer(self, text: str, choice: ToolChoice) -> tuple[str | None, list[ToolCall]]:
        """A finished answer -> (content, calls); all content when tools are off ("none"). A forced
        answer ("required", a named function) is calls only: one cut by max_tokens keeps its whole
        calls and no content (not the markup of the call it was cut in)."""
        if choice.mode == "none":
            return text, []
        content, calls = parse_tool_calls(text, self.fmt)
        return (None, calls) if choice.mode in ("required", "function") else (content, calls)


def finish_reason(reason: str, calls: list[ToolCall], choice: ToolChoice) -> str:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a call the request named
    ends as "stop", as OpenAI answers a named tool_choice."""
    if calls and choice.mode != "function" and reason == "stop":
        return "tool_calls"
    return reason
