"""One HTTP-level request in, status + headers + body (or chunks) out.

``protocol`` is the wire: SageMaker session headers and ours, the JSON body, SSE framing (the front
uses it too). The request parsers, pure functions and dataclasses: ``chat_request`` (chat
completions and SageMaker invocations), ``completion_request`` (/v1/completions), the fields they
share (``request_fields``, ``sampling_fields``) and the tool fields (``tool_fields``). Tool calling:
``tools`` (``ToolSupport``, one served model's) over ``tool_format``, ``tool_prompt``,
``tool_calls`` and ``tool_grammar``. ``api`` is the chat service every front door shares (the
TorchServe handler, tests): parse, decode images, submit to the engine, map its events and errors to
an answer; ``row_streams`` follows a request's rows on the engine, ``answers`` and ``answer_bodies``
shape what they say, ``api_response`` is what a front door gets back, ``fairness`` shares image
decodes between tenants.

May import: ``engine``, ``families`` (image decoding) and the top modules. Never ``front``.
"""
