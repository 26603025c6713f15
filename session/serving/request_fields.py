"""Typed reads of a request body's JSON fields, and the fields every endpoint shares (``n``,
``stream_options``, ``cache_salt``, the tenant header).

Pure functions; each raises BadRequest with a message that names the field and says what to fix.
Called by the request parsers: ``chat_request``, ``completion_request`` and ``sampling_fields``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from session.errors import BadRequest
from session.serving.protocol import TENANT_HEADER, header
from session.types import MAX_TENANT_LEN

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


def _include_usage(data: dict, stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options must be an object with include_usage (a boolean)")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream: true")
    return _typed(_get(options, "include_usage", False), bool, "stream_options.include_usage")


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
