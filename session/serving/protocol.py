"""The wire protocol: SageMaker stateful-session headers and OpenAI chat shapes.

Pure functions and dataclasses; no I/O. Used by the TorchServe handler and the front.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from session.errors import BadRequest
from session.serving.tools import Tool, ToolChoice, parse_tool_choice, parse_tools
from session.types import (
    MAX_TENANT_LEN,
    SEED_RANGE,
    Constraint,
    ImagePart,
    Message,
    SamplingParams,
    TextPart,
    Usage,
    validate_session_id,
)

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
INFERENCE_COMPONENT_HEADER = "X-Amzn-SageMaker-Inference-Component"
# Ours: adapter administration from the front (register/unregister/list); a shared secret.
ADMIN_TOKEN_HEADER = "X-Resident-Admin-Token"
# Ours: which worker process answered ("<hostname>:<pid>"); lets clients and tests see stickiness.
WORKER_HEADER = "X-Resident-Worker"
REQUEST_ID_HEADER = "X-Resident-Request-Id"  # names a request, so that a cancel can name it too
CANCEL_HEADER = "X-Resident-Cancel"  # a request carrying it cancels the request with that id
# Ours: set by the front on every forwarded call, the tenant it identified (docs/DEPLOY.md); a client's own
# is dropped. The backend salts the prefix cache with it, so tenants never share cached prompts.
TENANT_HEADER = "X-Resident-Tenant"
# Ours: set by the front on a forwarded OpenAI ``/v1/completions`` call ("completions"); a body without
# it is a chat-completions or SageMaker invocation.
ENDPOINT_HEADER = "X-Resident-Endpoint"
COMPLETIONS_ENDPOINT = "completions"
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
NEW_SESSION = "NEW_SESSION"
CLOSE = "CLOSE"

def format_expiry(epoch_s: float) -> str:
    """UTC, whole seconds, trailing Z: 2026-11-30T09:19:49Z."""
    return datetime.fromtimestamp(int(epoch_s), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_session_header_value(session_id: str, expires_at: float) -> str:
    return f"{session_id}; Expires={format_expiry(expires_at)}"


def tokens_match(given: str | None, expected: str) -> bool:
    """Whether a header's token equals the configured secret, in constant time; never for an unset
    secret. Any text compares (a non-ASCII header is a mismatch, not an error)."""
    if not expected or given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive header lookup (TorchServe matches names case-sensitively; we do not)."""
    lowered = name.lower()
    for key, value in headers.items():
        if key.lower() == lowered:
            return value
    return None


# ---------------------------------------------------------------- requests


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
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
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


_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                      "logprobs", "echo", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                      "user", "best_of", "top_k", "min_tokens", "ignore_eos", "repetition_penalty",
                      "response_format", "guided_json", "guided_regex", "guided_grammar", "speculative", "cache_salt"}
_COMPLETION_NOT_SUPPORTED = {"suffix"}


def parse_completion_request(body: bytes | str | Mapping[str, Any] | None, headers: Mapping[str, str], *,
                             default_max_tokens: int, max_new_tokens: int, limits: PromptLimits = PromptLimits(),
                             max_choices: int = 1) -> ChatRequest:
    """An OpenAI ``/v1/completions`` body: one prompt, text or token ids, rendered by no template;
    stateless (a session holds a chat). BadRequest saying what to fix."""
    data = _known_fields(load_json_object(body), _COMPLETION_FIELDS, _COMPLETION_NOT_SUPPORTED)
    if header(headers, SESSION_HEADER) is not None:
        raise BadRequest(f"/v1/completions is stateless; sessions ({SESSION_HEADER}) are for chat completions")
    n = _choices(data, max_choices)
    if _get(data, "best_of", n) != n:
        raise BadRequest("best_of other than n is not supported by this server")
    stream = _typed(_get(data, "stream", False), bool, "stream")
    model = None if data.get("model") is None else _text(data["model"], "model")
    echo = _typed(_get(data, "echo", False), bool, "echo")
    sampling = _sampling(data, default_max_tokens, max_new_tokens, legacy_logprobs=True)
    if echo and sampling.logprobs is not None:
        raise BadRequest("echo with logprobs (the prompt's log-probabilities) is not supported by this server")
    adapter = header(headers, ADAPTER_HEADER) or header(headers, INFERENCE_COMPONENT_HEADER)
    return ChatRequest(messages=(), sampling=sampling, stream=stream, model=model, n=n,
                       adapter=adapter.strip() if adapter else None, include_usage=_include_usage(data, stream),
                       speculative=_typed(_get(data, "speculative", True), bool, "speculative"),
                       prompt=_prompt(data.get("prompt"), limits), echo=echo, cache_salt=_cache_salt(data),
                       tenant=_tenant(headers))


MAX_CACHE_SALT_CHARS = 256


def _known_fields(data: dict, allowed: set[str], not_supported: set[str]) -> dict:
    """``data``, once every field is one the endpoint takes: a field of OpenAI's we do not implement is
    named as not supported (a client knows what to drop), any other as unknown."""
    refused = sorted(k for k in set(data) & not_supported if data[k] is not None)
    if refused:
        raise BadRequest(f"field(s) {refused} are not supported by this server")
    unknown = sorted(set(data) - allowed - not_supported)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    return data


def _choices(data: dict, max_choices: int) -> int:
    n = _typed(_get(data, "n", 1), int, "n")
    if not 1 <= n <= max_choices:
        raise BadRequest(f"n must be between 1 and {max_choices} (RESIDENT_MAX_CHOICES), got {n}")
    return n


def _tenant(headers: Mapping[str, str]) -> str | None:
    tenant = header(headers, TENANT_HEADER)
    if tenant is not None and not 0 < len(tenant) <= MAX_TENANT_LEN:
        raise BadRequest(f"{TENANT_HEADER} must be 1 to {MAX_TENANT_LEN} characters")
    return tenant


def _cache_salt(data: dict) -> str:
    salt = data.get("cache_salt")
    if salt is None:
        return ""
    salt = _text(salt, "cache_salt")
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters")
    return salt


def _prompt(raw: Any, limits: PromptLimits) -> str | tuple[int, ...]:
    """One prompt: a string, a list of token ids, or a one-element list of either (the SDK's forms)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        if not raw:
            raise BadRequest("prompt must not be empty")
        if len(raw) > limits.max_chars:
            raise BadRequest(f"the prompt is {len(raw)} characters; at most {limits.max_chars} (RESIDENT_MAX_PROMPT_CHARS)")
        return _text(raw, "prompt")
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        if len(raw) > limits.max_chars:
            raise BadRequest(f"the prompt is {len(raw)} tokens; at most {limits.max_chars}")
        if min(raw) < 0:
            raise BadRequest("prompt token ids must be >= 0")
        return tuple(raw)
    if isinstance(raw, list) and len(raw) > 1:
        raise BadRequest("one prompt per request: send a string or a list of token ids (use n for several answers)")
    raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids")


def _sampling(data: dict, default_max_tokens: int, max_new_tokens: int, legacy_logprobs: bool = False) -> SamplingParams:
    """The sampling fields both endpoints share. ``legacy_logprobs``: /v1/completions' ``logprobs`` (an
    int, the top-k) instead of chat's ``logprobs`` + ``top_logprobs``."""
    max_tokens = _get(data, "max_completion_tokens", _get(data, "max_tokens", default_max_tokens))
    max_tokens = _typed(max_tokens, int, "max_tokens")
    if not 1 <= max_tokens <= max_new_tokens:
        raise BadRequest(f"max_tokens must be between 1 and {max_new_tokens}, got {max_tokens}")
    temperature = _number(_get(data, "temperature", 0.0), "temperature")
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}")
    top_p = _number(_get(data, "top_p", 1.0), "top_p")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    stop = data.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise BadRequest("stop must be a string or a list of at most 4 strings")
    if any(s == "" for s in stop):
        raise BadRequest("stop strings must not be empty")
    stop = tuple(_text(s, "stop") for s in stop)
    seed = data.get("seed")
    if seed is not None:
        seed = _typed(seed, int, "seed")
        if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise BadRequest(f"seed must be in [-2**63, 2**64), got {seed}")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                          **_processing(data, legacy_logprobs))


def _include_usage(data: dict, stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options must be an object with include_usage (a boolean)")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream: true")
    return _typed(_get(options, "include_usage", False), bool, "stream_options.include_usage")


def _processing(data: dict, legacy_logprobs: bool) -> dict:
    """The SamplingParams fields beyond temperature / top_p: log-probabilities, penalties, bias, the
    benchmark clients' extensions and the answer's constraint."""
    out: dict[str, Any] = {}
    if legacy_logprobs:
        top = data.get("logprobs")
        if top is not None:
            top = _typed(top, int, "logprobs")
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise BadRequest(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
            out["logprobs"] = top
    else:
        out.update(_chat_logprobs(data))
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(_get(data, name, 0.0), name)
        if not -2.0 <= value <= 2.0:
            raise BadRequest(f"{name} must be between -2 and 2, got {value}")
        out[name] = value
    repetition = _number(_get(data, "repetition_penalty", 1.0), "repetition_penalty")
    if not 0.0 < repetition <= 10.0:
        raise BadRequest(f"repetition_penalty must be in (0, 10], got {repetition}")
    out["repetition_penalty"] = repetition
    top_k = _typed(_get(data, "top_k", 0), int, "top_k")
    if top_k < -1:
        raise BadRequest(f"top_k must be -1 or 0 (all tokens) or positive, got {top_k}")
    out["top_k"] = max(top_k, 0)
    out["min_tokens"] = _typed(_get(data, "min_tokens", 0), int, "min_tokens")
    if out["min_tokens"] < 0:
        raise BadRequest(f"min_tokens must be >= 0, got {out['min_tokens']}")
    out["ignore_eos"] = _typed(_get(data, "ignore_eos", False), bool, "ignore_eos")
    out["logit_bias"] = _logit_bias(data.get("logit_bias"))
    out["constraint"] = _constraint(data)
    if out["constraint"] is not None and (out["ignore_eos"] or out["min_tokens"]):
        raise BadRequest("ignore_eos and min_tokens cannot be combined with a constrained answer "
                         "(response_format / guided_*): the grammar decides where the answer ends")
    return out


def _chat_logprobs(data: dict) -> dict:
    logprobs = _typed(_get(data, "logprobs", False), bool, "logprobs")
    top = _get(data, "top_logprobs", None)
    if top is not None:
        top = _typed(top, int, "top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
        if not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true")
    return {"logprobs": top or 0} if logprobs else {}


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to a bias in [-100, 100]")
    if len(raw) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
    out = []
    for key, bias in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if token_id < 0:
            raise BadRequest(f"logit_bias key {key!r} is not a token id")
        bias = _number(bias, f"logit_bias[{key!r}]")
        if not -100.0 <= bias <= 100.0:
            raise BadRequest(f"logit_bias[{key!r}] must be between -100 and 100, got {bias}")
        out.append((token_id, bias))
    return tuple(sorted(out))


def _constraint(data: dict) -> Constraint | None:
    """response_format (OpenAI), or vLLM's guided_json / guided_regex / guided_grammar extensions; at most one."""
    given = [k for k in ("response_format", "guided_json", "guided_regex", "guided_grammar") if data.get(k) is not None]
    if len(given) > 1:
        raise BadRequest(f"at most one of {given} may be given")
    if not given:
        return None
    field_name, raw = given[0], data[given[0]]
    if field_name == "guided_json":
        try:
            schema = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise BadRequest("guided_json is not valid JSON") from None
        if not isinstance(schema, dict):
            raise BadRequest("guided_json must be a JSON schema object")
        return Constraint.json_schema(schema, "guided_json")
    if field_name in ("guided_regex", "guided_grammar"):
        kind = "regex" if field_name == "guided_regex" else "lark"
        return Constraint(kind, _text(raw, field_name), field_name)
    return _response_format(raw)


def _response_format(raw: Any) -> Constraint | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise BadRequest("response_format must be an object with a type: text, json_object, json_schema, "
                         "regex or grammar")
    kind = raw["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest("response_format.json_schema must be an object with name and schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON schema object")
        strict = _typed(_get(spec, "strict", False), bool, "response_format.json_schema.strict")
        return Constraint.json_schema(schema, "response_format.json_schema", strict)
    if kind in ("regex", "grammar"):  # ours, documented in docs/STRUCTURED_OUTPUT.md
        source = raw.get(kind)
        return Constraint("regex" if kind == "regex" else "lark", _text(source, f"response_format.{kind}"),
                          f"response_format.{kind}")
    raise BadRequest(f"response_format.type {kind!r} is not supported; use text, json_object, json_schema, "
                     "regex or grammar")


FORM_CONTENT_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def form_body_error(content_type: str | None) -> BadRequest | None:
    """The error for a body TorchServe decoded as an HTML form before we could read it (None if not one).

    curl's ``-d`` labels a body application/x-www-form-urlencoded; TorchServe 0.12 then splits it into
    form fields and drops a field without ``=``, so a JSON body arrives empty or cut. The front (make
    cluster, the container) forwards every body as JSON, so this only happens talking to TorchServe
    directly.
    """
    if not content_type or content_type.split(";")[0].strip().lower() not in FORM_CONTENT_TYPES:
        return None
    return BadRequest(f"the body was sent as a form (Content-Type: {content_type.split(';')[0].strip()}; curl -d "
                      "does that), which TorchServe decodes into form fields, losing the JSON; send it with "
                      "Content-Type: application/json (curl -H 'Content-Type: application/json' --data-binary ...)")


def load_json_object(body: bytes | str | Mapping[str, Any] | None) -> dict:
    """A request body as a JSON object, else BadRequest. Used by parse_request and the front."""
    if isinstance(body, Mapping):  # TorchServe already decoded an application/json body
        return dict(body)
    if body is None or len(body) == 0:
        raise BadRequest("empty request body; send a JSON object with 'messages'")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise BadRequest(f"request body has a value out of range: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def _get(data: dict, key: str, default: Any) -> Any:
    """A field's value; an explicit null means the default, as in the OpenAI API."""
    value = data.get(key)
    return default if value is None else value


def _typed(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    # bool is an int in Python; refuse it where a number is wanted.
    if isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"{name} must be {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise BadRequest(f"{name} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _number(value: Any, name: str) -> float:
    try:
        return float(_typed(value, (int, float), name))
    except OverflowError:
        raise BadRequest(f"{name} is out of range") from None


def _text(value: Any, name: str) -> str:
    """A string that is valid Unicode text: JSON's \\ud800 escapes can make a lone surrogate, which no
    tokenizer can encode."""
    _typed(value, str, name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{name} is not valid Unicode text: {exc.reason} at character {exc.start}") from None
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


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


# ---------------------------------------------------------------- responses


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


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
