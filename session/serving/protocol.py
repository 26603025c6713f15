"""The wire: SageMaker stateful-session headers and ours, their values, the request body as JSON,
and server-sent-event framing.

Pure functions and constants; no I/O. Used by the request parsers (``chat_request``,
``completion_request``), the chat service (``api``), the TorchServe handler and the front.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from session.errors import BadRequest

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


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
