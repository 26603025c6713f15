"""What the chat service hands a front door: ``ApiResponse`` (a status, headers, and a JSON body or
server-sent-event chunks), and ``error_response``, the one place an exception becomes one.

Called by ``ChatService.invoke`` (``api``) for each request that fails, by ``RowStreams.chunks`` for a
row that fails in mid-stream, and by the TorchServe handler for a request it refuses itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from session.errors import ResidentError
from session.types import redact

logger = logging.getLogger(__name__)

JSON = "application/json"
EVENT_STREAM = "text/event-stream"


@dataclass
class ApiResponse:
    status: int
    body: dict | None = None  # a JSON body, or None when ``chunks`` streams the answer
    headers: dict[str, str] = field(default_factory=dict)
    chunks: AsyncGenerator[str, None] | None = None  # server-sent events, for "stream": true
    kind: str = "error"  # first | followup | stateless | close | error: for latency metrics

    @property
    def content_type(self) -> str:
        return EVENT_STREAM if self.chunks is not None else JSON


def error_response(exc: BaseException, request_id: str = "", session_id: str | None = None) -> ApiResponse:
    if isinstance(exc, ResidentError):
        return ApiResponse(status=exc.status, body=exc.to_body(), headers=dict(exc.headers))
    logger.error("request %s (session %s) failed", request_id, redact(session_id), exc_info=exc)
    return ApiResponse(status=500, body={"error": {"type": "internal_error",
                                                   "message": f"internal error; request id {request_id}"}})
