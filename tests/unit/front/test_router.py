"""session/front/router.py: least-loaded choice, pins from session headers, expiry, health (docs/DESIGN.md, "TorchServe as we found it")."""

from __future__ import annotations

import calendar

import pytest

from session.errors import BackendUnavailable, SessionBackendUnavailable, SessionNotFound
from session.front.router import EXPIRY_GRACE_S, Backend, Router, parse_new_session_header, session_tag
from session.serving.protocol import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, format_expiry, new_session_header_value

T0 = 1_800_000_000.0  # a whole second, so that Expires (whole seconds) round-trips exactly
TTL = 600.0
A, B = "aaaa-1", "bbbb-2"


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_router(num: int = 2, healthy: bool = True, **kwargs) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router([Backend(index=i, url=f"http://127.0.0.1:{9000 + 10 * i}") for i in range(num)],
                    clock=clock, **kwargs)
    for backend in router.backends:
        router.record_probe(backend, healthy)
    return router, clock


def opened(session_id: str, clock: Clock, ttl: float = TTL) -> dict[str, str]:
    return {NEW_SESSION_HEADER: new_session_header_value(session_id, clock() + ttl)}


def open_on(router: Router, backend: Backend, session_id: str, clock: Clock) -> None:
    router.record_answer(backend, "NEW_SESSION", 200, opened(session_id, clock))


def test_parse_new_session_header():
    assert parse_new_session_header(f"{A}; Expires={format_expiry(T0)}") == (A, T0)
    assert parse_new_session_header(f"  {A};Expires=2027-01-15T08:00:00Z ") == (
        A, calendar.timegm((2027, 1, 15, 8, 0, 0)))
    assert parse_new_session_header(A) == (A, None)
    with pytest.raises(ValueError):
        parse_new_session_header(f"{A}; Expires=tomorrow")


def test_new_sessions_go_to_the_least_loaded_healthy_backend():
    router, clock = make_router(3)
    b0, b1, b2 = router.backends
    assert router.pick() is b0  # all idle: lowest index
    router.acquire(b0)
    assert router.pick() is b1
    router.acquire(b1)
    router.acquire(b1)
    assert router.pick() is b2
    router.acquire(b2)
    assert [b.num_outstanding for b in router.backends] == [1, 2, 1]
    assert router.pick() is b0  # b0 and b2 tie at 1 outstanding: lowest index
    router.release(b1)
    router.release(b1)
    assert router.pick() is b1
    assert [b.num_requests for b in router.backends] == [1, 2, 1]


def test_ties_in_load_go_to_the_backend_holding_fewer_sessions():
    router, clock = make_router(2)
    b0, b1 = router.backends
    open_on(router, b0, A, clock)
    assert (b0.num_sessions, b1.num_sessions) == (1, 0)
    assert router.pick() is b1
    open_on(router, b1, B, clock)
    assert router.pick() is b0


def test_unhealthy_and_excluded_backends_are_not_picked():
    router, clock = make_router(2)
    b0, b1 = router.backends
    router.mark_down(b0)
    assert router.pick() is b1
    with pytest.raises(BackendUnavailable) as info:
        router.pick(exclude=[b1])
    assert info.value.status == 503
    assert info.value.headers == {"Retry-After": "2"}


def test_no_backend_is_healthy_before_its_first_probe():
    router, clock = make_router(2, healthy=False)
    assert router.healthy_backends == []
    with pytest.raises(BackendUnavailable):
        router.pick()


def test_new_session_header_pins_and_follow_ups_route_there():
    router, clock = make_router(2)
    b0, b1 = router.backends
    open_on(router, b1, A, clock)
    assert router.route(A) is b1
    pin = router.pins[A]
    assert (pin.backend, pin.ttl_s, pin.expires_at) == (b1, TTL, T0 + TTL)
    assert (b0.num_sessions, b1.num_sessions) == (0, 1)


def test_each_answer_extends_the_pin_by_the_sessions_ttl():
    router, clock = make_router(2)
    b0 = router.backends[0]
    open_on(router, b0, A, clock)
    clock.now += 100
    router.record_answer(b0, A, 200, {"X-Amzn-SageMaker-Session-Id": A})
    assert router.pins[A].expires_at == T0 + 100 + TTL
    clock.now += 50
    router.record_answer(b0, A, 400, {})  # a bad request does not keep the session alive here
    assert router.pins[A].expires_at == T0 + 100 + TTL


def test_closed_session_header_forgets_the_pin():
    router, clock = make_router(2)
    b0 = router.backends[0]
    open_on(router, b0, A, clock)
    open_on(router, b0, B, clock)
    router.record_answer(b0, A, 200, {CLOSED_SESSION_HEADER.lower(): A})
    assert set(router.pins) == {B}
    assert b0.num_sessions == 1
    with pytest.raises(SessionNotFound) as info:
        router.route(A)
    assert info.value.status == 404
    assert "unknown to this endpoint" in info.value.message


def test_session_not_found_from_the_backend_forgets_the_pin():
    router, clock = make_router(2)
    b0, b1 = router.backends
    open_on(router, b0, A, clock)
    router.record_answer(b0, A, 404, {}, error_type="invalid_request_error")
    assert A in router.pins
    router.record_answer(b1, A, 404, {}, error_type="session_not_found")  # not the backend holding it
    assert A in router.pins
    router.record_answer(b0, A, 404, {}, error_type="session_not_found")
    assert A not in router.pins
    assert b0.num_sessions == 0


def test_pins_expire_after_the_backends_expiry_and_grace():
    router, clock = make_router(2)
    b0, b1 = router.backends
    open_on(router, b0, A, clock)
    open_on(router, b1, B, clock)
    clock.now = T0 + 300
    router.record_answer(b1, B, 200, {})  # B used: expires at T0 + 300 + TTL
    clock.now = T0 + TTL + EXPIRY_GRACE_S - 1
    assert router.expire() == []
    clock.now = T0 + TTL + EXPIRY_GRACE_S
    assert router.expire() == [A]
    assert (b0.num_sessions, b1.num_sessions) == (0, 1)
    clock.now = T0 + 300 + TTL + EXPIRY_GRACE_S
    with pytest.raises(SessionNotFound) as info:  # a request finds it expired before the reaper does
        router.route(B)
    assert "unknown to this endpoint" in info.value.message  # the front then asks the backends
    assert router.pins == {}
    assert b1.num_sessions == 0


def test_a_new_session_header_without_expiry_uses_the_default_ttl():
    router, clock = make_router(1, default_ttl_s=30.0)
    router.record_answer(router.backends[0], None, 200, {NEW_SESSION_HEADER: A})
    assert router.pins[A].expires_at == T0 + 30.0


def test_a_malformed_new_session_header_pins_nothing():
    router, clock = make_router(1)
    router.record_answer(router.backends[0], None, 200, {NEW_SESSION_HEADER: "x; Expires=soon"})
    assert router.pins == {}


def test_a_session_whose_backend_is_down_gets_410_until_it_comes_back():
    router, clock = make_router(2)
    b0, b1 = router.backends
    open_on(router, b0, A, clock)
    open_on(router, b1, B, clock)
    assert router.mark_down(b1) is True
    assert router.mark_down(b1) is False
    with pytest.raises(SessionBackendUnavailable) as info:
        router.route(B)
    assert (info.value.status, info.value.type) == (410, "session_backend_unavailable")
    assert "open a new session" in info.value.message
    assert router.route(A) is b0  # other sessions are unaffected
    assert router.pick() is b0  # and new ones go to the healthy backend
    assert B in router.pins  # kept: the backend may come back with its sessions
    router.record_probe(b1, True)
    assert router.route(B) is b1


def test_probes_take_a_backend_out_after_consecutive_failures_only():
    router, clock = make_router(1, unhealthy_after=3)
    backend = router.backends[0]
    assert [router.record_probe(backend, False) for _ in range(2)] == [False, False]
    assert backend.healthy and backend.num_failed_probes == 2
    assert router.record_probe(backend, True) is False
    assert backend.num_failed_probes == 0
    assert [router.record_probe(backend, False) for _ in range(3)] == [False, False, True]
    assert not backend.healthy
    assert router.record_probe(backend, True) is True
    assert backend.healthy


def test_release_without_acquire_is_a_bug():
    router, clock = make_router(1)
    with pytest.raises(AssertionError):
        router.release(router.backends[0])


def test_reopening_an_id_moves_the_pin_and_keeps_counts_exact():
    router, clock = make_router(2)
    b0, b1 = router.backends
    open_on(router, b0, A, clock)
    open_on(router, b1, A, clock)
    assert router.route(A) is b1
    assert (b0.num_sessions, b1.num_sessions) == (0, 1)
    assert router.forget(A) is True
    assert router.forget(A) is False
    assert (b0.num_sessions, b1.num_sessions) == (0, 0)


def test_constructor_refuses_nonsense():
    with pytest.raises(ValueError, match="at least one backend"):
        Router([])
    with pytest.raises(ValueError, match="unhealthy_after"):
        Router([Backend(0, "http://x")], unhealthy_after=0)


U = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"  # a uuid4


def tagged_router(num: int = 3) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router([Backend(index=i, url=f"http://127.0.0.1:{9000 + 10 * i}", tag=f"b{i}") for i in range(num)],
                    clock=clock)
    for backend in router.backends:
        router.record_probe(backend, True)
    return router, clock


def test_session_tag_is_the_suffix_after_a_uuid4():
    assert session_tag(f"{U}-b0") == "b0"
    assert session_tag(f"{U}-instA7") == "instA7"
    assert session_tag(U) is None  # a plain uuid4: no tag
    assert session_tag(f"{U}-") is None
    assert session_tag(f"{U}-b_0") is None
    assert session_tag("b0") is None
    assert session_tag(f"x{U}-b0") is None


def test_a_tagged_id_routes_to_its_backend_with_no_pin():
    router, clock = tagged_router(3)
    b0, b1, b2 = router.backends
    assert router.route(f"{U}-b2") is b2  # what a restarted front, or a second one, does
    assert router.route(f"{U}-b0") is b0
    assert router.pins == {}
    with pytest.raises(SessionNotFound):
        router.route(f"{U}-b9")  # no such backend
    with pytest.raises(SessionNotFound):
        router.route(U)
    router.mark_down(b1)
    with pytest.raises(SessionBackendUnavailable):
        router.route(f"{U}-b1")


def test_a_pin_wins_over_the_tag_and_an_expired_pin_falls_back_to_it():
    router, clock = tagged_router(2)
    b0, b1 = router.backends
    sid = f"{U}-b0"
    router.pin(sid, b1, clock() + TTL)  # moved off its home by a drain
    assert router.route(sid) is b1
    clock.now += TTL + EXPIRY_GRACE_S
    assert router.route(sid) is b0  # the pin is gone; the backends decide whether the session lives
    assert router.pins == {} and b1.num_sessions == 0


def test_a_draining_backend_serves_its_sessions_but_gets_no_new_ones():
    router, clock = tagged_router(2)
    b0, b1 = router.backends
    router.drain(b0)
    assert router.pick() is b1
    assert router.route(f"{U}-b0") is b0
    with pytest.raises(BackendUnavailable):
        router.pick(exclude=[b1])
    router.resume(b0)
    assert router.pick() is b0


def test_two_backends_cannot_share_a_tag():
    with pytest.raises(ValueError, match="share the session id tag 'b0'"):
        Router([Backend(0, "http://x", tag="b0"), Backend(1, "http://y", tag="b0")])


def test_a_prefix_tag_matches_every_backend_of_an_instance():
    router = Router([Backend(0, "http://a", tag="ia*"), Backend(1, "http://b", tag="ib*"),
                     Backend(2, "http://c", tag="b0")])
    for backend in router.backends:
        router.record_probe(backend, True)
    assert router.route(f"{U}-iab0") is router.backends[0]
    assert router.route(f"{U}-iab1") is router.backends[0]
    assert router.route(f"{U}-ibb0") is router.backends[1]
    assert router.route(f"{U}-b0") is router.backends[2]
    assert router.home(f"{U}-icb0") is None
    with pytest.raises(ValueError, match="share the session id tag"):
        Router([Backend(0, "http://a", tag="i*"), Backend(1, "http://b", tag="ib*")])
    with pytest.raises(ValueError, match="share the session id tag"):
        Router([Backend(0, "http://a", tag="ib0"), Backend(1, "http://b", tag="ib*")])
