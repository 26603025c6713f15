"""The shared prefix cache between tenants: a request finds (and ``cached_tokens`` reports) only the
blocks that requests of its own tenant and ``cache_salt`` published; within one tenant the sharing
stays. The tenant is what the front names in ``X-Resident-Tenant``."""

from __future__ import annotations

import pytest

from model_store.build_smollm2 import build
from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from session.serving.protocol import TENANT_HEADER
from tests.conftest import REPO
from tests.integration.test_structured_output import NEW, SESSION, call

SECRET = "The PIN of the vault is 4417. " + " ".join(f"Clause {i}: the tenant keeps its own data." for i in range(50))


@pytest.fixture(scope="module")
def service():
    engine = Engine(EngineConfig(model_path=str(build(REPO / "models")), speculative="off",
                                 check_invariants=True)).start()
    yield ChatService(engine, "smollm2")
    engine.stop()


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
