"""The sampling fields both endpoints share, parsed into ``SamplingParams``: length, temperature,
top_p, stop, seed, log-probabilities, penalties, logit bias, the benchmark clients' extensions, and
the answer's constraint (``response_format``, vLLM's ``guided_*``; docs/STRUCTURED_OUTPUT.md).

Pure functions; BadRequest names the field. Called by ``chat_request`` and ``completion_request``.
"""

from __future__ import annotations

import json
from typing import Any

from session.errors import BadRequest
from session.serving.request_fields import _get, _number, _text, _typed
from session.types import SEED_RANGE, Constraint, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300


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
    processing = _processing(data, legacy_logprobs)
    if processing["min_tokens"] > max_tokens:  # the answer could not be that long
        raise BadRequest(f"min_tokens must not exceed max_tokens ({max_tokens}), got {processing['min_tokens']}")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                          **processing)


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
