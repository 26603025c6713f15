"""The Lark grammar (llguidance dialect) that forces an answer to be tool calls, for ``tool_choice``
"required" or a named function.

Pure functions; no I/O. Called by ``ToolSupport.grammar`` (``tools``) when the chat service renders a
request; the engine's grammar compiler compiles the text.
"""

from __future__ import annotations

import json

from session.serving.tool_fields import Tool, ToolChoice
from session.serving.tool_format import HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, ToolFormat

# The JSON inside a call, as the models were trained to write it (Python's json.dumps: ", " and ": ",
# or compact): no newlines or runs of spaces, so a constrained answer cannot spin on whitespace.
# "lenient": a keyword or string format llguidance does not implement is ignored, not an error.
ARGUMENTS_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?",
                        "lenient": True}


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
