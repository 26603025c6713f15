"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

``acceptance`` holds the pure maths (greedy and sampled acceptance); ``controller`` decides k and
when to speculate; ``decoder`` drives the draft model or prompt lookup against the runner.

May import: ``model`` and the top modules. Never ``engine``, ``state``, ``serving`` or ``front``.
"""

from session import lazy_exports

# The package's public names, imported on first use.
__getattr__ = lazy_exports({
    "SpeculativeDecoder": "session.speculative.decoder",
    "SpeculationController": "session.speculative.controller",
})
