"""Tools in the prompt of a model whose chat template ignores them: the tools described in the system
message, an assistant's calls written as text in the model's format, a tool's result as a user turn.

Pure functions; no I/O. Called by ``ToolSupport.prompt`` (``tools``) while the chat service renders a
turn.
"""

from __future__ import annotations

import json

from session.serving.tool_fields import Tool
from session.serving.tool_format import HERMES_CLOSE, HERMES_OPEN, MISTRAL_CALLS, ToolFormat
from session.types import Message, TextPart

TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


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
