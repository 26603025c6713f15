"""The front's OpenAI paths beyond chat, with the real ``openai`` client before a fake backend:
``/v1/completions`` forwarded to ``/invocations`` marked ``X-Resident-Endpoint: completions`` (a
client's own X-Resident-Endpoint never reaches a backend), and ``/v1/models`` (list and retrieve)
naming the served model with its context length, and the adapters with their parent."""

from __future__ import annotations

import openai
import pytest
import requests

from session.errors import ConfigError
from session.front.config import FrontConfig
from session.front.server import Front
from session.serving.protocol import COMPLETIONS_ENDPOINT, ENDPOINT_HEADER, NEW_SESSION_HEADER, SESSION_HEADER
from tests.fake_backend import TOKEN, LoopThread, SessionBackend

SERVED = "smollm2-135m-instruct"


class CompletionsBackend(SessionBackend):
    """The fake answers a completions body as a chat of its prompt, as the real backend reads one only
    when the front marks it."""

    async def _chat(self, request, body: dict):
        if request.headers.get(ENDPOINT_HEADER) == COMPLETIONS_ENDPOINT:
            body = {**body, "messages": [{"role": "user", "content": body["prompt"]}]}
        return await super()._chat(request, body)


@pytest.fixture
def stack():
    """(the front's URL, its one fake backend), the front told the served name and context length."""
    thread = LoopThread()
    backend = thread.call(CompletionsBackend(0).start())
    config = FrontConfig.from_env({}, backends=(backend.url,), health_interval_s=3600.0, admin_token=TOKEN,
                                  served_model_name=SERVED, max_model_len=8192)
    front = Front(config)
    thread.call(front.start("127.0.0.1", 0))
    thread.call(front.check_health())
    try:
        yield f"http://127.0.0.1:{front.port}", backend
    finally:
        thread.call(front.stop())
        thread.call(backend.stop())
        thread.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused-locally", max_retries=0, timeout=10)


def test_completions_reach_invocations_marked_as_completions(stack):
    url, backend = stack
    raw = client(url).completions.with_raw_response.create(
        model=SERVED, prompt="Once upon a time", max_tokens=4,
        extra_headers={SESSION_HEADER: "NEW_SESSION", ENDPOINT_HEADER: "chat"})  # the client's is dropped
    assert raw.http_response.status_code == 200
    assert raw.headers[NEW_SESSION_HEADER].split(";")[0].endswith("-b0")
    [seen] = backend.requests
    assert seen["path"] == "/invocations"
    assert seen["headers"][ENDPOINT_HEADER] == COMPLETIONS_ENDPOINT == "completions"
    assert {k: seen["body"][k] for k in ("model", "prompt", "max_tokens")} == \
        {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 4}
    assert seen["session"] == "NEW_SESSION"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations", "/predictions/llava"])
def test_a_client_cannot_mark_other_paths_as_completions(stack, path):
    url, backend = stack
    answer = requests.post(url + path, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10,
                           headers={ENDPOINT_HEADER: COMPLETIONS_ENDPOINT, "x-resident-endpoint": "completions"})
    assert answer.status_code == 200, answer.text
    [seen] = backend.requests
    assert seen["path"] == path.replace("/v1/chat/completions", "/invocations")
    assert ENDPOINT_HEADER.lower() not in {name.lower() for name in seen["headers"]}


def test_models_list_the_served_name_with_its_context_and_the_adapters(stack):
    url, _ = stack
    listed = requests.get(url + "/v1/models", timeout=10).json()
    assert listed["object"] == "list"
    assert listed["data"] == [
        {"id": SERVED, "object": "model", "created": 0, "owned_by": "resident", "max_model_len": 8192},
        {"id": "support", "object": "model", "created": 0, "owned_by": "resident", "max_model_len": 8192,
         "parent": SERVED}]
    assert [m.id for m in client(url).models.list()] == [SERVED, "support"]


def test_a_model_is_retrieved_by_name_or_is_404_model_not_found(stack):
    url, _ = stack
    llm = client(url)
    base = llm.models.retrieve(SERVED)
    assert (base.id, base.model_extra["max_model_len"]) == (SERVED, 8192)
    assert llm.models.retrieve("support").model_extra["parent"] == SERVED
    with pytest.raises(openai.NotFoundError) as missing:
        llm.models.retrieve("llava")  # the TorchServe model's name is not what is served
    assert missing.value.status_code == 404
    error = missing.value.response.json()["error"]
    assert (error["type"], error["code"]) == ("model_not_found", "model_not_found")
    assert "'llava'" in error["message"]


def test_without_the_launchers_settings_the_list_names_model_name_alone():
    config = FrontConfig.from_env({}, backends=("http://127.0.0.1:1",))
    assert (config.listed_model_name, config.max_model_len) == ("llava", 0)


def test_the_served_name_and_context_length_come_from_the_environment():
    config = FrontConfig.from_env({"RESIDENT_FRONT_BACKENDS": "http://127.0.0.1:1",
                                   "RESIDENT_FRONT_SERVED_MODEL_NAME": "llava-tiny",
                                   "RESIDENT_FRONT_MAX_MODEL_LEN": "1024"})
    assert (config.listed_model_name, config.max_model_len, config.model_name) == ("llava-tiny", 1024, "llava")
    with pytest.raises(ConfigError, match="RESIDENT_FRONT_MAX_MODEL_LEN must be >= 0"):
        FrontConfig.from_env({"RESIDENT_FRONT_BACKENDS": "http://127.0.0.1:1", "RESIDENT_FRONT_MAX_MODEL_LEN": "-1"})


def test_models_and_adapters_are_listed_while_the_first_backend_is_down():
    """A backend down but not yet found so by the health checks (its next check is an hour away here):
    the list came from the first healthy backend alone, so /v1/models and /adapters answered 502 while
    chats went to the other. The next backend answers them."""
    thread = LoopThread()
    down, up = (thread.call(SessionBackend(i).start()) for i in range(2))
    config = FrontConfig.from_env({}, backends=(down.url, up.url), health_interval_s=3600.0, admin_token=TOKEN,
                                  served_model_name=SERVED)
    front = Front(config)
    thread.call(front.start("127.0.0.1", 0))
    thread.call(front.check_health())
    thread.call(down.stop())
    try:
        url = f"http://127.0.0.1:{front.port}"
        assert [m.id for m in client(url).models.list()] == [SERVED, "support"]
        listed = requests.get(url + "/adapters", headers={"X-Resident-Admin-Token": TOKEN}, timeout=10)
        assert listed.status_code == 200 and [a["name"] for a in listed.json()["adapters"]] == ["support"]
    finally:
        thread.call(front.stop())
        thread.call(up.stop())
        thread.close()
