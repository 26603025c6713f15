"""Abuse (``python -m benchmarks.load --abuse``): does a flood of huge prompts stall another client's stream?

One victim client opens a session (non-streamed, as SageMaker requires of an open) and then streams
follow-ups of ``max_tokens`` each, one after another, opening a new session when its context is full.
Two phases in one run:

- baseline: the victim alone for ``victim_s`` seconds;
- attack: the victim again, and ``lead_s`` after it starts, attackers send ``num_attacks`` requests
  (``attack_concurrency`` at a time) whose one user message is ``prompt_chars`` characters of words,
  a body just under the 6 MiB request limit. The server must refuse them (400, over
  RESIDENT_MAX_PROMPT_CHARS) without holding up the victim. The victim streams until the last
  attacker has its answer and ``lead_s`` more, and for at least ``victim_s``.

The attackers run on their own thread and event loop, so that writing their 6 MB bodies does not
queue ahead of the victim's reads on one loop; they still share this process and the machine's CPUs
with the server, so a busy machine shows in the numbers of both phases.

A victim turn's gaps are the times between consecutive SSE chunks, the first one measured from
sending the request: a stalled engine shows as a long wait for the first chunk too. Besides the whole
phases, the gaps that overlap the attack window (first attack sent to last one answered) are summarised
on their own: what the victim saw while the huge bodies were in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

from benchmarks.common import image_data_url, percentile

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
# The front's limit (RESIDENT_FRONT_MAX_REQUEST_BYTES, SageMaker's payload limit); TorchServe's own
# max_request_size in config.properties is a little larger, so a body under this reaches the handler.
MAX_REQUEST_BYTES = 6 * 1024 * 1024
NAN = float("nan")
MESSAGE_CHARS = 160
AIM_GAP_S = 0.5  # the longest gap the victim may see under attack (issue #28)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "watch")
FOLLOWUPS = ("Tell me a long story.", "Go on.", "And then what happened?", "Describe it in detail.")


@dataclass
class VictimTurn:
    """One streamed turn of the victim: times on the phase's clock (seconds since the phase began)."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each "data:" event, [DONE] included
    status: int = 0
    error: str = ""  # "" when the stream ended with [DONE]


@dataclass
class AttackResult:
    status: int  # 0: no answer (connection closed or timed out)
    error_type: str
    sent_s: float  # on the phase's clock
    answer_s: float  # from sending to the whole answer read
    message: str = ""  # the error's message, cut to MESSAGE_CHARS: it should name the limit

    @property
    def answered_s(self) -> float:
        return self.sent_s + self.answer_s


# ---------------------------------------------------------------- pure parts


def words_text(num_chars: int) -> str:
    """Exactly ``num_chars`` characters of space-separated words (a prompt that tokenizes like text)."""
    sentence = " ".join(WORDS) + " "
    return (sentence * (num_chars // len(sentence) + 1))[:num_chars]


def attack_body(num_chars: int, max_request_bytes: int = MAX_REQUEST_BYTES) -> bytes:
    """A chat request whose one user message is ``num_chars`` characters; at most ``max_request_bytes``."""
    body = json.dumps({"messages": [{"role": "user", "content": words_text(num_chars)}],
                       "max_tokens": 16}).encode()
    if len(body) > max_request_bytes:
        raise ValueError(f"a {num_chars}-character prompt makes a {len(body)}-byte body, over the "
                         f"{max_request_bytes}-byte request limit; ask for fewer characters (--prompt-chars)")
    return body


def turn_gaps(turn: VictimTurn) -> list[float]:
    """Seconds between consecutive chunks of one turn, the first from sending the request."""
    times = [turn.sent_s, *turn.chunk_s]
    return [later - earlier for earlier, later in zip(times, times[1:])]


def victim_summary(turns: Sequence[VictimTurn], window: tuple[float, float] | None = None) -> dict:
    """Chunks and gaps over a phase's turns. ``longest_gap_at_s``: when that gap ended (phase clock);
    ``longest_first_chunk_s``: the longest wait from a request to its first chunk. With ``window``
    (start, end), the same for the chunks whose gap overlaps it: what the victim saw while attacked."""
    gaps = [(gap, end) for t in turns for gap, end in zip(turn_gaps(t), t.chunk_s)]
    summary = {"num_turns": len(turns), "num_failed": sum(bool(t.error) for t in turns),
               **_gap_numbers(gaps),
               "longest_first_chunk_s": max((t.chunk_s[0] - t.sent_s for t in turns if t.chunk_s), default=NAN)}
    if window is not None:
        inside = [(gap, end) for gap, end in gaps if end - gap < window[1] and end > window[0]]
        summary["window"] = {"start_s": window[0], "end_s": window[1], **_gap_numbers(inside)}
    return summary


def _gap_numbers(gaps: Sequence[tuple[float, float]]) -> dict:
    """gaps: (seconds, when it ended) per chunk. ``chunks_per_s``: over the time those gaps cover (the
    streaming time, pauses between turns left out)."""
    longest, at = max(gaps, default=(NAN, NAN))
    values = [gap for gap, _ in gaps]
    return {"num_chunks": len(gaps), "chunks_per_s": len(gaps) / sum(values) if values else NAN,
            "longest_gap_s": longest, "longest_gap_at_s": at,
            "p99_gap_s": percentile(values, 99), "p50_gap_s": percentile(values, 50)}


def attack_window(results: Sequence[AttackResult]) -> tuple[float, float] | None:
    """From the first attack sent to the last one answered (phase clock); None without attacks."""
    if not results:
        return None
    return min(r.sent_s for r in results), max(r.answered_s for r in results)


def attack_summary(results: Sequence[AttackResult]) -> list[dict]:
    """One row per (status, error type): how many, their p50 and longest time to answer, the first message."""
    groups: dict[tuple[int, str], list[AttackResult]] = {}
    for r in results:
        groups.setdefault((r.status, r.error_type), []).append(r)
    return [{"status": status, "error_type": error, "n": len(group),
             "p50_answer_s": percentile([r.answer_s for r in group], 50),
             "max_answer_s": max(r.answer_s for r in group), "message": group[0].message}
            for (status, error), group in sorted(groups.items())]


def attack_failed(result: AttackResult) -> bool:
    """A refusal must be a 4xx answer: a 5xx or no answer at all is the server failing."""
    return result.status == 0 or result.status >= 500


# ---------------------------------------------------------------- the victim


class Victim:
    """Streams turns of its own session until ``stop`` is set; a full context opens a new session."""

    def __init__(self, http: aiohttp.ClientSession, url: str, max_tokens: int, with_image: bool, began: float):
        self.http, self.url, self.max_tokens, self.with_image, self.began = http, url, max_tokens, with_image, began
        self.turns: list[VictimTurn] = []
        self.num_sessions = 0
        self.session_id: str | None = None

    def now(self) -> float:
        return time.perf_counter() - self.began

    async def run(self, stop: asyncio.Event) -> None:
        """Turns until ``stop``, or until one fails (that turn is the last one recorded)."""
        num_session_turns = 0
        while not stop.is_set():
            if self.session_id is None:
                opened = await self.open()
                if opened.error:
                    self.turns.append(opened)
                    break
                num_session_turns = 0
            turn = await self.stream_turn(FOLLOWUPS[len(self.turns) % len(FOLLOWUPS)])
            if turn.error == "context_length_exceeded" and num_session_turns:  # full: start another session
                await self.close()
                continue
            self.turns.append(turn)
            num_session_turns += 1
            if turn.error:
                break
        await self.close()

    async def open(self) -> VictimTurn:
        """Open a session (not streamed); a failure comes back as a failed turn without chunks."""
        content: list[dict] = [{"type": "text", "text": "Hello! Let us talk."}]
        if self.with_image:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_data_url(self.num_sessions, size=48)}})
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
        opened = VictimTurn(sent_s=self.now())
        async with self.http.post(self.url, json=body, headers={SESSION: "NEW_SESSION"}) as response:
            opened.status = response.status
            payload = await response.read()
            if response.status != 200:
                opened.error = f"open: {_error_type(payload)}"
                return opened
            self.session_id = response.headers[NEW_SESSION_ID].split(";")[0]
        self.num_sessions += 1
        return opened

    async def stream_turn(self, text: str) -> VictimTurn:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": self.max_tokens, "stream": True}
        turn = VictimTurn(sent_s=self.now())
        async with self.http.post(self.url, json=body, headers={SESSION: self.session_id}) as response:
            turn.status = response.status
            if response.status != 200:
                turn.error = _error_type(await response.read())
                return turn
            done = False
            async for line in response.content:
                if line.startswith(b"data:"):
                    turn.chunk_s.append(self.now())
                    done = line.strip() == b"data: [DONE]"
        turn.error = "" if done else "stream ended without [DONE]"
        return turn

    async def close(self) -> None:
        if self.session_id is None:
            return
        async with self.http.post(self.url, json={"requestType": "CLOSE"}, headers={SESSION: self.session_id}) as r:
            await r.read()
        self.session_id = None


def _error_type(payload: bytes) -> str:
    return _error(payload)[0]


def _error(payload: bytes) -> tuple[str, str]:
    """An error body's (type, message)."""
    try:
        error = json.loads(payload).get("error", {})
        return error.get("type", "?"), error.get("message", "")
    except (ValueError, AttributeError):
        return "not JSON", payload[:MESSAGE_CHARS].decode(errors="replace")


# ---------------------------------------------------------------- the attackers


async def attack(url: str, body: bytes, num_attacks: int, concurrency: int, timeout_s: float,
                 began: float) -> list[AttackResult]:
    """Send ``body`` ``num_attacks`` times, ``concurrency`` at a time. Runs on its own event loop."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}

    async def one() -> AttackResult:
        async with gate:
            sent = time.perf_counter()
            status, error, message = 0, "no answer", ""
            try:
                async with asyncio.timeout(timeout_s):
                    async with http.post(url, data=body, headers=headers) as response:
                        payload = await response.read()
                        status, (error, message) = response.status, _error(payload)
            except TimeoutError:
                error = "timed out"
            except aiohttp.ClientError as exc:
                error = f"connection: {type(exc).__name__}"
            return AttackResult(status, error, sent - began, time.perf_counter() - sent, message[:MESSAGE_CHARS])

    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(one() for _ in range(num_attacks))))


# ---------------------------------------------------------------- the run


async def run_phase(http, url: str, *, victim_s: float, lead_s: float, max_tokens: int, with_image: bool,
                    body: bytes | None, num_attacks: int, concurrency: int, timeout_s: float) -> dict:
    """One phase: the victim alone (``body`` None) or under attack."""
    began, began_at = time.perf_counter(), time.time()
    victim, stop = Victim(http, url, max_tokens, with_image, began), asyncio.Event()
    streaming = asyncio.create_task(victim.run(stop))
    attacks: list[AttackResult] = []
    if body is not None:
        await asyncio.sleep(lead_s)
        attacks = await asyncio.to_thread(asyncio.run, attack(url, body, num_attacks, concurrency, timeout_s, began))
        await asyncio.sleep(lead_s)
    await asyncio.sleep(max(0.0, victim_s - (time.perf_counter() - began)))
    stop.set()
    await streaming
    return {"victim": victim_summary(victim.turns, attack_window(attacks)), "num_sessions": victim.num_sessions,
            "attacks": attack_summary(attacks), "num_failed_attacks": sum(map(attack_failed, attacks)),
            "wall_s": time.perf_counter() - began,
            "began_at": began_at,  # Unix time of the phase clock's 0, to match server logs
            "turns": [asdict(t) for t in victim.turns], "attack_results": [asdict(a) for a in attacks]}


async def run_abuse(url: str, *, num_attacks: int = 6, concurrency: int = 3, prompt_chars: int = 6_000_000,
                    max_tokens: int = 256, victim_s: float = 5.0, lead_s: float = 0.5, with_image: bool = False,
                    timeout_s: float = 180.0) -> dict:
    """The baseline phase, then the attack phase, against one server; what ``report_abuse`` prints."""
    body = attack_body(prompt_chars)
    common = {"victim_s": victim_s, "lead_s": lead_s, "max_tokens": max_tokens, "with_image": with_image,
              "num_attacks": num_attacks, "concurrency": concurrency, "timeout_s": timeout_s}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        baseline = await run_phase(http, url, body=None, **common)
        attacked = await run_phase(http, url, body=body, **common)
    return {"settings": {**common, "prompt_chars": prompt_chars, "body_bytes": len(body)},
            "baseline": baseline, "attack": attacked}
