"""The tool calls in a model's answer: ``ToolCall``, ``parse_tool_calls`` for a finished answer, and
``streamable_prefix`` for how much of an answer-so-far is surely content.

The answer text must be decoded with special tokens kept: "[TOOL_CALLS]" or "<|python_tag|>" are
special tokens in their vocabularies, and the parser looks for their text. Pure functions; no I/O.
Called by ``ToolSupport.answer`` (``tools``) once per answer and by the stream shaper (``answers``)
after each decoded piece.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, replace
from typing import Any

from session.serving.tool_format import HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, PYTHON_TAG, ToolFormat


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        """One entry of ``message.tool_calls``; with ``index`` for a stream's ``delta.tool_calls``."""
        body: dict[str, Any] = {} if index is None else {"index": index}
        body.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return body


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


MISTRAL_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates refuse a call id that is not 9 letters and digits (the id comes back with the
    tool's result)."""
    return "".join(secrets.choice(MISTRAL_ID_ALPHABET) for _ in range(9))


# ---------------------------------------------------------------- parsing answers


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """A finished answer -> (content, calls). Content is the text outside the calls, stripped, None
    when empty; a call whose JSON does not parse stays in the content. Called once per answer."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return _parse_llama3(text)
    if fmt is ToolFormat.MISTRAL:
        return _parse_mistral(text)
    return _parse_hermes(text)


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    content: list[str] = []  # the text between the calls, and each call that does not parse
    pos = 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        call, pos = _hermes_call(text, start + len(HERMES_OPEN))
        if call is None:
            content.append(text[start:pos])
        else:
            calls.append(call)
    content.append(text[pos:])
    return _content("".join(content)), calls


def _hermes_call(text: str, pos: int) -> tuple[ToolCall | None, int]:
    """The call whose JSON starts at ``pos`` and where it ends (after its closing tag, which may be
    missing). The JSON is decoded, not searched for the tag: an argument may contain "</tool_call>".
    A call that does not parse ends at its closing tag, or at the end of the text."""
    value, end = _decode_at(text, pos)
    call = _call_from_object(value, "arguments")
    if call is None:
        close = text.find(HERMES_CLOSE, pos)
        return None, len(text) if close < 0 else close + len(HERMES_CLOSE)
    after = _skip_space(text, end)
    return call, after + len(HERMES_CLOSE) if text.startswith(HERMES_CLOSE, after) else end


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    """Calls only when the answer is calls: after "<|python_tag|>" or, without it, when the answer
    starts with "{"; several are separated by ";"."""
    head, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        head, body = "", text
    if not body.lstrip().startswith("{"):
        return _content(text), []
    calls, rest = _json_calls(body, ";")
    if not calls:
        return _content(text), []
    return _content(head + rest), calls


def _parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    head, tag, body = text.partition(MISTRAL_CALLS)
    if not tag:
        return _content(text), []
    if body.lstrip().startswith("["):
        calls, rest = _mistral_list(body)
    else:
        calls, rest = _mistral_args_form(body)
    if not calls:
        return _content(text), []
    return _content(head + rest), [replace(call, id=mistral_call_id()) for call in calls]


def _mistral_list(body: str) -> tuple[list[ToolCall], str]:
    """``[{"name", "arguments"}, ...]`` -> (calls, the text after the list); ([], "") if any entry fails."""
    value, end = _decode_at(body, 0)
    if not isinstance(value, list):
        return [], ""
    found = [_call_from_object(entry, "arguments") for entry in value]
    calls = [call for call in found if call is not None]
    if not calls or len(calls) < len(found):
        return [], ""
    return calls, body[end:]


_MISTRAL_NAME_RE = re.compile(r"\s*(?:" + re.escape(MISTRAL_CALLS) + r")?\s*([a-zA-Z0-9_-]{1,64})"
                              + re.escape(MISTRAL_ARGS))


def _mistral_args_form(body: str) -> tuple[list[ToolCall], str]:
    """``name[ARGS]{json}`` repeated (each after a "[TOOL_CALLS]" but the first, whose marker the caller
    took off) -> (calls, the text after them); ([], "") when none or one fails."""
    calls: list[ToolCall] = []
    pos = 0
    while (match := _MISTRAL_NAME_RE.match(body, pos)) is not None:
        arguments, end = _decode_at(body, match.end())
        call = _make_call(match.group(1), arguments)
        if call is None:
            return [], ""
        calls.append(call)
        pos = end
    return calls, body[pos:]


def _json_calls(body: str, separator: str) -> tuple[list[ToolCall], str]:
    """One or more JSON call objects separated by ``separator`` -> (calls, the text after them);
    ([], "") when any object does not parse."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        value, pos = _decode_at(body, pos)
        call = _call_from_object(value, "parameters", "arguments")
        if call is None:
            return [], ""
        calls.append(call)
        after = _skip_space(body, pos)
        if not body.startswith(separator, after):
            return calls, body[pos:]
        pos = after + len(separator)


def _call_from_object(value: Any, *argument_keys: str) -> ToolCall | None:
    """{"name": str, <an argument key>: object or its JSON text} -> a call; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    return _make_call(value["name"], value[key] if key else {})


def _make_call(name: str, arguments: Any) -> ToolCall | None:
    if isinstance(arguments, str):  # some models send the arguments as JSON text, as OpenAI does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


_NOT_DECODED = object()


def _decode_at(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value starting at ``pos`` (after spaces) and where it ends; (_NOT_DECODED, pos) if none."""
    start = _skip_space(text, pos)
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return _NOT_DECODED, pos


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _content(text: str) -> str | None:
    return text.strip() or None


# ---------------------------------------------------------------- streaming


_START_MARKERS = {
    ToolFormat.HERMES: (HERMES_OPEN,),
    ToolFormat.LLAMA3_JSON: (PYTHON_TAG,),
    ToolFormat.MISTRAL: (MISTRAL_CALLS,),
}


def streamable_prefix(text: str, fmt: ToolFormat) -> int:
    """How many leading characters of the answer-so-far may go out as content now: all before the
    first call marker, less an end that may be a marker's beginning. Called by the stream after each
    decoded piece; the characters it holds back are settled by ``parse_tool_calls`` at the end.
    LLAMA3_JSON calls have no marker but "{": an answer that starts with "{" (or is only spaces so far)
    is held entirely."""
    if fmt is ToolFormat.LLAMA3_JSON and text.lstrip()[:1] in ("", "{"):
        return 0
    markers = _START_MARKERS[fmt]
    found = [i for i in (text.find(marker) for marker in markers) if i >= 0]
    if found:
        return min(found)
    return len(text) - max(_partial_marker_len(text, marker) for marker in markers)


def _partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
