"""What the engine hands back to a caller, and the thread-safe channel it travels on."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass

from session.types import TokenLogprob, Usage


@dataclass(frozen=True)
class Started:
    """Prefill succeeded: the request will produce tokens. Headers can be sent now."""

    session_id: str | None  # None for a stateless request
    expires_at: float | None
    prompt_tokens: int
    cached_tokens: int
    adapter: str | None = None  # the adapter that answers (the session's); None: the base model


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens this text came from, when the request asked for them


@dataclass(frozen=True)
class Finished:
    session_id: str | None
    text: str  # the whole answer, stop strings removed
    token_ids: tuple[int, ...]  # every generated token, EOS included
    finish_reason: str  # "stop" | "length"
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None = None  # per answer token (EOS excluded), when asked for


@dataclass(frozen=True)
class Closed:
    session_id: str


@dataclass(frozen=True)
class AdminResult:
    body: dict


@dataclass(frozen=True)
class Failed:
    error: BaseException  # a step that failed outside the guarded calls ends its rows with what it raised


@dataclass(frozen=True)
class Cancelled:
    """The request was stopped before it finished (a cancel, a disconnect, its session closed); its turn
    was rolled back, so the session is as it was before the request."""

    reason: str


Event = Started | TextDelta | Finished | Closed | AdminResult | Failed | Cancelled
TERMINAL = (Finished, Closed, AdminResult, Failed, Cancelled)


class EventStream:
    """Single-producer (the engine thread), single-consumer channel.

    With ``loop`` the consumer awaits ``aget()`` on that event loop; without, it blocks on ``get()``.
    With ``deltas=False`` (a consumer that wants only the answer: a non-streaming request) no
    TextDelta is sent: Finished carries the whole text, and the engine thread does not wake the
    consumer's thread for every token (each wake-up is a GIL hand-off the step waits on).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, deltas: bool = True):
        self._loop = loop
        self.deltas = deltas
        self._async_queue: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        if self._loop is None or self._async_queue is None:  # both None, or neither
            self._queue.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def get(self, timeout: float | None = None) -> Event:
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> Event:
        """Raises queue.Empty when nothing has arrived."""
        return self._queue.get_nowait()

    async def aget(self) -> Event:
        if self._async_queue is None:
            raise RuntimeError("aget() needs an EventStream made with a loop; without one, call get()")
        return await self._async_queue.get()
