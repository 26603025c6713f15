"""The routing front: an aiohttp server before N backends, run as its own process.

``server`` is ``Front``: the HTTP paths (SageMaker runtime, OpenAI, ``/invocations``) and their
wiring; ``forwarding`` sends each invocation to the backend that holds its session and relays the
answer; ``admin_routes`` drains, restarts and manages adapters on every backend; ``health``
probes the backends; ``answers`` shapes headers and errors; ``config`` is ``FrontConfig``.
Beneath them: ``router`` (pure bookkeeping of backends and pins), ``locator`` (finds a session
nobody pinned), ``migration`` (drains a backend), ``backend_client`` (admin calls and cancels),
``event_stream`` (SageMaker's streamed answer framing).

May import: ``session.serving.protocol`` (the wire), ``session.config``, ``session.errors``,
``session.types``. Never ``engine``, ``state``, ``model``, ``speculative``, ``families`` or torch:
a front holds no session state.
"""

from session import lazy_exports

# The package's public names, imported on first use.
__getattr__ = lazy_exports({
    "Front": "session.front.server",
    "FrontConfig": "session.front.config",
})
