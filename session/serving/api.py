"""The invocation service: one HTTP-level request in, status + headers + body (or chunks) out.

Shared by every front door (the TorchServe handler, tests): parse, decode images off the
event loop, hand the turn to the engine, wait for its events, shape the OpenAI-style
answer and the SageMaker session headers. Errors become JSON bodies here, in one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from session.engine import AdapterRequest, CancelRequest, CloseRequest, Engine, GenerationRequest, SessionAdminRequest
from session.engine.events import AdminResult, Cancelled, Closed, EventStream, Failed, Finished, Started, TextDelta
from session.errors import BadRequest, Forbidden, RequestCancelled, ResidentError
from session.families.image_decode import decode_data_url
from session.families.vision import NO_IMAGES
from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    CANCEL_HEADER,
    CLOSED_SESSION_HEADER,
    NEW_SESSION_HEADER,
    REQUEST_ID_HEADER,
    REQUEST_ID_RE,
    SESSION_HEADER,
    WORKER_HEADER,
    ChatRequest,
    CompletionIds,
    PromptLimits,
    chunk_body,
    completion_body,
    header,
    load_json_object,
    new_session_header_value,
    parse_request,
    sse,
    tokens_match,
)
from session.types import ImagePart, redact

logger = logging.getLogger(__name__)

JSON = "application/json"
EVENT_STREAM = "text/event-stream"


@dataclass
class ApiResponse:
    status: int
    body: dict | None = None  # a JSON body, or None when ``chunks`` streams the answer
    headers: dict[str, str] = field(default_factory=dict)
    chunks: AsyncIterator[str] | None = None  # server-sent events, for "stream": true
    kind: str = "error"  # first | followup | stateless | close | error: for latency metrics

    @property
    def content_type(self) -> str:
        return EVENT_STREAM if self.chunks is not None else JSON


def _request_id(headers: Mapping[str, str]) -> str | None:
    """The caller's ``X-Resident-Request-Id`` (the front sets one on every request), checked."""
    value = header(headers, REQUEST_ID_HEADER)
    if value is None:
        return None
    if not REQUEST_ID_RE.fullmatch(value.strip()):
        raise BadRequest(f"{REQUEST_ID_HEADER} must match {REQUEST_ID_RE.pattern}")
    return value.strip()


def error_response(exc: Exception, request_id: str = "", session_id: str | None = None) -> ApiResponse:
    if isinstance(exc, ResidentError):
        return ApiResponse(status=exc.status, body=exc.to_body(), headers=dict(exc.headers))
    logger.error("request %s (session %s) failed", request_id, redact(session_id), exc_info=exc)
    return ApiResponse(status=500, body={"error": {"type": "internal_error",
                                                   "message": f"internal error; request id {request_id}"}})


class ChatService:
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        config = engine.config
        self.limits = PromptLimits(max_chars=config.max_prompt_chars, max_messages=config.max_messages)
        self._image_decodes = asyncio.Semaphore(config.max_image_decodes)
        self._live_ids: set[str] = set()  # request ids of this worker's generations not yet answered

    async def invoke(self, headers: Mapping[str, str], body) -> ApiResponse:
        """Called once per HTTP request by a front door, on its event loop."""
        response = await self._invoke(headers, body)
        response.headers[WORKER_HEADER] = self.worker_id
        return response

    async def _invoke(self, headers: Mapping[str, str], body) -> ApiResponse:
        request_id = uuid.uuid4().hex
        session_id = None
        try:
            config = self.engine.config
            request_id = self._own_request_id(headers) or request_id
            token = header(headers, ADMIN_TOKEN_HEADER)
            if header(headers, CANCEL_HEADER) is not None:
                self._check_token(token)
                return await self._cancel(header(headers, CANCEL_HEADER).strip())
            if token is not None:
                return await self._admin(token, body, request_id)
            request = parse_request(body, headers, default_max_tokens=config.default_max_tokens,
                                    max_new_tokens=config.max_new_tokens, limits=self.limits)
            session_id = request.session_id
            if request.closes_session:
                return await self._close(request, request_id)
            return await self._generate(request, request_id)
        except Exception as exc:
            return error_response(exc, request_id, session_id)

    def _check_token(self, token: str | None) -> None:
        if not tokens_match(token, self.engine.config.admin_token):
            raise Forbidden(f"this needs the admin token (RESIDENT_ADMIN_TOKEN) in {ADMIN_TOKEN_HEADER}"
                            if token is None else "bad admin token")

    def _own_request_id(self, headers: Mapping[str, str]) -> str | None:
        """The caller's request id, unless a request of this worker is already running under it: then
        None (a fresh id), so that reusing an id neither fails nor tells the caller the id is live. The
        front sends a fresh random id with each request; only a cancel carrying the admin token can
        name one."""
        request_id = _request_id(headers)
        return None if request_id in self._live_ids else request_id

    async def _admin(self, token: str, body, request_id: str) -> ApiResponse:
        """Adapter administration, sent by the front to every backend: {"adapters": action, ...}."""
        self._check_token(token)
        data = body if isinstance(body, dict) else load_json_object(body)
        stream = EventStream(asyncio.get_running_loop())
        if "sessions" in data:
            unknown = set(data) - {"sessions", "session_id", "session"}
            if unknown:
                raise BadRequest(f"unknown admin field(s) {sorted(unknown)}")
            self.engine.submit(SessionAdminRequest(action=data["sessions"], stream=stream,
                                                   session_id=data.get("session_id"), exported=data.get("session"),
                                                   request_id=request_id))
        else:
            unknown = set(data) - {"adapters", "name", "src", "pinned", "dry_run"}
            if unknown:
                raise BadRequest(f"unknown admin field(s) {sorted(unknown)}")
            self.engine.submit(AdapterRequest(action=data.get("adapters"), stream=stream, name=data.get("name"),
                                              src=data.get("src"), pinned=bool(data.get("pinned", False)),
                                              dry_run=bool(data.get("dry_run", False)), request_id=request_id))
        event = await stream.aget()
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, AdminResult)
        return ApiResponse(status=200, body=event.body, kind="admin")

    async def _cancel(self, target: str) -> ApiResponse:
        """``X-Resident-Cancel: <request id>``, with the admin token (the front sends it): a request id
        is no secret, so one client could otherwise stop another's request."""
        if not REQUEST_ID_RE.fullmatch(target):
            raise BadRequest(f"{CANCEL_HEADER} must name a request id ({REQUEST_ID_RE.pattern})")
        stream = EventStream(asyncio.get_running_loop())
        self.engine.submit(CancelRequest(target_request_id=target, stream=stream))
        event = await stream.aget()
        if isinstance(event, Failed):
            raise event.error
        return ApiResponse(status=200, body=event.body, kind="cancel")

    def _adapter(self, request: ChatRequest) -> str | None:
        """Header first; else the body's "model" when it names something other than the base model."""
        if request.adapter:
            return request.adapter
        if request.model and request.model != self.model_name:
            return request.model
        return None

    async def _close(self, request: ChatRequest, request_id: str) -> ApiResponse:
        stream = EventStream(asyncio.get_running_loop())
        self.engine.submit(CloseRequest(session_id=request.session_id, stream=stream, request_id=request_id))
        event = await stream.aget()
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, Closed)
        return ApiResponse(status=200, body={"session_id": event.session_id, "closed": True},
                           headers={CLOSED_SESSION_HEADER: event.session_id}, kind="close")

    async def _generate(self, request: ChatRequest, request_id: str) -> ApiResponse:
        self._live_ids.add(request_id)
        try:
            response = await self._start(request, request_id)
        except BaseException:
            self._live_ids.discard(request_id)
            raise
        response.headers[REQUEST_ID_HEADER] = request_id  # the id a cancel names (with the admin token)
        if response.chunks is None:
            self._live_ids.discard(request_id)
        else:
            response.chunks = self._until_done(response.chunks, request_id)
        return response

    async def _until_done(self, chunks: AsyncIterator[str], request_id: str) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self._live_ids.discard(request_id)
            await chunks.aclose()  # its own clean-up (a disconnect cancels the generation) runs now

    async def _start(self, request: ChatRequest, request_id: str) -> ApiResponse:
        """Admission's cheap checks, then the request's own work off this loop and off the engine's thread
        (images decoded, at most ``max_image_decodes`` at once; the prompt rendered and tokenized), then
        the engine."""
        loop = asyncio.get_running_loop()
        config = self.engine.config
        images = [p for m in request.messages for p in m.parts if isinstance(p, ImagePart)]
        if len(images) > config.max_images_per_request:
            raise BadRequest(f"at most {config.max_images_per_request} images per request")
        opens, adapter = request.opens_session, self._adapter(request)
        if images:  # the costly part: refuse what the engine would refuse before paying for it
            self.engine.precheck(session_id=request.session_id, open_session=opens, adapter=adapter)
            async with self._image_decodes:
                decoded, prepared = await loop.run_in_executor(None, self._prepare_images, images)
        else:
            decoded, prepared = [], NO_IMAGES
        first_turn = opens or request.session_id is None
        rendered = await loop.run_in_executor(None, self.engine.render_turn, request.messages, prepared, first_turn)
        constraint = request.sampling.constraint
        grammar = None if constraint is None else await loop.run_in_executor(None, self.engine.compile_grammar,
                                                                              constraint)
        stream = EventStream(loop, deltas=request.stream)  # a plain request reads Finished's text
        self.engine.submit(GenerationRequest(
            messages=request.messages, sampling=request.sampling, stream=stream,
            session_id=self.engine.new_session_id() if opens else request.session_id, open_session=opens,
            images=prepared, image_digests=tuple(d.digest for d in decoded),
            image_bytes=tuple(d.raw for d in decoded), request_id=request_id, adapter=adapter,
            speculative=request.speculative, rendered=rendered, grammar=grammar,
        ))
        started = await self._next_event(stream, request_id)
        if isinstance(started, Failed):
            raise started.error
        assert isinstance(started, Started)
        headers = {}
        if opens:
            headers[NEW_SESSION_HEADER] = new_session_header_value(started.session_id, started.expires_at)
        elif started.session_id is not None:
            headers[SESSION_HEADER] = started.session_id
        ids = CompletionIds(model=request.model or self.model_name)
        kind = "first" if opens else ("followup" if started.session_id else "stateless")
        if request.stream:
            return ApiResponse(status=200, headers=headers, chunks=self._chunks(stream, ids, request_id, request),
                               kind=kind)
        while True:
            event = await self._next_event(stream, request_id)
            if isinstance(event, Finished):
                body = completion_body(ids, event.text, event.finish_reason, event.usage, event.session_id,
                                       self._logprobs(event.logprobs))
                return ApiResponse(status=200, body=body, headers=headers, kind=kind)
            if isinstance(event, Failed):
                raise event.error

    def _prepare_images(self, images: list[ImagePart]):
        config = self.engine.config
        decoded = [decode_data_url(p.url, max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels)
                   for p in images]
        return decoded, self.engine.preprocess_images([d.image for d in decoded])

    def _logprobs(self, entries) -> list[dict] | None:
        """The engine's TokenLogprob entries in OpenAI's shape (None when the request asked none)."""
        if entries is None:
            return None
        ids = sorted({e.token_id for e in entries} | {t for e in entries for t, _ in e.top})
        texts = dict(zip(ids, self.engine.token_texts(ids)))

        def one(token_id: int, logprob: float) -> dict:
            text = texts[token_id]
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    async def _chunks(self, stream: EventStream, ids: CompletionIds, request_id: str,
                      request: ChatRequest) -> AsyncIterator[str]:
        finished = False
        wants_logprobs = request.sampling.logprobs is not None
        num_logprobs_sent = 0
        try:
            yield sse(chunk_body(ids, {"role": "assistant", "content": ""}))
            while True:
                event = await self._next_event(stream, request_id)
                if isinstance(event, TextDelta):
                    logprobs = self._logprobs(event.logprobs) if wants_logprobs else None
                    num_logprobs_sent += len(event.logprobs)
                    yield sse(chunk_body(ids, {"content": event.text}, logprobs=logprobs))
                elif isinstance(event, Finished):
                    finished = True
                    rest = self._logprobs(event.logprobs[num_logprobs_sent:]) if wants_logprobs else None
                    yield sse(chunk_body(ids, {}, finish_reason=event.finish_reason, logprobs=rest))
                    if request.include_usage:  # as OpenAI sends it: a last chunk with no choices
                        yield sse(chunk_body(ids, None, usage=event.usage))
                    yield sse("[DONE]")
                    return
                elif isinstance(event, Failed):
                    finished = True
                    yield sse(error_response(event.error).body)
                    return
        finally:
            if not finished:  # the consumer stopped reading (a disconnect): stop generating
                self.engine.cancel(request_id)

    async def _next_event(self, stream: EventStream, request_id: str):
        """The request's next event; Cancelled becomes Failed(RequestCancelled). If the caller's task is
        cancelled (its client went away), the generation is cancelled too."""
        try:
            event = await stream.aget()
        except asyncio.CancelledError:
            self.engine.cancel(request_id)
            raise
        if isinstance(event, Cancelled):
            return Failed(RequestCancelled(f"request {request_id} was cancelled ({event.reason}); "
                                           "its turn was rolled back"))
        return event
