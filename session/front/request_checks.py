"""What the front checks in a request before anything of it reaches a backend.

- ``/predictions/{model}``: the backend resolves what the front forwards, so a path that only looks
  like a model name to the front could be another of the backend's routes to TorchServe
  (``/predictions/..%2Fping`` is ``/ping`` once decoded and resolved; ``/wfpredict`` likewise). So
  the front forwards only a raw path (before percent-decoding) that is exactly
  ``/predictions/<name>``, the name being the served model's or letters, digits and ``_-`` with
  single dots between them (no ``..``, no leading or trailing dot); anything else is 404. The
  generated nginx allows the same paths (``launch/nginx.py``).
- Headers that route, name or authorise a request (``Authorization`` and every
  ``X-Amzn-SageMaker-*``, which the front forwards) must come at most once, in any case: with two,
  the front would route by one copy and a backend act on another (a session opened on a path
  that must never open one). Sent twice: 400, naming the header.

Who calls this: the front's middleware (headers) and its ``/predictions/{model}`` handler, on the event loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from aiohttp import web

from session.errors import BadRequest

PREDICTIONS_PREFIX = "/predictions/"
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")  # dots only between: no "..", none leading
FORWARDED_PREFIX = "x-amzn-sagemaker-"  # the client headers the front forwards (forwarding.Call)


def predictions_path(raw_path: str, model_name: str) -> str:
    """The backend path for a ``/predictions/{model}`` request's raw path (its query dropped): itself
    when it names a model plainly; else HTTPNotFound."""
    path = raw_path.partition("?")[0]
    name = path[len(PREDICTIONS_PREFIX):] if path.startswith(PREDICTIONS_PREFIX) else ""
    if name == model_name or MODEL_NAME_RE.fullmatch(name):
        return PREDICTIONS_PREFIX + name
    raise web.HTTPNotFound()


def check_single_headers(names: Iterable[str]) -> None:
    """Raises BadRequest (400) naming the first routing header among ``names`` (a request's header
    names, repeated as sent) that comes more than once, whatever the case of each copy."""
    seen: dict[str, str] = {}  # lower-cased name -> the name as first sent
    for name in names:
        lowered = name.lower()
        if lowered != "authorization" and not lowered.startswith(FORWARDED_PREFIX):
            continue
        if lowered in seen:
            raise BadRequest(f"{seen[lowered]} is sent more than once; send it once")
        seen[lowered] = name
