"""The scheduler on its own: plain Python, fake sessions, exact counts."""

from __future__ import annotations

import random

import pytest

from session.engine.requests import Sequence
from session.engine.scheduler import Scheduler
from session.families.vision import NO_IMAGES


class FakeSession:
    def __init__(self, session_id: str):
        self.session_id = session_id
        self.busy = False


def seq(session_id: str, request_id: str | None = None) -> Sequence:
    from types import SimpleNamespace

    request = SimpleNamespace(request_id=request_id or f"r-{session_id}", images=NO_IMAGES)
    return Sequence(request=request, session=FakeSession(session_id))


def test_one_request_in_flight_per_session_and_the_rest_queue_in_order():
    scheduler = Scheduler(max_batch_size=4)
    first = seq("a")
    scheduler.add(first)
    assert scheduler.is_busy("a") and first.session.busy
    scheduler.enqueue("a", "second")
    scheduler.enqueue("a", "third")
    assert scheduler.num_waiting() == 3
    first.done = True
    assert scheduler.release(first) == "second"
    assert not first.session.busy and not scheduler.is_busy("a")
    assert scheduler.next_pending("a") == "third" and scheduler.next_pending("a") is None
    assert scheduler.check() == []


def test_one_prefill_per_step_then_decode_rows_rotate():
    scheduler = Scheduler(max_batch_size=2)
    seqs = [seq(f"s{i}") for i in range(5)]
    for s in seqs:
        scheduler.add(s)
    for step in range(5):  # each step prefills one
        plan = scheduler.schedule()
        assert plan.prefill == [seqs[step]] and len(plan.decode) == min(2, step)
        scheduler.complete(plan, [])
    # Rows that decoded go to the back; a newly prefilled one joins behind them.
    assert list(scheduler.running) == [seqs[1], seqs[3], seqs[2], seqs[0], seqs[4]]


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_every_running_request_advances_and_none_is_lost_when_rows_finish_mid_batch(batch):
    """The state the old engine lost requests in: more running than one step takes, some finishing."""
    rng = random.Random(batch)
    scheduler = Scheduler(max_batch_size=batch)
    remaining = {}
    for i in range(3 * batch + 2):
        s = seq(f"s{i}")
        scheduler.add(s)
        remaining[s] = rng.randint(1, 12)  # decode steps it needs
    advanced = {s: 0 for s in remaining}
    waited = {s: 0 for s in remaining}  # steps since it last decoded (or joined `running`)
    for _ in range(1000):
        if not scheduler.active:
            break
        plan = scheduler.schedule()
        ended = []
        for s in plan.decode:
            advanced[s] += 1
            waited[s] = 0
            if advanced[s] == remaining[s]:
                s.done = True
                ended.append(s)
        for s in scheduler.running:
            waited[s] += 1
        scheduler.complete(plan, ended)
        for s in ended:
            scheduler.release(s)
        assert scheduler.check() == []
        # Fairness: with R running and batch B, every running request decodes every ceil(R / B) steps.
        bound = -(-len(scheduler.running) // batch)
        assert all(waited[s] <= bound for s in scheduler.running), (bound, [waited[s] for s in scheduler.running])
    assert not scheduler.active and all(advanced[s] == remaining[s] for s in remaining)


def test_find_and_take_pending_by_request_id():
    scheduler = Scheduler(max_batch_size=2)
    running = seq("a", "r1")
    scheduler.add(running)
    from types import SimpleNamespace

    queued = SimpleNamespace(request_id="r2", session_id="a")
    scheduler.enqueue("a", queued)
    assert scheduler.find("r1") is running and scheduler.find("r2") is None
    assert scheduler.take_pending("r2") is queued and scheduler.take_pending("r2") is None
    assert scheduler.pending == {}


def test_check_reports_a_lost_sequence_and_a_stale_busy_flag():
    scheduler = Scheduler(max_batch_size=2)
    s = seq("a")
    scheduler.add(s)
    scheduler.waiting.clear()  # lost: in flight but queued nowhere
    s.session.busy = False
    problems = scheduler.check()
    assert problems == ["1 sequences in flight but 0 queued (one is lost or ended without release)",
                        "session a: in flight but not marked busy"]
