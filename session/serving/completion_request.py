"""An OpenAI ``/v1/completions`` body parsed into a ``ChatRequest``: one prompt, text or token ids,
rendered by no chat template; stateless.

Pure functions; no I/O. Called by the chat service when the front marks a call as a completions one
(``ENDPOINT_HEADER``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from session.errors import BadRequest
from session.serving.chat_request import ChatRequest, PromptLimits
from session.serving.protocol import (
    ADAPTER_HEADER,
    INFERENCE_COMPONENT_HEADER,
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
