"""The scheduler: what each step decodes and prefills, within a token budget. Plain Python, no torch.

Who calls this: the engine loop thread only (docs/ENGINE.md). The engine ``add``s every admitted
generation, asks ``schedule()`` for a step's plan, runs it on the model, and reports back with
``complete(plan, ended)``; ``remove`` takes a sequence out wherever it is (it ended early: failed,
cancelled). Every admitted sequence is in exactly one place at any time:

- ``pending[session_id]``: behind the request in flight on the same session, in arrival order
  (requests on one session run one at a time; the items there are requests, not yet sequences);
- ``waiting``: admitted, its prefill not begun;
- ``prefilling``: its prefill begun and not finished (a long prompt, fed in chunks across steps);
- ``running``: decoding;
- the plan of the step under way.

The token budget: a step decodes at most ``max_batch_size`` rows, one token each, taken from the
front of ``running`` (the rows that did not end go to the back, so with more running requests than
one step takes each advances every ceil(running / max_batch_size) steps and none is ever dropped).
What is left of ``token_budget`` (at least a quarter of it, so prompts advance however many rows
decode) is given to prefills, in chunks: a long prompt is prefilled across steps while the others
keep decoding, and several short ones share a step.

Memory: the scheduler asks the KV owner (``KVOwner``: the executor, over session/state/kv_manager.py)
before it begins a prefill, with every turn it has begun in the same step. A turn that finds no room
waits, first in line (no later arrival begins before it), until a request in flight ends and frees
room; with nothing in flight to wait for it begins anyway, and fails with the KV owner's reason.
Prefills already begun hold their room: they continue.

The order of prefills, which no peer engine has: a resident session's follow-up (its KV is on the
device and the turn fits one step's budget) goes before cold prompts, then everything else in
arrival order (so a prompt begun is finished before the next one starts). Bounded: a prompt passed
over by later arrivals in ``max_passed_over`` steps goes first from then on, so cold prompts never
starve behind a stream of follow-ups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from session.engine.requests import Sequence


@dataclass
class StepPlan:
    prefill: list[Sequence] = field(default_factory=list)  # prefilled this step, in order
    chunks: list[int] = field(default_factory=list)  # tokens each may prefill this step (parallel to prefill)
    decode: list[Sequence] = field(default_factory=list)  # one decode row (or speculative step) each

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class KVOwner(Protocol):
    """What the scheduler asks of the owner of KV memory (the executor). Who calls this: ``schedule``."""

    def tokens_to_prefill(self, seq: Sequence) -> int:
        """What its prefill still has to feed (an estimate before it begins: a shared prefix may cut it)."""

    def is_resident(self, seq: Sequence) -> bool:
        """Is its session's KV on the device (a follow-up)?"""

    def can_admit(self, seqs: list[Sequence]) -> bool:
        """Could these turns, none begun, all take their KV room now?"""


class Unlimited:
    """A KV owner with room for everything, one token to prefill each (tests of the queues alone)."""

    def tokens_to_prefill(self, seq: Sequence) -> int:
        return 1

    def is_resident(self, seq: Sequence) -> bool:
        return False

    def can_admit(self, seqs: list[Sequence]) -> bool:
        return True


class Scheduler:
    def __init__(self, *, max_batch_size: int, token_budget: int = 1 << 30, kv: KVOwner | None = None,
                 max_passed_over: int = 4):
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.kv = kv or Unlimited()
        self.max_passed_over = max_passed_over
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.active: dict[str, Sequence] = {}  # session_id -> its one sequence in flight
        self.pending: dict[str, deque] = {}  # session_id -> requests queued behind it, arrival order
        self._plan: StepPlan | None = None  # the step under way
        self._arrivals = 0
        self.num_steps = 0
        self.max_batch_seen = 0
        self.num_prefill_chunks = 0  # chunks planned (a prompt in one step is one chunk)
        self.num_passed_over = 0  # times a waiting prompt was passed over by a later arrival
        self.num_waited_for_room = 0  # steps a prompt did not begin because the KV owner had no room

    # ------------------------------------------------------------------ admission

    def is_busy(self, session_id: str) -> bool:
        return session_id in self.active

    def add(self, seq: Sequence) -> None:
        """Admit a generation whose session has no request in flight (else use ``enqueue``)."""
        session_id = seq.session.session_id
        assert session_id not in self.active, f"session {session_id} already has a request in flight"
        self.active[session_id] = seq
        seq.session.busy = True
        self._arrivals += 1
        seq.arrival = self._arrivals
        self.waiting.append(seq)

    def enqueue(self, session_id: str, item: Any) -> None:
        """Queue a request (generation, close, export) behind the session's request in flight."""
        self.pending.setdefault(session_id, deque()).append(item)

    def num_waiting(self) -> int:
        """Requests admitted but not yet prefilled, counting those queued behind their session."""
        return len(self.waiting) + len(self.prefilling) + sum(len(q) for q in self.pending.values())

    # ------------------------------------------------------------------ steps

    def schedule(self) -> StepPlan:
        """The next step's plan: the first ``max_batch_size`` running rows, and prefill chunks in the
        order described above until the rest of the token budget is spent."""
        assert self._plan is None, "complete() the previous plan first"
        plan = StepPlan()
        for _ in range(min(self.max_batch_size, len(self.running))):
            plan.decode.append(self.running.popleft())
        budget = max(self.token_budget - len(plan.decode), self.token_budget // 4, 1)
        candidates = sorted([*self.prefilling, *self.waiting], key=self._priority)
        begun = {id(s) for s in self.prefilling}
        beginning: list[Sequence] = []  # turns this plan begins: their room is asked for together
        short_of_room = False  # a turn waits for room: no later arrival begins before it
        answering = False  # the step feeds a resident follow-up: only urgent prompts join it
        for seq in candidates:
            if budget <= 0 or (answering and not self._urgent(seq)):
                break  # a step that answers a follow-up stays short: its first token comes sooner
            if id(seq) not in begun:
                if short_of_room:
                    continue
                if not self._room_for([*beginning, seq], plan):
                    self.num_waited_for_room += 1
                    short_of_room = True
                    continue
                beginning.append(seq)
            tokens = min(max(1, self.kv.tokens_to_prefill(seq)), budget)
            answering = answering or self._follow_up(seq)
            plan.prefill.append(seq)
            plan.chunks.append(tokens)
            budget -= tokens
        if plan.prefill:
            planned = {id(s) for s in plan.prefill}
            self.waiting = deque(s for s in self.waiting if id(s) not in planned)
            self.prefilling = deque(s for s in self.prefilling if id(s) not in planned)
            latest = max(s.arrival for s in plan.prefill)
            for seq in [*self.prefilling, *self.waiting]:
                if seq.arrival < latest:  # a later arrival went first
                    seq.passed_over += 1
                    self.num_passed_over += 1
            self.num_prefill_chunks += len(plan.prefill)
        self._plan = plan
        if plan.decode:
            self.num_steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(plan.decode))
        return plan

    def _room_for(self, beginning: list[Sequence], plan: StepPlan) -> bool:
        """May these turns begin? Yes when the KV owner has room for them all, or when nothing else is
        in flight whose end could free room (waiting would never end: the turn begins and fails)."""
        if self.kv.can_admit(beginning):
            return True
        return not (plan.decode or plan.prefill or self.running or self.prefilling)

    def _priority(self, seq: Sequence) -> tuple[bool, int]:
        """Sort key, first goes first: the urgent (``_urgent``), then arrival order."""
        return not self._urgent(seq), seq.arrival

    def _urgent(self, seq: Sequence) -> bool:
        """A follow-up over resident KV that fits one step, or a prompt passed over ``max_passed_over`` times."""
        return seq.passed_over >= self.max_passed_over or self._follow_up(seq)

    def _follow_up(self, seq: Sequence) -> bool:
        return self.kv.is_resident(seq) and self.kv.tokens_to_prefill(seq) <= self.token_budget

    def complete(self, plan: StepPlan, ended: Iterable[Sequence]) -> None:
        """The step is over: sequences that did not end decode on, at the back of the queue; a prefill
        not finished goes back among the prefilling, in arrival order."""
        assert plan is self._plan, "complete() takes the plan schedule() returned"
        gone = {id(s) for s in ended}
        self._plan = None
        unfinished = []
        for seq in plan.decode + plan.prefill:
            if id(seq) in gone or seq.done:
                continue
            if seq.prefilled:
                self.running.append(seq)
            else:
                unfinished.append(seq)
        if unfinished:
            self.prefilling = deque(sorted([*self.prefilling, *unfinished], key=lambda s: s.arrival))

    def release(self, seq: Sequence) -> Any | None:
        """``seq`` ended: its session is free. Returns the next request queued on that session
        (the caller admits it), or None. Who calls this: the engine, right after the final event."""
        session_id = seq.session.session_id
        if self.active.get(session_id) is seq:
            del self.active[session_id]
            seq.session.busy = False
        self._discard(seq)
        return self.next_pending(session_id)

    def next_pending(self, session_id: str) -> Any | None:
        queued = self.pending.get(session_id)
        if not queued:
            self.pending.pop(session_id, None)
            return None
        item = queued.popleft()
        if not queued:
            del self.pending[session_id]
        return item

    def _discard(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.prefilling, self.running):
            try:
                queue.remove(seq)
            except ValueError:
                pass

    # ------------------------------------------------------------------ lookups

    def sequences(self) -> Iterator[Sequence]:
        """Every sequence in flight (waiting, running, or in the step under way)."""
        return iter(list(self.active.values()))

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.active.values() if s.request_id == request_id), None)

    def take_pending(self, request_id: str) -> Any | None:
        """Remove and return a queued (not yet admitted) request by id, or None."""
        for session_id, queued in list(self.pending.items()):
            for item in queued:
                if getattr(item, "request_id", None) == request_id:
                    queued.remove(item)
                    if not queued:
                        del self.pending[session_id]
                    return item
        return None

    def in_flight(self, session_id: str) -> Sequence | None:
        """The session's one sequence in flight, or None."""
        return self.active.get(session_id)

    def take_queued(self, session_id: str) -> list[Any]:
        """Remove and return every request queued behind the session, in arrival order."""
        return list(self.pending.pop(session_id, ()))

    def take_all_queued(self) -> list[Any]:
        """Remove and return every queued request of every session (the engine is stopping)."""
        items = [item for queued in self.pending.values() for item in queued]
        self.pending.clear()
        return items

    # ------------------------------------------------------------------ invariant

    def check(self) -> list[str]:
        """Violations of the scheduler's invariant (none: []). Called by the engine between steps."""
        problems = []
        placed = list(self.waiting) + list(self.prefilling) + list(self.running)
        if self._plan is not None:
            problems.append("a plan is still under way between steps")
        ids = [id(s) for s in placed]
        if len(ids) != len(set(ids)):
            problems.append("a sequence is queued twice")
        active_ids = {id(s) for s in self.active.values()}
        if set(ids) != active_ids:
            problems.append(f"{len(active_ids)} sequences in flight but {len(set(ids))} queued "
                            "(one is lost or ended without release)")
        for session_id, seq in self.active.items():
            if seq.session.session_id != session_id or not seq.session.busy:
                problems.append(f"session {session_id}: in flight but not marked busy")
            if seq.done:
                problems.append(f"request {seq.request_id}: ended but still in flight")
        if any(s.prefilled for s in [*self.waiting, *self.prefilling]) or \
                not all(s.prefilled for s in self.running):
            problems.append("a sequence is queued for a prefill it finished, or decodes before it")
        for session_id in self.pending:
            if session_id not in self.active:
                problems.append(f"session {session_id}: requests queued behind nothing")
        return problems
