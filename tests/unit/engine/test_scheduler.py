"""The scheduler on its own: plain Python, fake sessions, exact counts."""

from __future__ import annotations

import random
from collections import deque

import pytest

from session.engine.requests import Sequence
from session.engine.scheduler import Scheduler
from session.families.vision import NO_IMAGES
from session.state.session import TurnMark


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


class Model:
    """The executor's part, faked: each sequence has tokens left to prefill, fed as the plan says;
    the chunk that feeds its last token commits the turn (``prefilled``). As the KV owner it has
    ``room`` blocks (None: unlimited); a turn takes ``blocks[seq]`` when it begins."""

    def __init__(self, room: int | None = None):
        self.left: dict[int, int] = {}
        self.resident: set[int] = set()
        self.room = room
        self.blocks: dict[int, int] = {}
        self.asked: list[list[str]] = []
        self.holding: set[int] = set()

    def end(self, scheduler: Scheduler, s: Sequence) -> None:
        """The request ended: its room is free again."""
        s.done = True
        scheduler.release(s)
        if self.room is not None and id(s) in self.holding:
            self.holding.discard(id(s))
            self.room += self.blocks.get(id(s), 0)

    def tokens_to_prefill(self, s: Sequence) -> int:
        return self.left[id(s)]

    def is_resident(self, s: Sequence) -> bool:
        return id(s) in self.resident

    def can_admit(self, seqs: list[Sequence]) -> bool:
        self.asked.append([s.session.session_id for s in seqs])
        return self.room is None or sum(self.blocks.get(id(s), 0) for s in seqs) <= self.room

    def need(self, s: Sequence, tokens: int, resident: bool = False) -> Sequence:
        self.left[id(s)] = tokens
        if resident:
            self.resident.add(id(s))
        return s

    def scheduler(self, **settings) -> Scheduler:
        return Scheduler(kv=self, **settings)

    def run(self, scheduler: Scheduler, plan, ended=()) -> None:
        for s, tokens in zip(plan.prefill, plan.chunks):
            assert 0 < tokens <= self.left[id(s)]
            if self.room is not None and id(s) not in self.holding:  # the turn begins: it takes its room
                self.holding.add(id(s))
                self.room -= self.blocks.get(id(s), 0)
            self.left[id(s)] -= tokens
            if not self.left[id(s)]:
                s.turn.mark = TurnMark(num_tokens=0, num_images=0, num_turns=0, ended_with_eos=False, rope_delta=0)
        scheduler.complete(plan, ended)


def test_short_prompts_share_a_step_and_a_long_one_is_fed_in_chunks_while_the_others_decode():
    model = Model()
    scheduler = model.scheduler(max_batch_size=4, token_budget=10)
    seqs = [model.need(seq(f"s{i}"), 3) for i in range(4)] + [model.need(seq("long"), 20)]
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule()  # 3 + 3 + 3 + 1 of the fourth
    assert plan.prefill == seqs[:4] and plan.chunks == [3, 3, 3, 1] and plan.decode == []
    model.run(scheduler, plan)
    assert list(scheduler.running) == seqs[:3] and list(scheduler.prefilling) == [seqs[3]]
    assert scheduler.num_waiting() == 2
    plan = scheduler.schedule()  # 3 rows decode; 7 tokens left: the fourth's last 2, then the long one's first 5
    assert plan.decode == seqs[:3] and plan.prefill == [seqs[3], seqs[4]] and plan.chunks == [2, 5]
    model.run(scheduler, plan)
    for _ in range(2):  # 4 rows decode, 6 tokens of the long prompt each step
        plan = scheduler.schedule()
        assert len(plan.decode) == 4 and plan.prefill == [seqs[4]] and plan.chunks == [6]
        model.run(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.prefill == [seqs[4]] and plan.chunks == [3] and len(plan.decode) == 4
    model.run(scheduler, plan)
    assert scheduler.prefilling == deque() and len(scheduler.running) == 5 and scheduler.check() == []
    assert scheduler.num_prefill_chunks == 4 + 2 + 1 + 1 + 1


def test_a_prompt_with_no_room_waits_first_in_line_then_runs_when_a_request_ends():
    model = Model(room=4)
    scheduler = model.scheduler(max_batch_size=4, token_budget=100)
    a, b, c = (model.need(seq(name), 2) for name in "abc")
    model.blocks.update({id(a): 3, id(b): 3, id(c): 1})
    for s in (a, b, c):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert plan.prefill == [a] and model.asked == [["a"], ["a", "b"]]  # c, a later arrival, is not asked
    assert scheduler.num_waited_for_room == 1
    model.run(scheduler, plan)
    plan = scheduler.schedule()  # a decodes, b still finds 1 block free: it waits, and c behind it
    assert plan.decode == [a] and plan.prefill == [] and model.asked[-1] == ["b"]
    model.run(scheduler, plan)
    model.end(scheduler, a)
    plan = scheduler.schedule()  # a's 3 blocks are back: b and c (3 + 1) begin in one step
    assert plan.prefill == [b, c] and model.asked[-2:] == [["b"], ["b", "c"]]
    model.run(scheduler, plan)
    assert scheduler.num_waited_for_room == 2 and scheduler.check() == [] and model.room == 0


def test_a_prompt_with_no_room_and_nothing_in_flight_begins_and_its_owner_refuses_it():
    model = Model(room=2)
    scheduler = model.scheduler(max_batch_size=4, token_budget=100)
    big = model.need(seq("big"), 2)
    model.blocks[id(big)] = 5
    scheduler.add(big)
    plan = scheduler.schedule()  # waiting would never end: it begins (and the KV owner says why it fails)
    assert plan.prefill == [big] and model.asked == [["big"]] and scheduler.num_waited_for_room == 0


def test_a_prompt_already_begun_continues_whatever_the_room():
    model = Model(room=3)
    scheduler = model.scheduler(max_batch_size=4, token_budget=8)
    long, short = model.need(seq("long"), 10), model.need(seq("short"), 1)
    model.blocks.update({id(long): 3, id(short): 1})
    scheduler.add(long)
    model.run(scheduler, scheduler.schedule())  # long begins: 8 of 10, all the room taken
    scheduler.add(short)
    plan = scheduler.schedule()
    assert plan.prefill == [long] and plan.chunks == [2] and model.asked[-1] == ["short"]
    assert scheduler.num_waited_for_room == 1


def test_prompts_get_a_quarter_of_the_budget_however_many_rows_decode():
    model = Model()
    scheduler = model.scheduler(max_batch_size=64, token_budget=16)
    rows = [model.need(seq(f"r{i}"), 1) for i in range(40)]
    for s in rows:
        scheduler.add(s)
    for _ in range(10):  # the budget's quarter (4 tokens) is for prompts, however many rows decode
        model.run(scheduler, scheduler.schedule())
    assert len(scheduler.running) == 40
    prompt = model.need(seq("prompt"), 10)
    scheduler.add(prompt)
    plan = scheduler.schedule()
    assert len(plan.decode) == 40 and plan.prefill == [prompt] and plan.chunks == [4]
    assert scheduler.max_batch_seen == 40  # no cap of 16 rows


def test_a_resident_follow_up_goes_first_and_a_cold_prompt_waits_at_most_max_passed_over_steps():
    model = Model()
    scheduler = model.scheduler(max_batch_size=8, token_budget=8, max_passed_over=2)
    cold = model.need(seq("cold"), 30)
    scheduler.add(cold)
    plan = scheduler.schedule()
    assert plan.prefill == [cold] and plan.chunks == [8]
    model.run(scheduler, plan)
    served = []
    for step in range(4):  # a follow-up of 8 tokens (the whole budget) arrives before every step
        follow_up = model.need(seq(f"f{step}"), 8, resident=True)
        scheduler.add(follow_up)
        plan = scheduler.schedule()
        served.append([s.session.session_id for s in plan.prefill])
        model.run(scheduler, plan)
    # Two steps the follow-ups jump the cold prompt; then it goes first (the third and fourth steps),
    # the follow-ups waiting behind it get what it leaves.
    assert served == [["f0"], ["f1"], ["cold"], ["cold"]]
    assert cold.passed_over == 2 and scheduler.num_passed_over == 2


def test_a_follow_up_longer_than_the_budget_is_served_in_arrival_order():
    model = Model()
    scheduler = model.scheduler(max_batch_size=8, token_budget=8)
    cold = model.need(seq("cold"), 4)
    big = model.need(seq("big"), 9, resident=True)  # a pasted document: not short, so no priority
    small = model.need(seq("small"), 2, resident=True)
    for s in (cold, big, small):
        scheduler.add(s)
    plan = scheduler.schedule()  # the short follow-up alone: its step stays short
    assert plan.prefill == [small] and plan.chunks == [2]
    model.run(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.prefill == [cold, big] and plan.chunks == [4, 3]  # small decodes: 7 tokens left
    assert big.passed_over == 1 and cold.passed_over == 1  # a later arrival went first, once


def test_a_step_that_answers_a_follow_up_carries_no_cold_chunk_until_the_cold_prompt_is_urgent():
    """Cold chunks beside a follow-up would make its first token wait for them (one pass per step): the
    follow-up's step feeds it and the decode rows only, until the cold prompt has been passed over
    ``max_passed_over`` times; from then on the cold prompt goes first and shares every step."""
    model = Model()
    scheduler = model.scheduler(max_batch_size=8, token_budget=16, max_passed_over=2)
    cold = model.need(seq("cold"), 100)
    scheduler.add(cold)
    model.run(scheduler, scheduler.schedule())  # its first 16 tokens
    plans = []
    for step in range(4):
        scheduler.add(model.need(seq(f"f{step}"), 3, resident=True))
        plan = scheduler.schedule()
        plans.append(list(zip([s.session.session_id for s in plan.prefill], plan.chunks)))
        model.run(scheduler, plan)
    assert plans == [[("f0", 3)], [("f1", 3)], [("cold", 14)], [("cold", 14)]]  # 2 rows decode
    plan = scheduler.schedule()  # f2 and f3 waited behind the urgent cold prompt
    assert [s.session.session_id for s in plan.prefill][:1] == ["cold"]


def decode_rows(plan, decodes: dict[int, int]) -> list[Sequence]:
    """One token for each decode row of the plan; the rows whose last token that was (ended)."""
    ended = []
    for s in plan.decode:
        decodes[id(s)] -= 1
        if not decodes[id(s)]:
            s.done = True
            ended.append(s)
    return ended


def test_random_arrivals_cancels_and_residency_keep_the_budget_order_and_invariant():
    rng = random.Random(7)
    for _ in range(30):
        model = Model()
        budget = rng.choice([1, 3, 8, 32])
        limit = rng.choice([1, 3])
        scheduler = model.scheduler(max_batch_size=rng.choice([1, 2, 5]), token_budget=budget, max_passed_over=limit)
        decodes: dict[int, int] = {}
        count = 0
        for _ in range(200):
            for _ in range(rng.choice([0, 0, 1, 2])):
                count += 1
                s = model.need(seq(f"s{count}"), rng.randint(1, 3 * budget), resident=rng.random() < 0.5)
                decodes[id(s)] = rng.randint(1, 4)
                scheduler.add(s)
            candidates = sorted([*scheduler.prefilling, *scheduler.waiting], key=scheduler._priority)
            plan = scheduler.schedule()
            # the most urgent first, in order, within the budget (a quarter of it kept for prompts)
            assert plan.prefill == candidates[:len(plan.prefill)]
            assert sum(plan.chunks) <= max(budget - len(plan.decode), budget // 4, 1)
            assert all(s.passed_over <= limit for s in candidates)  # then it goes first: never passed again
            ended = decode_rows(plan, decodes)
            for s, tokens in zip(plan.prefill, plan.chunks):
                if rng.random() < 0.1:  # cancelled between two chunks (or before its first)
                    s.done = True
                    ended.append(s)
                    continue
                model.left[id(s)] -= tokens
                if not model.left[id(s)]:
                    s.turn.mark = TurnMark(num_tokens=0, num_images=0, num_turns=0, ended_with_eos=False,
                                           rope_delta=0)
            if scheduler.waiting and rng.random() < 0.05:  # cancelled while waiting
                victim = rng.choice(list(scheduler.waiting))
                victim.done = True
                scheduler.release(victim)
            scheduler.complete(plan, ended)
            for s in ended:
                scheduler.release(s)
            assert scheduler.check() == []
        for _ in range(10_000):  # no new arrivals: everything ends
            if not scheduler.active:
                break
            plan = scheduler.schedule()
            ended = decode_rows(plan, decodes)
            model.run(scheduler, plan, ended)
            for s in ended:
                scheduler.release(s)
        assert not scheduler.active and scheduler.check() == []


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_every_running_request_advances_and_none_is_lost_when_rows_finish_mid_batch(batch):
    """The state the old engine lost requests in: more running than one step takes, some finishing."""
    rng = random.Random(batch)
    model = Model()
    scheduler = model.scheduler(max_batch_size=batch, token_budget=1)  # one prompt of 1 token joins per step
    remaining = {}
    for i in range(3 * batch + 2):
        s = model.need(seq(f"s{i}"), 1)
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
        model.run(scheduler, plan, ended)
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
