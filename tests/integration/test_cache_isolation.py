"""Tenants on one worker. The shared prefix cache: a request finds (and ``cached_tokens`` reports) only
the blocks that requests of its own tenant and ``cache_salt`` published; within one tenant the sharing
stays. Sessions: a tenant at its share gets 429, the others open on. The tenant is what the front names
in ``X-Resident-Tenant``."""

from __future__ import annotations

import pytest

from session.serving.protocol import TENANT_HEADER
from tests.conftest import chat_service
from tests.integration.test_structured_output import NEW, SESSION, call

SECRET = "The PIN of the vault is 4417. " + " ".join(f"Clause {i}: the tenant keeps its own data." for i in range(50))


@pytest.fixture(scope="module")
def service(smollm2_path):
    with chat_service(smollm2_path) as chat:
        yield chat


def cached(service, tenant: str | None, salt: str | None = None, headers: dict | None = None) -> dict:
    body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    status, answer, response_headers = call(service, body, {**({TENANT_HEADER: tenant} if tenant else {}),
                                                            **(headers or {})})
    assert status == 200, answer
    return {"cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt": answer["usage"]["prompt_tokens"], "headers": response_headers}


def test_tenants_find_only_their_own_blocks(service):
    first = cached(service, "acme")
    assert first["prompt"] > 600 and first["cached"] == 0
    assert cached(service, "acme")["cached"] >= 256  # within a tenant the prompt is shared
    assert cached(service, "globex")["cached"] == 0  # another tenant learns nothing from cached_tokens
    assert cached(service, None)["cached"] == 0  # nor does a request without a tenant
    assert cached(service, "globex")["cached"] >= 256  # its own publication, found again


def test_cache_salt_keys_blocks_within_a_tenant(service):
    assert cached(service, "initech", salt="alice")["cached"] == 0
    assert cached(service, "initech", salt="bob")["cached"] == 0
    assert cached(service, "initech", salt="alice")["cached"] >= 256
    assert cached(service, "initech")["cached"] == 0


def test_a_closed_sessions_blocks_stay_its_tenants(service):
    opened = cached(service, "umbrella", headers={SESSION: "NEW_SESSION"})
    session_id = opened["headers"][NEW].split(";")[0]
    status, _, _ = call(service, {"requestType": "CLOSE"}, {SESSION: session_id, TENANT_HEADER: "umbrella"})
    assert status == 200
    assert cached(service, "hooli")["cached"] == 0
    assert cached(service, "umbrella")["cached"] >= 256
    assert service.engine.parts.store.peek(session_id) is None


def test_a_tenant_at_its_session_share_gets_429_and_others_open_on(smollm2_path):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def open_as(tenant: str):
        return call(service, body, {TENANT_HEADER: tenant, SESSION: "NEW_SESSION"})
    with chat_service(smollm2_path, max_sessions_per_tenant=2) as service:
        first, second = open_as("acme"), open_as("acme")
        assert (first[0], second[0]) == (200, 200)
        status, refused, headers = open_as("acme")
        assert status == 429 and refused["error"]["type"] == "too_many_requests", refused
        assert refused["error"]["message"].startswith("this tenant has 2 sessions open on this worker, its share")
        assert headers["Retry-After"] == "5"
        assert open_as("globex")[0] == 200  # another tenant is not held back by acme's sessions
        assert call(service, body, {TENANT_HEADER: "acme"})[0] == 200  # nor are acme's stateless requests
        closed = first[2][NEW].split(";")[0]
        assert call(service, {"requestType": "CLOSE"}, {SESSION: closed})[0] == 200
        assert open_as("acme")[0] == 200  # a closed session frees its place in the share
        assert dict(service.engine.parts.store.per_tenant) == {"acme": 2, "globex": 1}
