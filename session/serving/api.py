"""The invocation service: one HTTP-level request in, status + headers + body (or chunks) out.

Shared by every front door (the TorchServe handler, tests): parse, decode images off the
event loop, hand the turn to the engine, wait for its events, shape the OpenAI-style
answer and the SageMaker session headers. Errors become JSON bodies in one place
(``api_response.error_response``); the rows' events are followed by ``row_streams`` and
shaped into answers by ``answers``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace

from session.engine import AdapterRequest, CancelRequest, CloseRequest, Engine, GenerationRequest, SessionAdminRequest
from session.engine.events import AdminResult, Closed, EventStream, Failed
from session.errors import BadRequest, ConfigError, Forbidden, ModelNotFound
from session.families.image_decode import decode_data_url
from session.families.vision import NO_IMAGES
from session.serving.answers import _ChatAnswer, _TextAnswer, _total_usage
from session.serving.api_response import ApiResponse, error_response
from session.serving.chat_request import ChatRequest, PromptLimits, parse_request
from session.serving.completion_request import parse_completion_request
from session.serving.fairness import FairSlots
from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    CANCEL_HEADER,
    CLOSED_SESSION_HEADER,
    COMPLETIONS_ENDPOINT,
    ENDPOINT_HEADER,
    NEW_SESSION_HEADER,
    REQUEST_ID_HEADER,
    REQUEST_ID_RE,
    SESSION_HEADER,
    WORKER_HEADER,
    header,
    load_json_object,
    new_session_header_value,
    tokens_match,
)
from session.serving.row_streams import RowStreams
from session.serving.tool_format import MARKERS
from session.serving.tools import ToolSupport
from session.types import ImagePart

OFF_LOOP_BYTES = 64 * 1024  # request bodies this large or larger are parsed on an executor thread


def _request_id(headers: Mapping[str, str]) -> str | None:
    """The caller's ``X-Resident-Request-Id`` (the front sets one on every request), checked."""
    value = header(headers, REQUEST_ID_HEADER)
    if value is None:
        return None
    if not REQUEST_ID_RE.fullmatch(value.strip()):
        raise BadRequest(f"{REQUEST_ID_HEADER} must match {REQUEST_ID_RE.pattern}")
    return value.strip()


class ChatService:
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name  # TorchServe's name for the model (metrics), also accepted as "model"
        self.served_name = engine.config.model_name  # what answers name and /v1/models lists
        self.base_names = frozenset({self.served_name, model_name})  # a "model" naming the base model
        for name in sorted(self.base_names):
            if engine.knows_adapter(name):
                raise ConfigError(f"adapter {name!r} has the base model's name, so no request could choose it: "
                                  "rename its folder in RESIDENT_ADAPTERS_DIR")
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        config = engine.config
        self.limits = PromptLimits(max_chars=config.max_prompt_chars, max_messages=config.max_messages,
                                   max_parts=config.max_content_parts)
        # Image decodes at once, and one tenant's share of them (half, at least one): a tenant's big images
        # never hold every slot while another's small one waits.
        self._image_decodes = FairSlots(config.max_image_decodes, max(1, config.max_image_decodes // 2))
        self._live_ids: set[str] = set()  # request ids of this worker's generations not yet answered
        self._tools: ToolSupport | None = None  # the model's tool format, found on first use
        self._rows = RowStreams(engine)  # its requests' rows on the engine

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
            cancel = header(headers, CANCEL_HEADER)
            if cancel is not None:
                self._check_token(token)
                return await self._cancel(cancel.strip())
            if token is not None:
                return await self._admin(token, body, request_id)
            parse = parse_completion_request if _endpoint(headers) == COMPLETIONS_ENDPOINT else parse_request
            request = await self._off_loop(functools.partial(
                parse, body, headers, default_max_tokens=config.default_max_tokens,
                max_new_tokens=config.max_new_tokens, limits=self.limits, max_choices=config.max_choices), body)
            session_id = request.session_id
            if request.closes_session:
                return await self._close(request, request_id)
            return await self._generate(request, request_id)
        except Exception as exc:
            return error_response(exc, request_id, session_id)

    async def _off_loop(self, work, body):
        """Parse a large body on an executor thread: decoding and walking it must not stall the loop every
        other request's events go through (a small one is parsed here, cheaper than the hand-off)."""
        if isinstance(body, (bytes, str)) and len(body) < OFF_LOOP_BYTES:
            return work()
        return await asyncio.get_running_loop().run_in_executor(None, work)

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
            if data.get("adapters") == "register" and data.get("name") in self.base_names:
                raise BadRequest(f"adapter name {data['name']!r} is the base model's: a request naming it gets the "
                                 "base model, so the adapter could never be chosen; register it under another name")
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
        assert isinstance(event, AdminResult), "a cancel is answered with AdminResult or Failed"
        return ApiResponse(status=200, body=event.body, kind="cancel")

    def _adapter(self, request: ChatRequest) -> str | None:
        """Header first; else the body's "model" when it names a registered adapter rather than the base
        model (by its served name, or TorchServe's); any other name is a 404 model_not_found."""
        if request.adapter:
            return request.adapter
        if request.model is None or request.model in self.base_names:
            return None
        if not self.engine.knows_adapter(request.model):
            raise ModelNotFound(f"model {request.model!r} is not served here: GET /v1/models lists "
                                f"{self.served_name!r} and the registered adapters")
        return request.model

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

    async def _until_done(self, chunks: AsyncGenerator[str, None], request_id: str) -> AsyncGenerator[str, None]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self._live_ids.discard(request_id)
            await chunks.aclose()  # its own clean-up (a disconnect cancels the generation) runs now

    async def _start(self, request: ChatRequest, request_id: str) -> ApiResponse:
        """Admission's cheap checks, then the request's own work off this loop and off the engine's thread
        (images decoded, at most ``max_image_decodes`` at once; the prompt rendered and tokenized), then
        the engine: ``n`` rows of one prompt."""
        loop = asyncio.get_running_loop()
        config = self.engine.config
        images = [p for m in request.messages for p in m.parts if isinstance(p, ImagePart)]
        if len(images) > config.max_images_per_request:
            raise BadRequest(f"at most {config.max_images_per_request} images per request")
        opens, adapter = request.opens_session, self._adapter(request)
        if images:  # the costly part: refuse what the engine would refuse before paying for it
            self.engine.precheck(session_id=request.session_id, open_session=opens, adapter=adapter,
                                 waiting=self._image_decodes.num_waiting)
            async with self._image_decodes.hold(request.tenant or ""):
                encoded, prepared = await loop.run_in_executor(None, self._prepare_images, images)
        else:
            encoded, prepared = [], NO_IMAGES
        tools = self.tool_support() if request.tools or _has_tool_messages(request) else None
        messages, rendered, sampling = await self._render(request, prepared, opens or request.session_id is None, tools)
        grammar = None if sampling.constraint is None else await loop.run_in_executor(
            None, self.engine.compile_grammar, sampling.constraint)
        base = GenerationRequest(
            messages=messages, sampling=sampling, stream=None,
            session_id=self.engine.new_session_id() if opens else request.session_id, open_session=opens,
            images=prepared, image_digests=tuple(digest for digest, _ in encoded),
            image_bytes=tuple(raw for _, raw in encoded), request_id=request_id, adapter=adapter,
            base_model=adapter is None and request.model in self.base_names,
            speculative=request.speculative, rendered=rendered, grammar=grammar,
            keep_special=tools is not None and request.tool_choice.mode != "none",
            cache_salt=cache_salt(request.tenant, request.cache_salt), tenant=request.tenant or "")
        answer = await self._answer(request, tools)
        choices = await self._rows.submit_all(base, request, rendered, answer)
        started = choices[0].started
        assert started is not None, "submit_all returns once every row has started"
        headers = {}
        if opens:
            assert started.session_id is not None and started.expires_at is not None, "a new session's Started names it"
            headers[NEW_SESSION_HEADER] = new_session_header_value(started.session_id, started.expires_at)
        elif started.session_id is not None:
            headers[SESSION_HEADER] = started.session_id
        ids = answer.ids(request.model or started.adapter or self.served_name)  # a follow-up: its session's
        kind = "first" if opens else ("followup" if started.session_id else "stateless")
        if request.stream:
            return ApiResponse(status=200, headers=headers, chunks=self._rows.chunks(choices, ids, answer), kind=kind)
        try:
            finished = [await self._rows.finished(choice) for choice in choices]
        finally:
            self._rows.cancel_unfinished(choices)
        body = answer.body(ids, [answer.choice(c.index, f, self._rows.shape_logprobs) for c, f in zip(choices, finished)],
                           _total_usage([f.usage for f in finished]), finished[0].session_id)
        return ApiResponse(status=200, body=body, headers=headers, kind=kind)

    async def _render(self, request: ChatRequest, prepared, first_turn: bool, tools: ToolSupport | None):
        """(the messages the turn renders, its rendered prompt, its sampling) on an executor thread: the
        chat template's rendering (tools described or handed to the template, a forced call's grammar
        as the constraint), or a /v1/completions prompt as it is."""
        loop = asyncio.get_running_loop()
        if request.prompt is not None:
            return (), await loop.run_in_executor(None, self.engine.render_prompt, request.prompt), request.sampling
        messages, template_tools, sampling = request.messages, None, request.sampling
        if tools is not None:
            offered = request.tools if request.tool_choice.mode != "none" else ()
            messages, template_tools = tools.prompt(request.messages, offered, first_turn)
            forced = tools.grammar(request.tools, request.tool_choice, request.parallel_tool_calls)
            sampling = sampling if forced is None else replace(sampling, constraint=forced)
        rendered = await loop.run_in_executor(None, self.engine.render_turn, messages, prepared, first_turn,
                                              template_tools)
        return messages, rendered, sampling

    async def _answer(self, request: ChatRequest, tools: ToolSupport | None) -> _ChatAnswer | _TextAnswer:
        """How the request's answers are shaped: a chat completion, or a text completion (its echo)."""
        if request.prompt is None:
            return _ChatAnswer(request, tools)
        if not request.echo:
            return _TextAnswer(request, "")
        if isinstance(request.prompt, str):
            return _TextAnswer(request, request.prompt)
        loop = asyncio.get_running_loop()
        return _TextAnswer(request, await loop.run_in_executor(None, self.engine.decode, list(request.prompt)))

    def tool_support(self) -> ToolSupport:
        """The served model's tool format, found on first use (the vocabulary scan is the grammar compiler's)."""
        if self._tools is None:
            self._tools = ToolSupport.of(self.engine.chat_template, self.engine.special_token_ids(MARKERS))
        return self._tools

    def _prepare_images(self, images: list[ImagePart]) -> tuple[list[tuple[str, bytes]], object]:
        """Decode (each size judged from its header first) and preprocess; returns each image's (digest,
        encoded bytes) and the model's inputs. The full-size decoded images are dropped here, not held
        until the answer."""
        config, check_size = self.engine.config, self.engine.image_size_check()
        decoded = [decode_data_url(p.url, max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels,
                                   check_size=check_size) for p in images]
        prepared = self.engine.preprocess_images([d.image for d in decoded])
        return [(d.digest, d.raw) for d in decoded], prepared


def cache_salt(tenant: str | None, salt: str) -> str:
    """The prefix-cache salt of a request: a digest of the tenant the front named (``X-Resident-Tenant``)
    and the request's ``cache_salt``; "" when neither is given (blocks shared with every unsalted request)."""
    if not tenant and not salt:
        return ""
    return hashlib.sha256(f"{tenant or ''}\0{salt}".encode()).hexdigest()


def _endpoint(headers: Mapping[str, str]) -> str | None:
    value = header(headers, ENDPOINT_HEADER)
    return None if value is None else value.strip()


def _has_tool_messages(request: ChatRequest) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in request.messages)
