"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

``acceptance`` holds the pure maths (greedy and sampled acceptance); ``controller`` decides k and
when to speculate; ``decoder`` drives the draft model or prompt lookup against the runner.

May import: ``model`` and the top modules. Never ``engine``, ``state``, ``serving`` or ``front``.
"""

# The package's public names, imported on first use (importing a sub-module loads none of them).
_EXPORTS = {
    "SpeculativeDecoder": "session.speculative.decoder",
    "SpeculationController": "session.speculative.controller",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
