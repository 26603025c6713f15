"""The engine: one loop thread that owns every session.

``loop`` is ``Engine`` (submit from any thread; ``step`` on the loop thread; ``end``: the one place
a request ends); ``admission`` turns arrivals into sequences or immediate answers; ``scheduler``
picks each step's prefills and decode rows, asking the KV owner (``state.kv_manager``) for room;
``plan_runner`` runs a step's plan (prefill chunks, then the decode rows; fewer rows after an
out-of-memory); ``executor`` runs a step's model work; ``preparation`` is the callers' side (render,
tokenize, grammars) on any thread; ``outputs`` turns tokens into text and final events (``detokenizer``: ids to text, incrementally); ``requests`` holds the request dataclasses and
``Sequence``; ``events`` what travels back; ``prompt`` chat messages -> token ids; ``admin``
adapter and session administration; ``stats`` the metrics snapshot; ``assembly`` builds the parts.

May import: ``state``, ``model``, ``speculative``, ``families`` and the top modules. Never
``serving`` or ``front``.
"""

from session import lazy_exports

# The package's public names, imported on first use.
__getattr__ = lazy_exports({
    "Engine": "session.engine.loop",
    "GenerationRequest": "session.engine.requests",
    "CloseRequest": "session.engine.requests",
    "CancelRequest": "session.engine.requests",
    "AdapterRequest": "session.engine.requests",
    "SessionAdminRequest": "session.engine.requests",
})
