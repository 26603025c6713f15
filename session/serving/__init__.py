"""One HTTP-level request in, status + headers + body (or chunks) out.

``protocol`` is the wire: SageMaker session headers and OpenAI chat shapes, pure functions and
dataclasses. ``api`` is the chat service every front door shares (the TorchServe handler, tests):
parse, decode images, submit to the engine, map its events and errors to an answer.

May import: ``engine``, ``families`` (image decoding) and the top modules. Never ``front``.
"""
