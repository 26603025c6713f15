"""The routing front: an aiohttp server before N backends, run as its own process.

``server`` serves the HTTP paths (SageMaker runtime, OpenAI, ``/invocations``) and forwards each
to the backend that holds its session; ``router`` is the pure bookkeeping of backends and pins,
``locator`` finds a session nobody pinned, ``migration`` drains a backend, ``backend_client`` sends
admin calls and cancels, ``event_stream`` frames SageMaker's streamed answers.

May import: ``session.serving.protocol`` (the wire), ``session.errors``, ``session.config``,
``session.types``. Never ``engine``, ``state``, ``model`` or torch: a front holds no session state.
"""
