"""How a model family writes its tool calls (``ToolFormat``), the markers of each format, and what
its chat template does with ``tools``; read once per model from the template.

Pure functions; no I/O. Called by ``ToolSupport.of`` (``tools``) at a model's first tool request; the
markers are shared by the prompt, call parsing and grammar modules.
"""

from __future__ import annotations

import enum
import re

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"

MARKERS = (HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS)


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
