"""The front's OpenAI path driven by the real ``openai`` client, before fake session backends:
sessions through the SageMaker headers (``extra_headers``), streaming and not, errors, models."""

from __future__ import annotations

import openai
import pytest

from session.front.config import FrontConfig
from session.front.server import Front
from session.serving.protocol import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, SESSION_HEADER
from tests.fake_backend import TOKEN, LoopThread, SessionBackend


@pytest.fixture
def front_url():
    thread = LoopThread()
    backends = [thread.call(SessionBackend(i).start()) for i in range(2)]
    config = FrontConfig.from_env({}, backends=tuple(b.url for b in backends), health_interval_s=3600.0,
                                  admin_token=TOKEN)
    front = Front(config)
    thread.call(front.start("127.0.0.1", 0))
    thread.call(front.check_health())
    try:
        yield f"http://127.0.0.1:{front.port}"
    finally:
        thread.call(front.stop())
        for backend in backends:
            thread.call(backend.stop())
        thread.close()


def client(url: str) -> openai.OpenAI:
    # No retries: a retried NEW_SESSION would open a second session.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused-locally", max_retries=0, timeout=10)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_session_through_the_openai_client(front_url):
    llm = client(front_url)
    raw = llm.chat.completions.with_raw_response.create(
        model="llava", messages=ask("hi"), max_tokens=8, extra_headers={SESSION_HEADER: "NEW_SESSION"})
    session_id = raw.headers[NEW_SESSION_HEADER].split(";")[0]
    opened = raw.parse()
    assert opened.choices[0].message.content == "backend 0 turn 1"
    assert opened.model_extra["session_id"] == session_id  # also in the body
    follow = llm.chat.completions.create(model="llava", messages=ask("more"), max_tokens=8,
                                         extra_headers={SESSION_HEADER: session_id})
    assert follow.choices[0].message.content == "backend 0 turn 2"
    assert follow.usage.prompt_tokens == 3

    stream = llm.chat.completions.create(model="llava", messages=ask("again"), max_tokens=8, stream=True,
                                         extra_headers={SESSION_HEADER: session_id})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "backend 0 turn 3 "

    closed = llm.chat.completions.with_raw_response.create(
        model="llava", messages=ask("x"), extra_headers={SESSION_HEADER: session_id},
        extra_body={"requestType": "CLOSE"})
    assert closed.headers[CLOSED_SESSION_HEADER] == session_id
    with pytest.raises(openai.NotFoundError) as gone:
        llm.chat.completions.create(model="llava", messages=ask("still?"), extra_headers={SESSION_HEADER: session_id})
    assert gone.value.status_code == 404
    assert gone.value.body["type"] == "session_not_found"


def test_stateless_requests_and_errors_and_models(front_url):
    llm = client(front_url)
    first = llm.chat.completions.create(model="llava", messages=ask("hi"))
    assert first.choices[0].message.content == "backend 0"
    with pytest.raises(openai.BadRequestError) as bad:
        llm.chat.completions.create(model="llava", messages=ask("hi"), extra_headers={SESSION_HEADER: "not_valid"})
    assert bad.value.body["type"] == "invalid_session_id"
    assert [m.id for m in llm.models.list()] == ["llava", "support"]
