"""Resident: a session-resident serving engine for vision-language models.

This package never imports TorchServe; ``handlers/`` adapts it to TorchServe and
``session.front`` to plain HTTP.
"""
