"""Tenants at the front (session/front/tenants.py): resolved from an API key, a trusted header or the
peer address; every per-client limit keys on the tenant, and the backend is told it in
X-Resident-Tenant, never what a client claims. All clients here come from 127.0.0.1, as every
tenant does behind SageMaker or a load balancer."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import boto3
import openai
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from session.errors import BadRequest, ConfigError
from session.front.config import FrontConfig
from session.front.server import Front
from session.front.tenants import attribute_value, read_api_keys
from session.serving.protocol import TENANT_HEADER
from tests.fake_backend import TOKEN, LoopThread, SessionBackend

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
HOLD = {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 3}
ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
KEY_A, KEY_B = "key-of-acme-0123456789", "key-of-globex-0123456789"


@contextlib.asynccontextmanager
async def front_over_one_backend(**settings):
    """The front, an aiohttp client, and the fake backend behind the front."""
    backend = await SessionBackend(0).start()
    config = FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, admin_token=TOKEN,
                                  **settings)
    front = Front(config)
    await front.start("127.0.0.1", 0)
    await front.check_health()
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{front.port}") as client:
            yield front, client, backend
    finally:
        backend.release.set()
        await front.stop()
        await backend.stop()


async def held_until(backend: SessionBackend, num: int) -> None:
    while len(backend.requests) < num:
        await asyncio.sleep(0.01)


def tenants_seen(backend: SessionBackend) -> list[str | None]:
    return [r["headers"].get(TENANT_HEADER) for r in backend.requests]


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text(f"# tenant key\nacme {KEY_A}\n\nglobex   {KEY_B}\n")
    return str(path)


# ---------------------------------------------------------------- the trusted header


@pytest.mark.asyncio
async def test_two_tenants_from_one_address_each_get_their_own_cap_behind_the_sagemaker_header():
    async with front_over_one_backend(max_requests_per_client=1, tenant_header=ATTRIBUTES,
                                      tenant_attribute="tenant") as (front, client, backend):
        acme, globex = {ATTRIBUTES: "trace=1; tenant=acme"}, {ATTRIBUTES: "tenant=globex,trace=2"}
        held = asyncio.ensure_future(client.post("/invocations", json=HOLD, headers=acme))
        await held_until(backend, 1)
        assert front.limiter.in_flight == {"acme": 1}
        refused = await client.post("/invocations", json=CHAT, headers=acme)  # acme at its cap
        assert refused.status == 429 and (await refused.json())["error"]["type"] == "too_many_requests"
        served = await client.post("/invocations", json=CHAT, headers=globex)  # globex is not acme
        assert served.status == 200
        backend.release.set()
        assert (await held).status == 200
        assert tenants_seen(backend) == ["acme", "globex"]
        assert front.limiter.num_refused == 1 and front.limiter.in_flight == {}


@pytest.mark.asyncio
async def test_a_plain_tenant_header_is_the_tenant_and_without_it_the_peer_address_is():
    async with front_over_one_backend(max_requests_per_client=1, tenant_header="X-Tenant-Id") as (front, client,
                                                                                                  backend):
        held = asyncio.ensure_future(client.post("/invocations", json=HOLD, headers={"X-Tenant-Id": "acme"}))
        await held_until(backend, 1)
        assert (await client.post("/invocations", json=CHAT, headers={"X-Tenant-Id": "acme"})).status == 429
        assert (await client.post("/v1/chat/completions", json=CHAT, headers={"X-Tenant-Id": "a.b_c-1"})).status == 200
        assert (await client.post("/v1/completions", json=CHAT)).status == 200  # no header: the peer
        backend.release.set()
        await held
        assert tenants_seen(backend) == ["acme", "a.b_c-1", "addr:127.0.0.1"]


@pytest.mark.asyncio
async def test_the_header_is_ignored_where_not_configured_so_no_client_picks_its_tenant():
    async with front_over_one_backend(max_requests_per_client=1) as (front, client, backend):
        held = asyncio.ensure_future(client.post("/invocations", json=HOLD, headers={ATTRIBUTES: "tenant=acme"}))
        await held_until(backend, 1)
        assert front.limiter.in_flight == {"addr:127.0.0.1": 1}
        other = await client.post("/invocations", json=CHAT, headers={ATTRIBUTES: "tenant=globex",
                                                                      "X-Tenant-Id": "globex"})
        assert other.status == 429  # the same address is the same tenant, whatever it claims
        backend.release.set()
        await held
        assert tenants_seen(backend) == ["addr:127.0.0.1"]
        assert backend.requests[0]["headers"][ATTRIBUTES] == "tenant=acme"  # still passed on, as before


@pytest.mark.asyncio
async def test_a_forged_x_resident_tenant_never_reaches_the_backend():
    async with front_over_one_backend(tenant_header=ATTRIBUTES, tenant_attribute="tenant") as (_, client, backend):
        forged = {TENANT_HEADER: "globex"}
        assert (await client.post("/invocations", json=CHAT, headers=forged)).status == 200
        assert (await client.post("/invocations", json=CHAT,
                                  headers={**forged, ATTRIBUTES: "tenant=acme"})).status == 200
        stream = await client.post("/endpoints/x/invocations-response-stream", json=CHAT, headers=forged)
        assert stream.status == 200
        await stream.read()
        assert tenants_seen(backend) == ["addr:127.0.0.1", "acme", "addr:127.0.0.1"]


@pytest.mark.asyncio
@pytest.mark.parametrize("attributes", ["tenant=acme/evil", "tenant=", "tenant=" + "a" * 65, "tenant=addr:1.2.3.4",
                                        "tenant=acme;tenant=globex"])
async def test_a_bad_tenant_is_400_and_reaches_no_backend(attributes):
    async with front_over_one_backend(tenant_header=ATTRIBUTES, tenant_attribute="tenant") as (front, client,
                                                                                               backend):
        answer = await client.post("/invocations", json=CHAT, headers={ATTRIBUTES: attributes})
        assert answer.status == 400
        assert (await answer.json())["error"]["type"] == "invalid_request_error"
        assert backend.requests == [] and front.limiter.in_flight == {}


def test_the_tenant_attribute_among_custom_attributes():
    assert attribute_value("tenant=acme", "tenant") == "acme"
    assert attribute_value(" trace = 7 ; tenant = acme , x=y", "tenant") == "acme"
    assert attribute_value("tenants=acme,my_tenant=b", "tenant") is None
    assert attribute_value("tenant=acme,tenant=acme", "tenant") == "acme"
    with pytest.raises(BadRequest):
        attribute_value("tenant=acme,tenant=globex", "tenant")


# ---------------------------------------------------------------- the API-key file


@pytest.mark.asyncio
async def test_api_keys_name_the_tenant_a_wrong_or_missing_one_is_401_and_ping_needs_none(key_file):
    async with front_over_one_backend(api_keys_file=key_file, max_requests_per_client=1) as (front, client,
                                                                                             backend):
        def bearer(key: str) -> dict:
            return {"Authorization": f"Bearer {key}"}

        held = asyncio.ensure_future(client.post("/invocations", json=HOLD, headers=bearer(KEY_A)))
        await held_until(backend, 1)
        assert front.limiter.in_flight == {"acme": 1}
        assert (await client.post("/invocations", json=CHAT, headers=bearer(KEY_A))).status == 429
        assert (await client.post("/invocations", json=CHAT, headers=bearer(KEY_B))).status == 200
        for headers in ({}, bearer(KEY_A + "x"), bearer(KEY_A[:-1]), {"Authorization": KEY_A}, bearer(""),
                        {ATTRIBUTES: "tenant=acme"}):
            refused = await client.post("/invocations", json=CHAT, headers=headers)
            assert refused.status == 401, headers
            assert refused.headers["WWW-Authenticate"] == "Bearer"
            assert (await refused.json())["error"]["type"] == "authentication_error"
        assert (await client.get("/v1/models")).status == 401
        assert (await client.get("/ping")).status == 200
        backend.release.set()
        assert (await held).status == 200
        assert tenants_seen(backend) == ["acme", "globex"]
        assert all("Authorization" not in r["headers"] for r in backend.requests)  # the key stays here


@pytest.mark.asyncio
async def test_the_access_log_names_the_tenant_never_the_key(key_file, caplog):
    caplog.set_level("INFO")
    async with front_over_one_backend(api_keys_file=key_file) as (_, client, _backend):
        assert (await client.post("/invocations", json=CHAT, headers={"Authorization": f"Bearer {KEY_A}"})).status == 200
        assert (await client.post("/invocations", json=CHAT, headers={"Authorization": "Bearer wrong"})).status == 401
    access = [r.getMessage() for r in caplog.records if r.name == "resident.front.access"]
    assert [(line.split()[3], line.split()[6]) for line in access] == [("200", "tenant=acme"), ("401", "tenant=addr:127.0.0.1")]
    assert KEY_A not in caplog.text and "wrong" not in caplog.text


@contextlib.contextmanager
def threaded_front(**settings):
    """The front's URL and its fake backend, served from a thread, for synchronous clients."""
    thread = LoopThread()
    backend = thread.call(SessionBackend(0).start())
    front = Front(FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, **settings))
    thread.call(front.start("127.0.0.1", 0))
    thread.call(front.check_health())
    try:
        yield f"http://127.0.0.1:{front.port}", backend
    finally:
        thread.call(front.stop())
        thread.call(backend.stop())
        thread.close()


def test_the_openai_client_api_key_is_the_bearer_key(key_file):
    with threaded_front(api_keys_file=key_file) as (url, backend):
        def llm(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)

        answer = llm(KEY_B).chat.completions.create(model="llava", messages=CHAT["messages"])
        assert answer.choices[0].message.content == "backend 0"
        with pytest.raises(openai.AuthenticationError) as refused:
            llm("not-a-key-of-anyone").chat.completions.create(model="llava", messages=CHAT["messages"])
        assert refused.value.status_code == 401 and refused.value.body["type"] == "authentication_error"
        assert tenants_seen(backend) == ["globex"]


def test_boto3_custom_attributes_name_the_tenant_as_on_sagemaker():
    with threaded_front(tenant_header=ATTRIBUTES, tenant_attribute="tenant") as (url, backend):
        runtime = boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                               aws_access_key_id="local", aws_secret_access_key="local",
                               config=Config(retries={"total_max_attempts": 1}))
        for attributes in ("tenant=acme", "trace=7;tenant=globex"):
            answer = runtime.invoke_endpoint(EndpointName="resident", Body=json.dumps(CHAT),
                                             ContentType="application/json", CustomAttributes=attributes)
            assert json.loads(answer["Body"].read())["choices"][0]["message"]["content"] == "backend 0"
        with pytest.raises(ClientError) as bad:
            runtime.invoke_endpoint(EndpointName="resident", Body=json.dumps(CHAT), ContentType="application/json",
                                    CustomAttributes="tenant=acme/evil")
        assert bad.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        assert tenants_seen(backend) == ["acme", "globex"]


@pytest.mark.parametrize(("text", "why"), [
    ("acme\n", "two fields"),
    (f"acme {KEY_A} extra\n", "two fields"),
    (f"ac/me {KEY_A}\n", "tenant 'ac/me'"),
    ("acme short\n", "shorter than 16"),
    (f"acme {KEY_A}\nglobex {KEY_A}\n", "already given to tenant 'acme'"),
    ("# nobody\n", "holds no"),
])
def test_a_bad_key_file_is_refused_at_start_up_naming_the_line_never_the_key(tmp_path, text, why):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why) as refused:
        FrontConfig.from_env({"RESIDENT_FRONT_API_KEYS_FILE": str(path)}, backends=("http://b:1",))
    assert KEY_A not in str(refused.value)


def test_one_tenant_may_hold_several_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"acme {KEY_A}\nacme {KEY_B}\n")
    assert sorted(read_api_keys(str(path)).values()) == ["acme", "acme"]


@pytest.mark.parametrize(("settings", "why"), [
    ({"API_KEYS_FILE": "/nowhere", "TENANT_HEADER": "X-Tenant-Id"}, "not both"),
    ({"TENANT_ATTRIBUTE": "tenant"}, "set that too"),
    ({"TENANT_HEADER": "X Tenant"}, "not a header name"),
    ({"TENANT_HEADER": TENANT_HEADER}, "cannot be"),
    ({"TENANT_HEADER": ATTRIBUTES, "TENANT_ATTRIBUTE": "a=b"}, "TENANT_ATTRIBUTE"),
    ({"API_KEYS_FILE": "/nowhere"}, "cannot read"),
])
def test_tenant_settings_are_checked_at_start_up(settings, why):
    environ = {"RESIDENT_FRONT_" + name: value for name, value in settings.items()}
    with pytest.raises(ConfigError, match=why):
        FrontConfig.from_env(environ, backends=("http://b:1",))
