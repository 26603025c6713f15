"""What the front answers with: its headers, the errors' shape on each path, the backends' errors read.

Errors are ``{"error": {"type", "message"}}`` with their status; on the SageMaker ``/endpoints/...``
paths they also carry ``X-Amzn-ErrorType`` and a top-level ``message``, so that botocore's
ClientError shows the type and message.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from session.errors import BackendError
from session.serving.protocol import REQUEST_ID_HEADER

BACKEND_HEADER = "X-Resident-Backend"  # which backend answered: its index in RESIDENT_FRONT_BACKENDS
ERROR_TYPE_HEADER = "X-Amzn-ErrorType"  # botocore reads an error's code from it
PAYLOAD_CONTENT_TYPE_HEADER = "X-Amzn-SageMaker-Content-Type"  # the streamed payload's own type
VARIANT_HEADER = "x-Amzn-Invoked-Production-Variant"
VARIANT = "AllTraffic"  # SageMaker's default production variant name
SSE_CONTENT_TYPE = "text/event-stream"
JSON_CONTENT_TYPE = "application/json"


def is_sagemaker_path(request: web.Request) -> bool:
    return request.path.startswith("/endpoints/")


def error_response(request: web.Request, status: int, body: dict, headers: CIMultiDict) -> web.Response:
    """An error answer in the shape the request's path calls for."""
    if is_sagemaker_path(request):
        headers[ERROR_TYPE_HEADER] = body["error"]["type"]
        body = {**body, "message": body["error"]["message"]}
    headers["Content-Type"] = JSON_CONTENT_TYPE
    return web.Response(status=status, body=json.dumps(body).encode(), headers=headers)


def answer_headers(request: web.Request, upstream: aiohttp.ClientResponse, backend_index: int,
                   request_id: str) -> CIMultiDict:
    """The headers of a backend's answer that the client sees, and ours."""
    headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if passes_back(k))
    headers["Content-Type"] = upstream.headers.get("Content-Type", JSON_CONTENT_TYPE)
    headers[BACKEND_HEADER] = str(backend_index)  # replaces an inner front's, in a front of fronts
    headers[REQUEST_ID_HEADER] = request_id
    if is_sagemaker_path(request):
        headers[VARIANT_HEADER] = VARIANT
    return headers


def passes_back(name: str) -> bool:
    """Backend answer headers the client sees (not TorchServe's own, such as ts_stream_next)."""
    lowered = name.lower()
    return lowered.startswith(("x-amzn-sagemaker-", "x-resident-")) or lowered == "retry-after"


def error_of(payload: bytes) -> dict:
    """An error answer's ``{"type", "message", "code"}`` (``code`` the type, as ``ResidentError`` writes
    it): ours (``{"error": {...}}``), TorchServe's own (``{"code", "type", "message"}``), or, for
    anything else, the text as a ``backend_error``."""
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and isinstance(error.get("type"), str) and isinstance(error.get("message"), str):
            return {"type": error["type"], "message": error["message"], "code": error["type"]}
    return {"type": BackendError.type, "message": payload[:1000].decode("utf-8", "replace"), "code": BackendError.type}
