"""A chat-completions (or SageMaker) invocation parsed into a ``ChatRequest``: its session header and
``requestType``, its messages (text, images, tool calls and results), its tools and sampling.

Pure functions and frozen dataclasses; no I/O. ``parse_request`` is called by the chat service for
each invocation, on an executor thread when the body is large; ``ChatRequest`` is also what
``completion_request`` returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from session.errors import BadRequest
from session.serving.protocol import (
    ADAPTER_HEADER,
    CLOSE,
    INFERENCE_COMPONENT_HEADER,
    NEW_SESSION,
    SESSION_HEADER,
    header,
    load_json_object,
)
from session.serving.request_fields import (
    _cache_salt,
    _choices,
    _get,
    _include_usage,
    _known_fields,
    _tenant,
    _text,
    _typed,
)
from session.serving.sampling_fields import _sampling
from session.serving.tool_fields import Tool, ToolChoice, parse_tool_choice, parse_tools
from session.types import ImagePart, Message, SamplingParams, TextPart, validate_session_id


@dataclass(frozen=True)
class ChatRequest:
    """One parsed invocation. ``session_id`` is None for stateless, NEW_SESSION to open."""

    messages: tuple[Message, ...]
    sampling: SamplingParams
    stream: bool = False
    session_id: str | None = None
    request_type: str | None = None  # NEW_SESSION | CLOSE | None
    model: str | None = None
    adapter: str | None = None  # from X-Amzn-SageMaker-Adapter-Identifier / -Inference-Component
    speculative: bool = True  # ours: false turns speculative decoding off for this request
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    n: int = 1  # answers to the one prompt (stateless only)
    # /v1/completions: the prompt as text or token ids (no chat template), and whether to echo it
    prompt: str | tuple[int, ...] | None = None
    echo: bool = False
    cache_salt: str = ""  # vLLM's: only requests with the same salt share cached prompt blocks
    tenant: str | None = None  # TENANT_HEADER, as the front set it

    @property
    def opens_session(self) -> bool:
        return self.session_id == NEW_SESSION or self.request_type == NEW_SESSION

    @property
    def closes_session(self) -> bool:
        return self.request_type == CLOSE


_ALLOWED_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "stream",
                   "seed", "requestType", "model", "n", "stream_options", "user", "speculative",
                   "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                   "response_format", "top_k", "min_tokens", "ignore_eos", "repetition_penalty",
                   "guided_regex", "guided_grammar", "guided_json", "tools", "tool_choice", "parallel_tool_calls",
                   "cache_salt"}
# OpenAI chat-completions fields we do not implement: refused by name, so a client knows what to drop.
_NOT_SUPPORTED = {"functions", "function_call", "audio",
                  "modalities", "prediction", "reasoning_effort", "service_tier", "store", "metadata",
                  "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier"}
_ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": OpenAI's newer name for system


@dataclass(frozen=True)
class PromptLimits:
    """What one request may carry, checked while parsing: before any of it reaches the engine's thread."""

    max_chars: int = 1_000_000  # message text, all messages together (RESIDENT_MAX_PROMPT_CHARS)
    max_messages: int = 1024  # RESIDENT_MAX_MESSAGES
    max_parts: int = 1024  # content parts, all messages together (RESIDENT_MAX_CONTENT_PARTS)


def parse_request(body: bytes | str | Mapping[str, Any] | None, headers: Mapping[str, str], *,
                  default_max_tokens: int, max_new_tokens: int, limits: PromptLimits = PromptLimits(),
                  max_choices: int = 1) -> ChatRequest:
    """Parse and validate an invocation; raises BadRequest with a message that says what to fix."""
    data = _known_fields(load_json_object(body), _ALLOWED_FIELDS, _NOT_SUPPORTED)
    request_type = data.get("requestType")
    if request_type is not None and request_type not in (NEW_SESSION, CLOSE):
        raise BadRequest(f"requestType must be {NEW_SESSION!r} or {CLOSE!r}, got {request_type!r}")
    session_id = header(headers, SESSION_HEADER)
    if session_id is not None:
        session_id = session_id.strip()
        if session_id != NEW_SESSION:
            validate_session_id(session_id)
    if request_type == NEW_SESSION and session_id not in (None, NEW_SESSION):
        raise BadRequest(f"requestType {NEW_SESSION!r} opens a new session, but the {SESSION_HEADER} header names "
                         f"one: send {NEW_SESSION!r} in the header to open, or drop the requestType to continue")
    if request_type == CLOSE:
        if session_id is None or session_id == NEW_SESSION:
            raise BadRequest(f"a CLOSE request needs the session id in the {SESSION_HEADER} header")
        return ChatRequest(messages=(), sampling=SamplingParams(max_tokens=0), session_id=session_id,
                           request_type=CLOSE)
    messages = _parse_messages(data.get("messages"), limits)
    n = _choices(data, max_choices)
    if n > 1 and (session_id is not None or request_type is not None):
        raise BadRequest("n > 1 cannot be used in a session: a session holds one conversation, and n answers "
                         "would be n conversations; send n requests, or open n sessions")
    stream = _typed(_get(data, "stream", False), bool, "stream")
    model = data.get("model")
    if model is not None:
        model = _text(model, "model")
    sampling = _sampling(data, default_max_tokens, max_new_tokens)
    include_usage = _include_usage(data, stream)
    tools = parse_tools(data.get("tools"))
    tool_choice = parse_tool_choice(data.get("tool_choice"), tools)
    parallel = _typed(_get(data, "parallel_tool_calls", True), bool, "parallel_tool_calls")
    if tool_choice.mode in ("required", "function") and sampling.constraint is not None:
        raise BadRequest(f"tool_choice {tool_choice.name or tool_choice.mode!r} and "
                         f"{sampling.constraint.what} both constrain the answer; give one")
    adapter = header(headers, ADAPTER_HEADER) or header(headers, INFERENCE_COMPONENT_HEADER)
    speculative = _typed(_get(data, "speculative", True), bool, "speculative")
    return ChatRequest(messages=messages, sampling=sampling, stream=stream, session_id=session_id,
                       request_type=request_type, model=model, adapter=adapter.strip() if adapter else None,
                       speculative=speculative, include_usage=include_usage, tools=tools, tool_choice=tool_choice,
                       parallel_tool_calls=parallel, n=n, cache_salt=_cache_salt(data),
                       tenant=_tenant(headers))


def _parse_messages(raw: Any, limits: PromptLimits) -> tuple[Message, ...]:
    if raw is None:
        raise BadRequest("missing 'messages': a list of {role, content}")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list")
    if len(raw) > limits.max_messages:
        raise BadRequest(f"{len(raw)} messages; at most {limits.max_messages} per request (RESIDENT_MAX_MESSAGES)")
    num_parts = sum(len(m["content"]) for m in raw if isinstance(m, dict) and isinstance(m.get("content"), list))
    if num_parts > limits.max_parts:
        raise BadRequest(f"the messages have {num_parts} content parts; at most {limits.max_parts} per request "
                         "(RESIDENT_MAX_CONTENT_PARTS)")
    messages = tuple(_parse_message(m, i) for i, m in enumerate(raw))
    num_chars = sum(len(p.text) for m in messages for p in m.parts if isinstance(p, TextPart))
    num_chars += sum(len(json.dumps(call)) for m in messages for call in m.tool_calls)
    if num_chars > limits.max_chars:
        raise BadRequest(f"the messages' text is {num_chars} characters; at most {limits.max_chars} per request "
                         "(RESIDENT_MAX_PROMPT_CHARS)")
    return messages


def _parse_message(m: Any, i: int) -> Message:
    """One message: system / developer (a system message), user, assistant (its ``tool_calls``, content
    then optional) or tool (its ``tool_call_id``)."""
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in _ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}")
    if role == "developer":
        role = "system"
    if role == "assistant" and m.get("tool_calls"):
        calls = _parse_tool_calls(m["tool_calls"], i)
        parts = () if m.get("content") in (None, "") else _parse_content(m["content"], i)
        return Message(role=role, parts=parts, tool_calls=calls)
    parts = _parse_content(m.get("content"), i)
    if role != "tool":
        return Message(role=role, parts=parts)
    if any(not isinstance(p, TextPart) for p in parts):
        raise BadRequest(f"messages[{i}] is a tool result: its content must be text")
    call_id = _text(m.get("tool_call_id"), f"messages[{i}].tool_call_id")
    name = None if m.get("name") is None else _text(m["name"], f"messages[{i}].name")
    return Message(role=role, parts=parts, tool_call_id=call_id, name=name)


def _parse_tool_calls(raw: Any, i: int) -> tuple[dict, ...]:
    """An assistant message's ``tool_calls`` in the form chat templates take: arguments as an object
    (OpenAI sends them as JSON text)."""
    if not isinstance(raw, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list")
    calls = []
    for j, call in enumerate(raw):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise BadRequest(f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}")
        name = _text(function.get("name"), f"{where}.function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise BadRequest(f"{where}.function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise BadRequest(f"{where}.function.arguments must be a JSON object")
        call_id = _text(call.get("id", f"call_{i}_{j}"), f"{where}.id")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return tuple(calls)


def _parse_content(content: Any, i: int) -> tuple[TextPart | ImagePart, ...]:
    if isinstance(content, str):
        return (TextPart(_text(content, f"messages[{i}].content")),)
    if not isinstance(content, list) or not content:
        raise BadRequest(f"messages[{i}].content must be a string or a non-empty list of parts")
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise BadRequest(f"{where} must be an object")
        kind = part.get("type")
        if kind == "text":
            parts.append(TextPart(_text(part.get("text"), f"{where}.text")))
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            parts.append(ImagePart(_typed(url, str, f"{where}.image_url.url")))
        else:
            raise BadRequest(f"{where}.type must be 'text' or 'image_url', got {kind!r}")
    return tuple(parts)
