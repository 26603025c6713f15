"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

``acceptance`` holds the pure maths (greedy and sampled acceptance); ``controller`` decides k and
when to speculate; ``decoder`` drives the draft model or prompt lookup against the runner.

May import: ``model`` and the top modules. Never ``engine``, ``state``, ``serving`` or ``front``.
"""
