"""The small exception family of the runtime, mapped to HTTP status in one place.

Every error a caller can fix is a ``ResidentError`` with a 4xx status; the
handler turns it into ``{"error": {"type", "message", "code"}}`` (``code`` repeats the type, where
OpenAI's clients read it: ``openai.APIError.code``). Anything else that
escapes is our fault and answers 500.
"""

from __future__ import annotations


class ResidentError(Exception):
    """Base of the errors we answer with a JSON body. ``status`` is the HTTP status."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def to_body(self) -> dict:
        return {"error": {"type": self.type, "message": self.message, "code": self.type}}


class BadRequest(ResidentError):
    status = 400
    type = "invalid_request_error"


class Forbidden(ResidentError):
    """An admin request without the right ``X-Resident-Admin-Token`` (to the front or a backend)."""

    status = 403
    type = "forbidden"


class InvalidSessionId(BadRequest):
    type = "invalid_session_id"


class ContextLengthExceeded(BadRequest):
    type = "context_length_exceeded"


class InvalidImage(BadRequest):
    type = "invalid_image"


class SessionNotFound(ResidentError):
    """Unknown, expired or closed session id."""

    status = 404
    type = "session_not_found"


class SessionExists(ResidentError):
    """An imported session's id is already live here."""

    status = 409
    type = "session_exists"


class PayloadTooLarge(ResidentError):
    status = 413
    type = "payload_too_large"


class RetryLater(ResidentError):
    """An error the caller should retry after a while: carries ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class CapacityExceeded(RetryLater):
    """Overload: the caller should retry later."""

    status = 503
    type = "capacity_exceeded"


class DeviceOutOfMemory(CapacityExceeded):
    """The accelerator ran out of memory for this request alone (its batch was retried smaller first);
    the device is fine and the worker serves on."""


class DeviceFailed(ResidentError):
    """The accelerator failed with a sticky CUDA error (its context is unusable): every request in flight
    fails with this and the worker exits to be restarted. ``__cause__`` is the CUDA error."""

    type = "device_error"


class RequestCancelled(ResidentError):
    """The request was cancelled before it finished (its session was closed, or a cancel named it)."""

    status = 409
    type = "request_cancelled"


class ServiceStopping(ResidentError):
    status = 503
    type = "service_stopping"

    def __init__(self, message: str = "the engine is stopping; retry on another instance"):
        super().__init__(message, headers={"Retry-After": "1"})


# ---------------------------------------------------------------- adapters (session/model/lora.py, lora_weights.py)


class AdapterNotFound(ResidentError):
    status = 404
    type = "adapter_not_found"


class ModelNotFound(ResidentError):
    """A request's "model" names neither the served model nor a registered adapter."""

    status = 404
    type = "model_not_found"


class AdapterInUse(ResidentError):
    """Unregistering an adapter that live sessions or running requests use (or one already registered)."""

    status = 409
    type = "adapter_in_use"


class AdapterMismatch(BadRequest):
    """A follow-up names another adapter than the one its session was opened with."""

    type = "adapter_mismatch"


class InvalidAdapter(BadRequest):
    """A PEFT adapter directory that cannot be read or does not fit the base model."""

    type = "invalid_adapter"


class ConfigError(ValueError):
    """A setting is wrong at start-up; the message says what to set."""


# ---------------------------------------------------------------- the front (session/front/server.py)


class SessionBackendUnavailable(ResidentError):
    """The backend holding this session is down. Its state lived in that backend's memory, so the
    session cannot continue elsewhere: the caller opens a new session (the pin stays until the
    session's expiry, in case the backend comes back with its sessions intact)."""

    status = 410
    type = "session_backend_unavailable"


class BackendUnavailable(CapacityExceeded):
    """No healthy backend can take a new session or a stateless request; retry later (503)."""

    type = "backend_unavailable"


class BackendError(ResidentError):
    """The backend dropped the connection before answering in full."""

    status = 502
    type = "backend_error"


class BackendTimeout(ResidentError):
    """The backend did not answer within the front's timeout (RESIDENT_FRONT_TIMEOUT_S).
    ``may_have_committed`` (in the body too, once the front has asked the backend to cancel): False
    when the backend confirmed it stopped the request and rolled its turn back, so sending it again
    is safe; True when the turn may be part of the session's transcript all the same."""

    status = 504
    type = "backend_timeout"

    def __init__(self, message: str, *, may_have_committed: bool | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, headers=headers)
        self.may_have_committed = may_have_committed

    def to_body(self) -> dict:
        body = super().to_body()
        if self.may_have_committed is not None:
            body["error"]["may_have_committed"] = self.may_have_committed
        return body


class RequestTimeout(ResidentError):
    """The client did not send its request (headers, then body) within the front's deadline."""

    status = 408
    type = "request_timeout"


class TooManyRequests(RetryLater):
    """One client has more requests in flight than the front allows it (RESIDENT_FRONT_MAX_REQUESTS_PER_CLIENT),
    or one tenant holds its share of a worker's sessions (RESIDENT_MAX_SESSIONS_PER_TENANT)."""

    status = 429
    type = "too_many_requests"


class Unauthorized(ResidentError):
    """A request without a valid API key, when the front has a key file (RESIDENT_FRONT_API_KEYS_FILE)."""

    status = 401
    type = "authentication_error"

    def __init__(self, message: str):
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})
