"""session/serving/fairness.py: one tenant never holds every slot; waiters are counted."""

from __future__ import annotations

import asyncio

from session.serving.fairness import FairSlots


def test_a_tenant_holds_its_share_and_another_gets_the_slot_left():
    async def scenario():
        slots = FairSlots(total=2, per_key=1)
        order = []
        release_a = asyncio.Event()

        async def use(key: str, name: str, hold_until: asyncio.Event | None = None):
            async with slots.hold(key):
                order.append(name)
                if hold_until is not None:
                    await hold_until.wait()

        first = asyncio.create_task(use("acme", "acme-1", release_a))
        await asyncio.sleep(0)
        second = asyncio.create_task(use("acme", "acme-2"))
        await asyncio.sleep(0)
        assert order == ["acme-1"] and slots.num_waiting == 1  # acme's second waits though a slot is free
        await asyncio.create_task(use("globex", "globex-1"))  # globex takes the slot acme may not
        assert order == ["acme-1", "globex-1"]
        release_a.set()
        await asyncio.gather(first, second)
        assert order == ["acme-1", "globex-1", "acme-2"] and slots.num_waiting == 0
        assert slots._own == {} and not slots._wanting  # nothing kept for tenants that left

    asyncio.run(scenario())


def test_a_cancelled_waiter_is_no_longer_counted():
    async def scenario():
        slots = FairSlots(total=1, per_key=1)
        hold = asyncio.Event()

        async def use(key: str):
            async with slots.hold(key):
                await hold.wait()

        holder = asyncio.create_task(use("a"))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(use("b"))
        await asyncio.sleep(0)
        assert slots.num_waiting == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert slots.num_waiting == 0
        hold.set()
        await holder

    asyncio.run(scenario())
