"""session/front/server.py with session-aware fake backends (tests/fake_backend.py): routes that survive any
front, look-ups, drain and migrate, request ids and cancels."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from session.front.config import FrontConfig
from session.front.server import Front
from session.serving.protocol import (
    ADMIN_TOKEN_HEADER,
    CANCEL_HEADER,
    NEW_SESSION_HEADER,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
)
from tests.fake_backend import TOKEN, SessionBackend

pytestmark = pytest.mark.asyncio


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}


@contextlib.asynccontextmanager
async def fronts(backends: list[SessionBackend], num_fronts: int = 1, **settings):
    """``num_fronts`` independent fronts over the same backends, each probed once, with an HTTP client each."""
    settings.setdefault("admin_token", TOKEN)
    config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), health_interval_s=3600.0,
                                  **settings)
    started: list[tuple[Front, aiohttp.ClientSession]] = []
    try:
        for _ in range(num_fronts):
            front = Front(config)
            await front.start("127.0.0.1", 0)
            await front.check_health()
            started.append((front, aiohttp.ClientSession(base_url=f"http://127.0.0.1:{front.port}")))
        yield started
    finally:
        for front, client in started:
            await client.close()
            await front.stop()


@contextlib.asynccontextmanager
async def fake_backends(num: int, **kwargs):
    backends = [await SessionBackend(i, **kwargs).start() for i in range(num)]
    try:
        yield backends
    finally:
        for backend in backends:
            backend.release.set()
            await backend.stop()


async def open_session(client: aiohttp.ClientSession) -> tuple[str, str]:
    """(session id, the answering backend's index)."""
    async with client.post("/invocations", json=chat("hi"), headers={SESSION_HEADER: "NEW_SESSION"}) as response:
        assert response.status == 200, await response.text()
        return response.headers[NEW_SESSION_HEADER].split(";")[0], response.headers["X-Resident-Backend"]


async def follow(client: aiohttp.ClientSession, session_id: str, text: str = "more") -> tuple[int, str, str]:
    """(status, answer text or error type, backend index)."""
    async with client.post("/invocations", json=chat(text), headers={SESSION_HEADER: session_id}) as response:
        body = await response.json()
        content = body["choices"][0]["message"]["content"] if response.status == 200 else body["error"]["type"]
        return response.status, content, response.headers.get("X-Resident-Backend", "-")


# ------------------------------------------------------------ routes that survive any front


async def test_a_restarted_front_and_a_second_front_route_every_session_by_its_id():
    async with fake_backends(3) as backends:
        async with fronts(backends) as [(_, client)]:
            opened = [await open_session(client) for _ in range(6)]
        assert sorted(b for _, b in opened) == ["0", "0", "1", "1", "2", "2"]
        assert all(sid.endswith(f"-b{b}") for sid, b in opened)
        async with fronts(backends, num_fronts=2) as [(a, client_a), (b, client_b)]:  # a restart, and a replica
            for turn in (2, 3):
                for i, (sid, backend) in enumerate(opened):
                    client = (client_a, client_b)[(i + turn) % 2]  # interleaved between the two fronts
                    assert await follow(client, sid) == (200, f"backend {backend} turn {turn}", backend)
            assert a.router.pins == {} and b.router.pins == {}  # no table: the ids said where
            assert [len(x.cancels) for x in backends] == [0, 0, 0]
            assert sum(len(x.requests) for x in backends) == 6 + 12


async def test_an_untagged_session_is_found_by_asking_the_backends():
    async with fake_backends(2, tag="") as backends:
        async with fronts(backends) as [(_, client)]:
            await open_session(client)
            sid, backend = await open_session(client)
        assert backend == "1" and len(sid) == 36  # a plain uuid4
        async with fronts(backends) as [(front, client)]:
            assert await follow(client, sid) == (200, "backend 1 turn 2", "1")
            assert front.router.pins[sid].backend.index == 1  # learnt: the next one goes straight there
            assert await follow(client, sid) == (200, "backend 1 turn 3", "1")
            assert await follow(client, "5f0c1d2e-0000-4000-8000-00000000dead") == (404, "session_not_found", "-")
        async with fronts(backends, admin_token="") as [(front, client)]:  # no token: no look-up
            assert await follow(client, sid) == (404, "session_not_found", "-")


# ------------------------------------------------------------ drain and migrate


async def test_drain_moves_every_session_and_any_front_follows_them():
    async with fake_backends(3) as backends:
        async with fronts(backends, num_fronts=2) as [(_, client_a), (b, client_b)]:
            opened = [await open_session(client_a) for _ in range(6)]
            on_0 = [sid for sid, backend in opened if backend == "0"]
            denied = await client_a.post("/backends/0/drain")
            assert (denied.status, (await denied.json())["error"]["type"]) == (403, "forbidden")
            drained = await client_a.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})
            report = await drained.json()
            assert drained.status == 200, report
            assert (report["moved"], report["failed"], report["remaining"]) == (2, {}, 0)
            assert sorted(s["session_id"] for s in report["sessions"]) == sorted(on_0)
            assert sorted(s["to"] for s in report["sessions"]) == [1, 2]  # spread over the others
            assert all(s["num_tokens"] == 10 and s["num_images"] == 1 for s in report["sessions"])
            assert report["per_session_ms"]["mean"] > 0
            assert backends[0].sessions == {}
            targets = {s["session_id"]: str(s["to"]) for s in report["sessions"]}
            for sid, backend in opened:
                now = targets.get(sid, backend)
                assert await follow(client_a, sid) == (200, f"backend {now} turn 2", now)
                assert await follow(client_b, sid) == (200, f"backend {now} turn 3", now)  # b never saw the drain
            assert {p for p in b.router.pins} == set(on_0)  # b learnt the two moved ones by asking
            assert [await open_session(client_a) for _ in range(2)] != []
            assert backends[0].requests[-1]["session"] != "NEW_SESSION"  # no new session on the drained one
            assert (await client_a.get("/backends")).status == 403  # internal URLs: the admin token's
            described = await (await client_a.get("/backends", headers={ADMIN_TOKEN_HEADER: TOKEN})).json()
            assert [x["draining"] for x in described["backends"]] == [True, False, False]
            resumed = await client_a.post("/backends/0/resume", headers={ADMIN_TOKEN_HEADER: TOKEN})
            assert await resumed.json() == {"backend": 0, "draining": False}
            assert (await open_session(client_a))[1] == "0"
            missing = await client_a.post("/backends/7/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})
            assert missing.status == 404


async def test_a_drain_that_fails_says_the_backend_stays_drained():
    """A backend down before the health checks saw it: its sessions cannot be listed, so the drain fails
    (502), but the backend was already out of the choice for new sessions. The error says so, and how to
    undo it (it said neither, and the backend went on taking no new sessions)."""
    async with fake_backends(2) as backends:
        async with fronts(backends) as [(_, client)]:
            await backends[0].stop()
            failed = await client.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})
            error = (await failed.json())["error"]
            assert (failed.status, error["type"]) == (502, "backend_error")
            assert error["message"].startswith("backend 0 did not answer an admin request: ")
            assert error["message"].endswith("; backend 0 stays drained (it takes no new sessions): "
                                             "POST /backends/0/resume to undo")
            described = await (await client.get("/backends", headers={ADMIN_TOKEN_HEADER: TOKEN})).json()
            assert [x["draining"] for x in described["backends"]] == [True, False]


async def test_a_session_no_other_backend_takes_stays_on_its_source():
    async with fake_backends(2) as backends:
        async with fronts(backends) as [(_, client)]:
            sid, _ = await open_session(client)
            backends[1].refuse_imports = True
            report = await (await client.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})).json()
            assert (report["moved"], report["remaining"]) == (0, 1)
            assert report["failed"] == {sid: "no other backend took it; it stays on the source"}
            assert list(backends[0].sessions) == [sid]
            assert await follow(client, sid) == (200, "backend 0 turn 2", "0")


async def test_a_drain_whose_imports_all_fail_leaves_the_session_serving_on_its_source():
    """Two-phase: the source kept the session while it was exported, so when no backend imports it (the
    source would not take it back either) the source is told to resume it, and nothing is lost."""
    async with fake_backends(2) as backends:
        async with fronts(backends) as [(_, client)]:
            sid, _ = await open_session(client)
            backends[0].refuse_imports = backends[1].refuse_imports = True
            report = await (await client.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})).json()
            assert (report["moved"], report["remaining"]) == (0, 1)
            assert report["failed"] == {sid: "no other backend took it; it stays on the source"}
            assert backends[0].admin_calls == ["list", "export", "resume", "list"]  # never imported back
            assert backends[1].admin_calls == ["import"]
            assert list(backends[0].sessions) == [sid] and backends[0].moving == {}
            assert await follow(client, sid) == (200, "backend 0 turn 2", "0")


async def test_a_confirm_the_source_refuses_takes_the_imported_copy_back():
    """The source's move timed out (it serves the session again) before the front confirmed: the copy
    imported on the target is removed, and the session stays where it serves."""
    async with fake_backends(2) as backends:
        async with fronts(backends) as [(front, client)]:
            sid, _ = await open_session(client)
            original = front.admin.import_session

            async def import_then_time_out(backend, exported):
                await original(backend, exported)
                backends[0].moving.pop(sid).set()  # what the source's move timeout does

            front.admin.import_session = import_then_time_out
            report = await (await client.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})).json()
            assert report["moved"] == 0 and "the source kept it" in report["failed"][sid]
            assert backends[1].admin_calls == ["import", "export", "forget"] and backends[1].sessions == {}
            assert all(pin.backend.index == 0 for pin in front.router.pins.values())
            assert await follow(client, sid) == (200, "backend 0 turn 2", "0")


async def test_a_request_during_the_move_waits_for_it():
    async with fake_backends(2) as backends:
        async with fronts(backends) as [(front, client)]:
            sid, _ = await open_session(client)
            original = front.admin.import_session

            async def slow_import(backend, exported):
                await asyncio.sleep(0.3)
                await original(backend, exported)

            front.admin.import_session = slow_import
            drain = asyncio.ensure_future(client.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN}))
            await asyncio.sleep(0.1)  # exported, not yet imported: the source keeps it, moving
            assert sid in backends[0].moving and sid not in backends[1].sessions
            assert await follow(client, sid) == (200, "backend 1 turn 2", "1")
            assert (await (await drain).json())["moved"] == 1
            assert [c for c in backends[0].admin_calls if c != "list"] == ["export", "forget"]  # once imported
            assert sid not in backends[0].sessions and backends[0].moving == {}


async def test_a_drain_whose_client_leaves_still_finishes():
    async with fake_backends(2) as backends:
        async with fronts(backends) as [(front, client)]:
            sid, _ = await open_session(client)
            original = front.admin.import_session

            async def slow_import(backend, exported):
                await asyncio.sleep(0.5)
                await original(backend, exported)

            front.admin.import_session = slow_import
            with pytest.raises(asyncio.TimeoutError):
                await client.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN},
                                  timeout=aiohttp.ClientTimeout(total=0.2))  # gone while the session is in transit
            await wait_for(lambda: sid in backends[1].sessions)
            assert await follow(client, sid) == (200, "backend 1 turn 2", "1")


async def test_a_session_whose_home_is_down_is_found_where_it_moved_else_410():
    async with fake_backends(2) as backends:
        async with fronts(backends, num_fronts=2) as [(_, client_a), (b, client_b)]:
            moved, _ = await open_session(client_a)
            stranded, _ = await open_session(client_a)  # on backend 1
            await client_a.post("/backends/0/drain", headers={ADMIN_TOKEN_HEADER: TOKEN})
            assert moved.endswith("-b0") and moved in backends[1].sessions
            await backends[0].stop()  # drained, then stopped: b still routes "-b0" there first
            assert await follow(client_b, moved) == (200, "backend 1 turn 2", "1")
            assert not b.router.backends[0].healthy  # refused at once
            await backends[1].stop()
            await b.check_health()
            for _ in range(3):
                await b.check_health()
            assert await follow(client_b, stranded) == (410, "session_backend_unavailable", "-")
            backends[:] = []  # stopped already


# ------------------------------------------------------------ logs


async def test_the_front_never_logs_a_session_id_in_full(caplog):
    caplog.set_level("INFO")
    async with fake_backends(2) as backends:
        async with fronts(backends, num_fronts=2) as [(_, client_a), (_, client_b)]:
            sid, _ = await open_session(client_a)
            assert (await follow(client_b, sid))[0] == 200  # b routes it by its tag
            async with client_a.post("/invocations", json={"requestType": "CLOSE"},
                                     headers={SESSION_HEADER: sid}) as closed:
                assert closed.status == 200
    access = [r for r in caplog.records if r.name == "resident.front.access"]
    assert len(access) == 3 and f"session={sid[:8]}...-b" in caplog.text  # shortened, with its routing tag
    assert sid not in caplog.text


# ------------------------------------------------------------ the admin token


async def test_the_adapter_api_and_the_backends_list_need_the_admin_token():
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(_, client)]:
            for method, path, body in (("GET", "/adapters", None), ("POST", "/adapters", {"name": "x", "src": "/etc"}),
                                       ("DELETE", "/adapters/support", None), ("GET", "/backends", None)):
                for headers in ({}, {ADMIN_TOKEN_HEADER: "wrong"}, {ADMIN_TOKEN_HEADER: "\u00fc"}):
                    response = await client.request(method, path, json=body, headers=headers)
                    assert response.status == 403, (method, path, headers)
                    assert (await response.json())["error"]["type"] == "forbidden"
            assert backends[0].admin_bodies == []  # none of them reached a backend
            listed = await client.get("/adapters", headers={ADMIN_TOKEN_HEADER: TOKEN})
            assert listed.status == 200 and [a["name"] for a in (await listed.json())["adapters"]] == ["support"]
            assert backends[0].admin_bodies == [{"adapters": "list"}]


# ------------------------------------------------------------ request ids and cancels


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


CONTROL = {REQUEST_ID_HEADER: "victim-1", CANCEL_HEADER: "victim-1", ADMIN_TOKEN_HEADER: TOKEN}


async def test_request_ids_are_the_fronts_and_no_control_header_reaches_a_backend():
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(_, client)]:
            answers = [await client.post("/invocations", json=chat(text), headers=CONTROL) for text in ("a", "b")]
            assert [a.status for a in answers] == [200, 200]  # a cancel header is no cancel at the front
            ids = [a.headers[REQUEST_ID_HEADER] for a in answers]
            assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and ids[0] != ids[1]
            assert [r["request_id"] for r in backends[0].requests] == ids  # the client's "victim-1": never
            for sent in (r["headers"] for r in backends[0].requests):
                assert CANCEL_HEADER not in sent and ADMIN_TOKEN_HEADER not in sent
            assert backends[0].cancels == []


async def test_a_client_that_reuses_a_request_id_cannot_cancel_anothers():
    """The attack of issue #28: a second client reuses the victim's id (and its backend's tag) and hangs up."""
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(_, client)]:
            sid, _ = await open_session(client)
            victim = asyncio.ensure_future(client.post("/invocations", json=chat("hold"),
                                                       headers={SESSION_HEADER: sid, REQUEST_ID_HEADER: "v-1"}))
            await wait_for(lambda: len(backends[0].requests) == 2)
            with pytest.raises(asyncio.TimeoutError):
                await client.post("/invocations", json=chat("hold"), headers={REQUEST_ID_HEADER: "v-1"},
                                  timeout=aiohttp.ClientTimeout(total=0.3))
            victim_id, attacker_id = backends[0].requests[1]["request_id"], backends[0].requests[2]["request_id"]
            await wait_for(lambda: backends[0].cancelled == [attacker_id])  # only the attacker's own request
            assert victim_id != attacker_id and not victim.done()
            backends[0].release.set()
            answer = await victim
            assert answer.status == 200 and (await answer.json())["choices"][0]["message"]["content"] == \
                "backend 0 turn 2"


async def test_a_timeout_waits_for_the_cancel_and_says_the_turn_was_rolled_back():
    async with fake_backends(1) as backends:
        async with fronts(backends, timeout_s=0.3) as [(front, client)]:
            response = await client.post("/invocations", json=chat("hold"))
            sent = backends[0].requests[-1]["request_id"]
            assert backends[0].cancelled == [sent] and backends[0].cancels == [sent]  # before the 504
            assert response.status == 504 and response.headers[REQUEST_ID_HEADER] == sent
            error = (await response.json())["error"]
            assert (error["type"], error["may_have_committed"]) == ("backend_timeout", False)
            assert "sending it again is safe" in error["message"]
            assert front.num_cancels_sent == 1


async def test_a_timeout_whose_cancel_fails_says_the_turn_may_have_committed():
    async with fake_backends(1, token="another-secret") as backends:  # the backend refuses the front's cancel
        async with fronts(backends, timeout_s=0.3) as [(_, client)]:
            response = await client.post("/invocations", json=chat("hold"))
            assert response.status == 504 and backends[0].cancels == [] and backends[0].cancelled == []
            error = (await response.json())["error"]
            assert (error["type"], error["may_have_committed"]) == ("backend_timeout", True)
            assert "check the session before sending it again" in error["message"]


async def test_a_client_that_disconnects_cancels_its_request():
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(front, client)]:
            with pytest.raises(asyncio.TimeoutError):
                await client.post("/invocations", json=chat("hold"), timeout=aiohttp.ClientTimeout(total=0.3))
            sent = backends[0].requests[-1]["request_id"]
            await wait_for(lambda: backends[0].cancelled == [sent])
            assert backends[0].cancels == [sent]
            assert front.router.backends[0].num_outstanding == 0


async def test_a_client_that_leaves_a_stream_cancels_it():
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(_, client)]:
            sid, _ = await open_session(client)
            backends[0].release.set()
            backends[0].release = asyncio.Event()
            response = await client.post("/invocations", json=chat("hold", stream=True), headers={SESSION_HEADER: sid})
            assert (await response.content.readany()).startswith(b"data: ")  # the first chunk, then it holds
            sent = response.headers[REQUEST_ID_HEADER]
            response.close()
            await wait_for(lambda: backends[0].cancels == [sent])
            assert backends[0].cancelled == [sent]


async def test_a_finished_answer_sends_no_cancel():
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(front, client)]:
            sid, _ = await open_session(client)
            async with client.post("/invocations", json=chat("x", stream=True), headers={SESSION_HEADER: sid}) as r:
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            await asyncio.sleep(0.1)
            assert backends[0].cancels == [] and front.num_cancels_sent == 0
            assert CANCEL_HEADER not in str(backends[0].requests)


async def test_restart_drains_restarts_and_resumes_the_backend():
    async with fake_backends(2) as backends:
        restarted: list[tuple[int, int]] = []  # (backend index, its sessions when restarted)

        def restart(index: int) -> None:  # stands in for launch/cluster.py's BackendRestarter (a thread)
            restarted.append((index, len(backends[index].sessions)))

        config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), health_interval_s=3600.0,
                                      admin_token=TOKEN)
        front = Front(config, restart_backend=restart)
        await front.start("127.0.0.1", 0)
        await front.check_health()
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{front.port}") as client:
            sid, _ = await open_session(client)
            done = await client.post("/backends/0/restart", headers={ADMIN_TOKEN_HEADER: TOKEN})
            body = await done.json()
            assert done.status == 200, body
            assert (body["backend"], body["drain"]["moved"], body["healthy"]) == (0, 1, True)
            assert restarted == [(0, 0)]  # restarted only once empty
            assert front.router.backends[0].draining is False
            assert await follow(client, sid) == (200, "backend 1 turn 2", "1")
            backends[0].refuse_imports = True
            await open_session(client)  # on backend 0 again (resumed, least busy)
            refused = await client.post("/backends/1/restart", headers={ADMIN_TOKEN_HEADER: TOKEN})
            assert refused.status == 409
            assert (await refused.json())["drain"]["remaining"] == 1
            assert restarted == [(0, 0)]
        await front.stop()
    async with fake_backends(1) as backends:
        async with fronts(backends) as [(front, client)]:
            plain = await client.post("/backends/0/restart", headers={ADMIN_TOKEN_HEADER: TOKEN})
            assert plain.status == 400
            assert "does not own its backends" in (await plain.json())["error"]["message"]
