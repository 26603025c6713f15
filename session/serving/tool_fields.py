"""The request's ``tools`` and ``tool_choice``, parsed into ``Tool`` and ``ToolChoice``.

Pure functions and frozen dataclasses; a BadRequest names the exact path of the field at fault.
Called by ``chat_request`` while it parses an invocation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from session.errors import BadRequest

MAX_TOOLS = 128
TOOL_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICE_MODES = ("none", "auto", "required")


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
