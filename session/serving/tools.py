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
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace
from typing import Any

from session.errors import BadRequest
from session.types import Constraint, Message, TextPart

MAX_TOOLS = 128
TOOL_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICE_MODES = ("none", "auto", "required")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"

# The JSON inside a call, as the models were trained to write it (Python's json.dumps: ", " and ": ",
# or compact): no newlines or runs of spaces, so a constrained answer cannot spin on whitespace.
# "lenient": a keyword or string format llguidance does not implement is ignored, not an error.
ARGUMENTS_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?",
                        "lenient": True}


# ---------------------------------------------------------------- request fields


@dataclass(frozen=True)
class Tool:
    """One entry of the request's ``tools`` (OpenAI has only type "function")."""

    name: str
    description: str | None
    parameters: dict = field(hash=False)  # JSON schema of the arguments object
    strict: bool = False

    def to_template(self) -> dict:
        """The shape HF chat templates take in ``tools=[...]`` (description left out when absent:
        some templates print a None as "None")."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the forced function, for mode "function"


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


def parse_tools(raw: Any) -> tuple[Tool, ...]:
    """The request's ``tools`` (None or [] -> no tools). BadRequest naming the exact path otherwise."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequest(f"tools must be a list of {{type, function}} objects, got {type(raw).__name__}")
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"tools has {len(raw)} entries; at most {MAX_TOOLS}")
    tools = tuple(_parse_tool(entry, f"tools[{i}]") for i, entry in enumerate(raw))
    _check_unique_names(tools)
    return tools


def _parse_tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise BadRequest(f"{where} must be an object")
    if entry.get("type") != "function":
        raise BadRequest(f"{where}.type must be 'function', got {entry.get('type')!r}")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{where}.function must be an object with a name")
    where = f"{where}.function"
    return Tool(name=_tool_name(function.get("name"), where), description=_description(function, where),
                parameters=_parameters(function, where), strict=_strict(function, where))


def _tool_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or TOOL_NAME_RE.fullmatch(name) is None:
        raise BadRequest(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    return name


def _description(function: dict, where: str) -> str | None:
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}.description must be a string")
    return description


def _parameters(function: dict, where: str) -> dict:
    parameters = function.get("parameters")
    if parameters is None:
        return {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise BadRequest(f"{where}.parameters must be an object (a JSON schema)")
    return parameters


def _strict(function: dict, where: str) -> bool:
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{where}.strict must be a boolean")
    return bool(strict)


def _check_unique_names(tools: tuple[Tool, ...]) -> None:
    first: dict[str, int] = {}  # name -> index of the tool that has it
    for i, tool in enumerate(tools):
        if tool.name in first:
            raise BadRequest(f"tools[{i}].function.name {tool.name!r} is already the name of tools[{first[tool.name]}]")
        first[tool.name] = i


def parse_tool_choice(raw: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    """The request's ``tool_choice``: absent -> "auto" with tools, else "none" ("auto" without tools is
    "none" too). "required" or a named function without tools, or an unknown name: BadRequest."""
    if raw is None or raw == "auto":
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in CHOICE_MODES:
            raise BadRequest(f"tool_choice must be one of {list(CHOICE_MODES)} or a function, got {raw!r}")
        if raw == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs a non-empty tools list")
        return ToolChoice(raw)
    return ToolChoice("function", _forced_name(raw, tools))


def _forced_name(raw: Any, tools: tuple[Tool, ...]) -> str:
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise BadRequest("tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}")
    function = raw.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise BadRequest("tool_choice.function.name must be a string")
    if name not in {tool.name for tool in tools}:
        raise BadRequest(f"tool_choice.function.name {name!r} is not among tools")
    return name


# ---------------------------------------------------------------- the model's format


class ToolFormat(enum.Enum):
    """How a model family writes its calls (the template shows it how)."""

    HERMES = "hermes"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (Qwen2/2.5, Hermes)
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}} as the whole answer (Llama 3.1/3.2)
    MISTRAL = "mistral"  # [TOOL_CALLS] [{"name": ..., "arguments": {...}}] (or [TOOL_CALLS]name[ARGS]{...})


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches. Called once per model at start-up. A template that knows
    no tools gets HERMES: ``tools_system_prompt`` then teaches it in the system message."""
    text = chat_template or ""
    if MISTRAL_CALLS in text:
        return ToolFormat.MISTRAL
    if HERMES_OPEN in text:
        return ToolFormat.HERMES
    if PYTHON_TAG in text or ('"parameters": ' in text and "ipython" in text):
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


_JINJA_BLOCK_RE = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_JINJA_STRING_RE = re.compile(r"\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", re.DOTALL)
_TOOLS_VARIABLE_RE = re.compile(r"\btools\b")


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template reads the ``tools`` variable in its code (string literals such as
    "<tools>" and the text outside {{ }} / {% %} do not count). Called once per model."""
    for block in _JINJA_BLOCK_RE.findall(chat_template or ""):
        if _TOOLS_VARIABLE_RE.search(_JINJA_STRING_RE.sub('""', block)):
            return True
    return False


def tools_system_prompt(tools: tuple[Tool, ...], fmt: ToolFormat) -> str:
    """For a template that ignores ``tools``: system-prompt text listing the tools' schemas and the
    exact way to call them in ``fmt``. The chat service appends it to (or makes it) the system message."""
    schemas = [tool.to_template() for tool in tools]
    if fmt is ToolFormat.LLAMA3_JSON:
        return _llama3_prompt(schemas)
    if fmt is ToolFormat.MISTRAL:
        return _mistral_prompt(schemas)
    return _hermes_prompt(schemas)


def _hermes_prompt(schemas: list[dict]) -> str:
    listing = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _llama3_prompt(schemas: list[dict]) -> str:
    listing = "\n\n".join(json.dumps(schema, indent=4, ensure_ascii=False) for schema in schemas)
    return ("You have access to the following functions. To call a function, please respond with JSON for a "
            'function call. Respond in the format {"name": function name, "parameters": dictionary of argument '
            f"name and its value}}. Do not use variables.\n\n{listing}")


def _mistral_prompt(schemas: list[dict]) -> str:
    listing = json.dumps(schemas, ensure_ascii=False)
    return (f"You have access to the following functions:\n{listing}\n\n"
            "To call functions, respond with [TOOL_CALLS] followed by a JSON list of the calls: "
            '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]')


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
    calls = [_call_from_object(entry, "arguments") for entry in value]
    if not calls or None in calls:
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


# ---------------------------------------------------------------- grammar


def tool_call_grammar(tools: tuple[Tool, ...], choice: ToolChoice, fmt: ToolFormat, parallel: bool,
                      special_token_ids: dict[str, int]) -> str | None:
    """The Lark grammar (llguidance dialect) forcing the answer to be tool calls in ``fmt``: any of
    ``tools`` for "required", the named one for "function"; one call, or one or more when ``parallel``.
    Each call's arguments are held to the tool's ``parameters`` by an inline ``%json``. A marker that
    the tokenizer holds as one special token (``special_token_ids``: marker text -> id) is written
    ``<[id]>``: llguidance never lets a literal string match a special token. For MISTRAL, an "[ARGS]"
    special token selects the newer ``[TOOL_CALLS]name[ARGS]{...}`` form. None for "none"/"auto".
    Called by the chat service when it parses the request; the grammar compiler compiles it."""
    chosen = _chosen_tools(tools, choice)
    if not chosen:
        return None
    marker = _MarkerWriter(special_token_ids)
    if fmt is ToolFormat.MISTRAL and MISTRAL_ARGS in special_token_ids:
        return _grammar(_mistral_args_start(parallel, marker), _mistral_args_functions(chosen, marker))
    return _grammar(_start(fmt, parallel, marker), _json_functions(chosen, _arguments_key(fmt)))


def _chosen_tools(tools: tuple[Tool, ...], choice: ToolChoice) -> tuple[Tool, ...]:
    if choice.mode == "required":
        return tools
    if choice.mode == "function":
        return tuple(tool for tool in tools if tool.name == choice.name)
    return ()


class _MarkerWriter:
    """A marker as a Lark atom: its special token ``<[id]>`` when it is one, else its literal text."""

    def __init__(self, special_token_ids: dict[str, int]):
        self.special_token_ids = special_token_ids

    def __call__(self, text: str) -> str:
        token_id = self.special_token_ids.get(text)
        return _literal(text) if token_id is None else f"<[{token_id}]>"


def _start(fmt: ToolFormat, parallel: bool, marker: _MarkerWriter) -> list[str]:
    """The rules above ``function`` (one call's JSON): the markers and how calls repeat."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return [_repeat("function", '"; "', parallel)]
    if fmt is ToolFormat.MISTRAL:
        return _mistral_start(parallel, marker)
    return _hermes_start(parallel, marker)


def _hermes_start(parallel: bool, marker: _MarkerWriter) -> list[str]:
    return [_repeat("call", '"\\n"', parallel),
            f'call: {marker(HERMES_OPEN)} "\\n" function "\\n" {marker(HERMES_CLOSE)}']


def _mistral_start(parallel: bool, marker: _MarkerWriter) -> list[str]:
    # v0.3's template writes "[TOOL_CALLS] [", later ones "[TOOL_CALLS][": the space is optional
    return [f'start: {marker(MISTRAL_CALLS)} " "? "[" calls "]"', _repeat("function", '", "', parallel, "calls")]


def _mistral_args_start(parallel: bool, marker: _MarkerWriter) -> list[str]:
    return ["start: call+" if parallel else "start: call", f"call: {marker(MISTRAL_CALLS)} function"]


def _repeat(item: str, separator: str, parallel: bool, rule: str = "start") -> str:
    return f"{rule}: {item} ({separator} {item})*" if parallel else f"{rule}: {item}"


def _arguments_key(fmt: ToolFormat) -> str:
    return "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"


def _json_functions(tools: tuple[Tool, ...], arguments_key: str) -> list[str]:
    """``{"name": "<name>", "<key>": <arguments>}`` per tool; the name and keys are literals, so each
    tool's schema stays the root of its own %json (its "$ref"s resolve as written)."""
    lines = ["function: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = _literal(f'{{"name": "{tool.name}", "{arguments_key}": ')
        lines += [f'function_{i}: {head} arguments_{i} "}}"', _arguments_rule(i, tool)]
    return lines


def _mistral_args_functions(tools: tuple[Tool, ...], marker: _MarkerWriter) -> list[str]:
    lines = ["function: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        lines += [f"function_{i}: {_literal(tool.name)} {marker(MISTRAL_ARGS)} arguments_{i}", _arguments_rule(i, tool)]
    return lines


def _arguments_rule(i: int, tool: Tool) -> str:
    schema = {**tool.parameters, "x-guidance": ARGUMENTS_JSON_STYLE}
    return f"arguments_{i}: %json {json.dumps(schema, ensure_ascii=False)}"


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _grammar(top: list[str], functions: list[str]) -> str:
    # "%llguidance {}" marks the text as Lark for llguidance.grammar_from("grammar", ...), which would
    # otherwise try to read it as GBNF.
    return "\n".join(["%llguidance {}", *top, *functions]) + "\n"


# ---------------------------------------------------------------- one served model


MARKERS = (HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS)
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


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


def call_text(calls: tuple[dict, ...], fmt: ToolFormat) -> str:
    """An assistant message's ``tool_calls`` (template form: arguments an object) as the model writes them."""
    pairs = [(call["function"]["name"], call["function"]["arguments"]) for call in calls]
    if fmt is ToolFormat.LLAMA3_JSON:
        return "; ".join(json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in pairs)
    if fmt is ToolFormat.MISTRAL:
        return MISTRAL_CALLS + " " + json.dumps([{"name": name, "arguments": args} for name, args in pairs],
                                                ensure_ascii=False)
    return "\n".join(f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n"
                     f"{HERMES_CLOSE}" for name, args in pairs)


def _untooled(message: Message, fmt: ToolFormat) -> Message:
    """A message with tool fields as plain text, for a template that knows no tools."""
    if message.role == "tool":
        text = "".join(p.text for p in message.parts if isinstance(p, TextPart))
        return Message(role="user", parts=(TextPart(f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"),))
    if message.tool_calls:
        text = "".join(p.text for p in message.parts if isinstance(p, TextPart))
        calls = call_text(message.tool_calls, fmt)
        return Message(role=message.role, parts=(TextPart(f"{text}\n{calls}" if text else calls),))
    return message


def _with_system_text(messages: tuple[Message, ...], text: str) -> tuple[Message, ...]:
    if messages and messages[0].role == "system":
        first = messages[0]
        return (Message(role="system", parts=(*first.parts, TextPart("\n\n" + text))), *messages[1:])
    return (Message(role="system", parts=(TextPart(text),)), *messages)
