"""A request's ``n`` rows on the engine: submitted, followed event by event, merged into one stream
of chunks, and cancelled once nobody waits for them.

``RowStreams`` is the chat service's (``api``): it calls ``submit_all`` once a request is rendered,
then ``finished`` on each row for a plain answer or ``chunks`` for a stream, and ``cancel_unfinished``
when it stops waiting. All on the front door's event loop; the engine runs the rows on its thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from session.engine import Engine, GenerationRequest
from session.engine.events import Cancelled, EventStream, Failed, Finished, Started
from session.errors import RequestCancelled
from session.serving.answer_bodies import CompletionIds
from session.serving.answers import _ChatAnswer, _TextAnswer, _total_usage
from session.serving.api_response import error_response
from session.serving.chat_request import ChatRequest
from session.serving.protocol import sse
from session.types import SEED_RANGE, Usage


@dataclass
class _Choice:
    """One of a request's ``n`` rows in flight."""

    index: int
    stream: EventStream
    request_id: str
    started: Started | None = None
    done: bool = False  # Finished or Failed arrived
    text: str = ""  # a stream's answer so far
    num_text_sent: int = 0  # characters of ``text`` sent as content (tool calls hold some back)
    logprobs: list = field(default_factory=list)  # a stream's TokenLogprob entries so far
    num_logprobs_sent: int = 0


class RowStreams:
    """The engine's side of the chat service's requests; one per ``ChatService``."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def submit_all(self, base: GenerationRequest, request: ChatRequest, rendered,
                         answer: _ChatAnswer | _TextAnswer) -> list[_Choice]:
        """Submit the request's ``n`` rows and wait until each has started. The rows after the first wait
        for its prefill when the prompt fills a KV block, so that they find its blocks in the prefix
        cache; a shorter prompt has no block to share, and all rows are submitted at once."""
        choices = [self._submit(base, 0, request.stream)]
        shares_prefix = len(rendered.opening.token_ids) >= self.engine.config.kv_block_tokens if request.n > 1 else False
        try:
            if shares_prefix:
                await self._wait_started(choices[0])
            choices += [self._submit(base, i, request.stream) for i in range(1, request.n)]
            for choice in choices:
                await self._wait_started(choice)
        except BaseException:
            self.cancel_unfinished(choices)
            raise
        return choices

    def _submit(self, base: GenerationRequest, index: int, deltas: bool) -> _Choice:
        request_id = base.request_id if index == 0 else f"{base.request_id[:56]}-{index}"
        sampling = base.sampling
        if index and sampling.seed is not None:  # row i samples with seed + i (within the seed range)
            seed = sampling.seed + index
            sampling = replace(sampling, seed=seed if seed < SEED_RANGE[1] else sampling.seed - index)
        stream = EventStream(asyncio.get_running_loop(), deltas=deltas)  # a plain request reads Finished's text
        self.engine.submit(replace(base, stream=stream, request_id=request_id, sampling=sampling))
        return _Choice(index=index, stream=stream, request_id=request_id)

    async def _wait_started(self, choice: _Choice) -> None:
        if choice.started is not None:
            return
        event = await self._next_event(choice.stream, choice.request_id)
        if isinstance(event, Failed):
            choice.done = True
            raise event.error
        assert isinstance(event, Started)
        choice.started = event

    async def finished(self, choice: _Choice) -> Finished:
        while True:
            event = await self._next_event(choice.stream, choice.request_id)
            if isinstance(event, (Finished, Failed)):
                choice.done = True
            if isinstance(event, Finished):
                return event
            if isinstance(event, Failed):
                raise event.error

    def cancel_unfinished(self, choices: list[_Choice]) -> None:
        for choice in choices:
            if not choice.done:
                self.engine.cancel(choice.request_id)

    def shape_logprobs(self, entries) -> list[dict] | None:
        """The engine's TokenLogprob entries in OpenAI's shape (None when the request asked none)."""
        if entries is None:
            return None
        ids = sorted({e.token_id for e in entries} | {t for e in entries for t, _ in e.top})
        texts = dict(zip(ids, self.engine.token_texts(ids)))

        def one(token_id: int, logprob: float) -> dict:
            text = texts[token_id]
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]

    async def chunks(self, choices: list[_Choice], ids: CompletionIds,
                     answer: _ChatAnswer | _TextAnswer) -> AsyncGenerator[str, None]:
        """The rows' events as one stream of chunks, each row's in order, rows interleaved as they come."""
        pending: dict[asyncio.Future, _Choice] = {}
        usages: list[Usage] = []
        try:
            for choice in choices:
                for chunk in answer.first_chunks(ids, choice):
                    yield sse(chunk)
            pending = {self._next_of(choice): choice for choice in choices}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    choice = pending.pop(future)
                    event = future.result()
                    if isinstance(event, Failed):
                        choice.done = True
                        body = error_response(event.error).body
                        assert body is not None  # an error response is always a JSON body
                        yield sse(body)
                        return
                    for chunk in answer.chunks(choice, event, ids, self.shape_logprobs):
                        yield sse(chunk)
                    if isinstance(event, Finished):
                        choice.done = True
                        usages.append(event.usage)
                    else:
                        pending[self._next_of(choice)] = choice
            if answer.request.include_usage:  # as OpenAI sends it: a last chunk with no choices
                yield sse(answer.usage_chunk(ids, _total_usage(usages)))
            yield sse("[DONE]")
        finally:
            for future in pending:
                future.cancel()
            self.cancel_unfinished(choices)  # the consumer stopped reading (a disconnect): stop generating

    def _next_of(self, choice: _Choice) -> asyncio.Future:
        return asyncio.ensure_future(self._next_event(choice.stream, choice.request_id))

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
