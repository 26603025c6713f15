"""session/front/locator.py: shared fan-outs, fresh listings for the retry, excluded and failing backends."""

from __future__ import annotations

import asyncio

import pytest

from session.errors import BackendError
from session.front.backend_client import SessionInfo
from session.front.locator import SessionLocator
from session.front.router import Backend

pytestmark = pytest.mark.asyncio


class FakeAdmin:
    """``list_sessions`` answers from ``held`` (backend index -> session ids); counts calls."""

    def __init__(self, held: dict[int, list[str]], delay_s: float = 0.0):
        self.held = held
        self.delay_s = delay_s
        self.num_lists = 0
        self.failing: set[int] = set()

    async def list_sessions(self, backend: Backend) -> list[SessionInfo]:
        self.num_lists += 1
        await asyncio.sleep(self.delay_s)
        if backend.index in self.failing:
            raise BackendError("down")
        return [SessionInfo(sid, False, 1, 100.0 + backend.index) for sid in self.held.get(backend.index, [])]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


BACKENDS = [Backend(i, f"http://b{i}") for i in range(3)]


def locator(admin: FakeAdmin, clock: Clock) -> SessionLocator:
    return SessionLocator(admin, lambda: BACKENDS, max_age_s=0.2, retry_s=0.0, clock=clock)


async def test_finds_the_backend_and_its_expiry():
    admin, clock = FakeAdmin({1: ["s1"], 2: ["s2", "s3"]}), Clock()
    find = locator(admin, clock).find
    assert await find("s3") == (BACKENDS[2], 102.0)
    assert await find("s1") == (BACKENDS[1], 101.0)
    assert admin.num_lists == 3  # one fan-out served both look-ups


async def test_concurrent_look_ups_share_one_fan_out():
    admin, clock = FakeAdmin({0: ["a"], 1: ["b"]}, delay_s=0.05), Clock()
    located = locator(admin, clock)
    found = await asyncio.gather(*(located.find(sid) for sid in ["a", "b", "a", "b", "a"]))
    assert [f[0].index for f in found] == [0, 1, 0, 1, 0]
    assert (admin.num_lists, located.num_fan_outs, located.num_lookups) == (3, 1, 5)


async def test_a_listing_older_than_max_age_is_taken_again():
    admin, clock = FakeAdmin({0: ["a"]}), Clock()
    located = locator(admin, clock)
    await located.find("a")
    clock.now += 0.3
    admin.held = {2: ["a"]}  # moved meanwhile
    assert (await located.find("a"))[0] is BACKENDS[2]
    assert located.num_fan_outs == 2


async def test_not_found_is_looked_for_again_in_a_fresh_listing():
    admin, clock = FakeAdmin({0: ["a"]}), Clock()
    located = locator(admin, clock)
    await located.find("a")  # a cached listing that does not know "b"
    admin.held = {1: ["b"]}
    assert (await located.find("b"))[0] is BACKENDS[1]
    assert await located.find("nowhere") is None
    assert located.num_fan_outs == 1 + 1 + 1  # first, b's retry, nowhere's retry (its first used b's)


async def test_excluded_and_failing_backends():
    admin, clock = FakeAdmin({0: ["a"], 1: ["c"]}), Clock()
    admin.failing = {1}
    located = locator(admin, clock)
    assert await located.find("a", exclude=(BACKENDS[0],)) is None  # the one that just said 404
    assert await located.find("c") is None  # its backend could not list
    admin.failing = set()
    clock.now += 1.0
    assert (await located.find("c"))[0] is BACKENDS[1]
