"""Resident: a session-resident serving engine for vision-language models.

The sub-packages are layers; each may import only the layers below it (``make lint`` checks):

    front/      the routing front (its own process): pins sessions to backends, SageMaker paths
    serving/    one HTTP-level request in, an answer out: the wire protocol and the chat service
    engine/     the loop thread that owns every session: admission, scheduling, steps, outputs
    speculative/ draft-and-verify decoding: the acceptance maths, the controller, the decoder
    state/      what a session holds and where: state, store, memory tiers, embeddings, journal
    model/      the one owner of weights and forward passes: runner, KV cache, attention, LoRA
    families/   what each model family is: its classes, image geometry, positions, support check

At the top, used by every layer: ``config`` (the one typed config), ``errors`` (the exception
family, mapped to HTTP status) and ``types`` (the value types the layers pass to each other).
Nothing here imports TorchServe; ``handlers/`` adapts ``serving`` to it.
"""


def lazy_exports(exports: dict[str, str]):
    """A package's ``__getattr__`` that imports each public name's module on first use (PEP 562), so
    that importing one sub-module of a package loads none of the others. ``exports``: name -> module."""
    import importlib

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module has no attribute {name!r}")

    return __getattr__
