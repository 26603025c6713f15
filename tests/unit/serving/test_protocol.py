"""session/serving/protocol.py: SageMaker session headers, request parsing, response shapes (docs/DESIGN.md, "Wire protocol")."""

from __future__ import annotations

import calendar
import json
import re
import uuid

import pytest

from session.errors import BadRequest, InvalidSessionId
from session.serving.answer_bodies import CompletionIds, chunk_body, completion_body, message_choice
from session.serving.chat_request import ChatRequest, PromptLimits, parse_request
from session.serving.protocol import (
    CLOSE,
    NEW_SESSION,
    SESSION_HEADER,
    format_expiry,
    header,
    new_session_header_value,
    sse,
)
from session.types import ImagePart, Message, TextPart, Usage, new_session_id, validate_session_id

SAGEMAKER_ID_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
PNG_URL = "data:image/png;base64,iVBORw0KGgo="
DEFAULT_MAX_TOKENS = 16
MAX_NEW_TOKENS = 64


def parse(body, headers=None) -> ChatRequest:
    if isinstance(body, dict):
        body = json.dumps(body)
    return parse_request(body, headers or {}, default_max_tokens=DEFAULT_MAX_TOKENS, max_new_tokens=MAX_NEW_TOKENS,
                         max_choices=MAX_CHOICES)


MAX_CHOICES = 4


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def bad(body, headers=None) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse(body, headers)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- session ids


def test_new_session_id_is_a_uuid4_matching_the_sagemaker_pattern():
    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100
    for session_id in ids:
        assert SAGEMAKER_ID_RE.fullmatch(session_id)
        assert len(session_id) == 36
        assert uuid.UUID(session_id).version == 4
        assert validate_session_id(session_id) == session_id


@pytest.mark.parametrize("session_id", ["a", "A1", "a-b", "a--b", "0-0-0", "x" * 256])
def test_valid_session_ids_are_returned_unchanged(session_id):
    assert validate_session_id(session_id) == session_id


@pytest.mark.parametrize("session_id", ["", "a_b", "-ab", "ab-", "-", "a b", "a.b", "x" * 257, "é"])
def test_invalid_session_ids_are_refused_with_400(session_id):
    with pytest.raises(InvalidSessionId) as info:
        validate_session_id(session_id)
    assert info.value.status == 400
    assert info.value.type == "invalid_session_id"
    assert "invalid session id" in info.value.message
    assert "at most 256 characters" in info.value.message


def test_session_id_with_trailing_newline_is_refused():
    with pytest.raises(InvalidSessionId):
        validate_session_id("abc\n")


# ---------------------------------------------------------------- headers


def test_format_expiry_is_utc_whole_seconds_with_z():
    assert format_expiry(0) == "1970-01-01T00:00:00Z"
    assert format_expiry(0.999) == "1970-01-01T00:00:00Z"
    epoch = calendar.timegm((2026, 11, 30, 9, 19, 49))
    assert format_expiry(epoch) == "2026-11-30T09:19:49Z"
    assert format_expiry(epoch + 0.75) == "2026-11-30T09:19:49Z"


def test_new_session_header_value_exact_format():
    assert new_session_header_value("abc-123", 0) == "abc-123; Expires=1970-01-01T00:00:00Z"
    value = new_session_header_value(new_session_id(), 1_800_000_000.5)
    match = re.fullmatch(r"([a-zA-Z0-9](?:-*[a-zA-Z0-9])*); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)", value)
    assert match is not None
    assert match.group(2) == "2027-01-15T08:00:00Z"


def test_header_lookup_is_case_insensitive():
    headers = {"x-amzn-sagemaker-session-id": "abc", "Content-Type": "application/json"}
    assert header(headers, SESSION_HEADER) == "abc"
    assert header(headers, "CONTENT-TYPE") == "application/json"
    assert header(headers, "X-Missing") is None


# ---------------------------------------------------------------- valid requests


def test_string_content_with_defaults():
    request = parse(chat())
    assert request.messages == (Message(role="user", parts=(TextPart("hi"),)),)
    assert request.sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert request.sampling.temperature == 0.0
    assert request.sampling.greedy is True
    assert request.sampling.top_p == 1.0
    assert request.sampling.stop == ()
    assert request.sampling.seed is None
    assert request.stream is False
    assert request.session_id is None
    assert request.request_type is None
    assert request.model is None
    assert request.opens_session is False
    assert request.closes_session is False


@pytest.mark.parametrize("kind", [bytes, bytearray, str, dict])
def test_body_may_be_bytes_str_or_an_already_decoded_mapping(kind):
    body = chat()
    raw = json.dumps(body)
    given = {bytes: raw.encode(), bytearray: bytearray(raw.encode()), str: raw, dict: body}[kind]
    request = parse_request(given, {}, default_max_tokens=3, max_new_tokens=8)
    assert request.messages[0].parts == (TextPart("hi"),)
    assert request.sampling.max_tokens == 3


def test_parts_with_text_and_image_url():
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]}
    request = parse(body)
    assert request.messages == (
        Message("system", (TextPart("Be brief."),)),
        Message("user", (ImagePart(PNG_URL), TextPart("What is this?"))),
        Message("assistant", (TextPart("A cat."),)),
    )
    assert request.messages[1].template_content() == [{"type": "image"}, {"type": "text", "text": "What is this?"}]


def test_sampling_fields():
    request = parse(chat(max_tokens=7, temperature=0.7, top_p=0.9, stop=["\n", "END"], seed=42, stream=True,
                         model="llava"))
    assert request.sampling.max_tokens == 7
    assert request.sampling.temperature == 0.7
    assert request.sampling.greedy is False
    assert request.sampling.top_p == 0.9
    assert request.sampling.stop == ("\n", "END")
    assert request.sampling.seed == 42
    assert request.stream is True
    assert request.model == "llava"


def test_integer_temperature_and_top_p_become_floats():
    request = parse(chat(temperature=1, top_p=1))
    assert request.sampling.temperature == 1.0 and isinstance(request.sampling.temperature, float)
    assert request.sampling.top_p == 1.0 and isinstance(request.sampling.top_p, float)


def test_null_temperature_top_p_stop_seed_model_take_defaults():
    request = parse(chat(temperature=None, top_p=None, stop=None, seed=None, model=None))
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.stop, request.sampling.seed) \
        == (0.0, 1.0, (), None)
    assert request.model is None


def test_stop_as_a_string():
    assert parse(chat(stop="###")).sampling.stop == ("###",)


def test_max_tokens_limits_are_inclusive():
    assert parse(chat(max_tokens=1)).sampling.max_tokens == 1
    assert parse(chat(max_tokens=MAX_NEW_TOKENS)).sampling.max_tokens == MAX_NEW_TOKENS


def test_max_completion_tokens_is_an_alias_and_wins_over_max_tokens():
    assert parse(chat(max_completion_tokens=9)).sampling.max_tokens == 9
    assert parse(chat(max_completion_tokens=9, max_tokens=5)).sampling.max_tokens == 9


def test_new_session_via_header():
    request = parse(chat(), {SESSION_HEADER: NEW_SESSION})
    assert request.session_id == NEW_SESSION
    assert request.opens_session is True
    assert request.closes_session is False


def test_new_session_via_lower_case_header_with_whitespace():
    request = parse(chat(), {SESSION_HEADER.lower(): f"  {NEW_SESSION} "})
    assert request.session_id == NEW_SESSION
    assert request.opens_session is True


def test_new_session_via_body_request_type():
    request = parse(chat(requestType="NEW_SESSION"))
    assert request.request_type == NEW_SESSION
    assert request.session_id is None
    assert request.opens_session is True


def test_body_request_type_new_session_with_the_header_too():
    assert parse(chat(requestType="NEW_SESSION"), {SESSION_HEADER: NEW_SESSION}).opens_session is True
    message = bad(chat(requestType="NEW_SESSION"), {SESSION_HEADER: new_session_id()}).message
    assert message == ("requestType 'NEW_SESSION' opens a new session, but the X-Amzn-SageMaker-Session-Id header "
                       "names one: send 'NEW_SESSION' in the header to open, or drop the requestType to continue")


def test_existing_session_id_in_header():
    session_id = new_session_id()
    request = parse(chat(), {SESSION_HEADER: session_id})
    assert request.session_id == session_id
    assert request.opens_session is False
    assert request.closes_session is False


def test_close_with_the_id_in_the_header():
    session_id = new_session_id()
    request = parse({"requestType": "CLOSE"}, {SESSION_HEADER: session_id})
    assert request.request_type == CLOSE
    assert request.closes_session is True
    assert request.opens_session is False
    assert request.session_id == session_id
    assert request.messages == ()
    assert request.sampling.max_tokens == 0


def test_close_does_not_validate_messages():
    request = parse({"requestType": "CLOSE", "messages": []}, {SESSION_HEADER: "abc"})
    assert request.closes_session is True


# ---------------------------------------------------------------- invalid requests


def test_malformed_json():
    assert bad(b'{"messages": [').message.startswith("request body is not valid JSON")


def test_body_that_is_not_utf8():
    assert bad(b'\xff\xfe\xfa{').message.startswith("request body is not valid JSON")


@pytest.mark.parametrize("body", [b"[]", b'"hi"', b"3", b"null"])
def test_json_that_is_not_an_object(body):
    assert bad(body).message == "request body must be a JSON object"


@pytest.mark.parametrize("body", [b"", "", None])
def test_empty_body(body):
    assert bad(body).message == "empty request body; send a JSON object with 'messages'"


def test_unknown_field():
    message = bad(chat(temprature=0.5, foo=1)).message
    assert message.startswith("unknown field(s) ['foo', 'temprature']")


def test_missing_messages():
    assert bad({"max_tokens": 4}).message == "missing 'messages': a list of {role, content}"


@pytest.mark.parametrize("messages", [[], {"role": "user"}, "hi"])
def test_messages_must_be_a_non_empty_list(messages):
    assert bad({"messages": messages}).message == "'messages' must be a non-empty list"


def test_message_that_is_not_an_object():
    assert bad({"messages": ["hi"]}).message == "messages[0] must be an object"


@pytest.mark.parametrize("role", ["robot", None, "USER"])
def test_bad_role(role):
    body = {"messages": [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]}
    assert bad(body).message == ("messages[1].role must be one of ['system', 'developer', 'user', 'assistant', "
                                 f"'tool'], got {role!r}")


@pytest.mark.parametrize("content", [None, 5, [], {"type": "text", "text": "hi"}])
def test_content_of_wrong_type(content):
    body = {"messages": [{"role": "user", "content": content}]}
    assert bad(body).message == "messages[0].content must be a string or a non-empty list of parts"


def test_part_that_is_not_an_object():
    body = {"messages": [{"role": "user", "content": ["hi"]}]}
    assert bad(body).message == "messages[0].content[0] must be an object"


def test_unknown_part_type():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}]}
    assert bad(body).message == "messages[0].content[1].type must be 'text' or 'image_url', got 'audio'"


def test_text_part_without_a_string():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert bad(body).message == "messages[0].content[0].text must be str, got int"


def test_image_part_without_a_url():
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert bad(body).message == "messages[0].content[0].image_url.url must be str, got NoneType"


@pytest.mark.parametrize("value, message", [
    (0, f"max_tokens must be between 1 and {MAX_NEW_TOKENS}, got 0"),
    (-3, f"max_tokens must be between 1 and {MAX_NEW_TOKENS}, got -3"),
    (MAX_NEW_TOKENS + 1, f"max_tokens must be between 1 and {MAX_NEW_TOKENS}, got {MAX_NEW_TOKENS + 1}"),
    ("8", "max_tokens must be int, got str"),
    (8.0, "max_tokens must be int, got float"),
    (True, "max_tokens must be int, got a boolean"),
])
def test_bad_max_tokens(value, message):
    assert bad(chat(max_tokens=value)).message == message


def test_bad_max_completion_tokens_is_reported_as_max_tokens():
    assert bad(chat(max_completion_tokens=0)).message == f"max_tokens must be between 1 and {MAX_NEW_TOKENS}, got 0"


@pytest.mark.parametrize("value, message", [
    (2.5, "temperature must be between 0 and 2, got 2.5"),
    (-0.1, "temperature must be between 0 and 2, got -0.1"),
    ("0.5", "temperature must be int or float, got str"),
    (True, "temperature must be int or float, got a boolean"),
])
def test_bad_temperature(value, message):
    assert bad(chat(temperature=value)).message == message


@pytest.mark.parametrize("value, message", [
    (0, "top_p must be in (0, 1], got 0.0"),
    (1.5, "top_p must be in (0, 1], got 1.5"),
    (-1, "top_p must be in (0, 1], got -1.0"),
    ("1", "top_p must be int or float, got str"),
])
def test_bad_top_p(value, message):
    assert bad(chat(top_p=value)).message == message


@pytest.mark.parametrize("stop", [5, ["a", 5], ["a", "b", "c", "d", "e"], {"x": 1}])
def test_stop_of_wrong_type(stop):
    assert bad(chat(stop=stop)).message == "stop must be a string or a list of at most 4 strings"


@pytest.mark.parametrize("stop", ["", ["a", ""]])
def test_empty_stop_string(stop):
    assert bad(chat(stop=stop)).message == "stop strings must not be empty"


@pytest.mark.parametrize("value, message", [
    ("7", "seed must be int, got str"),
    (1.5, "seed must be int, got float"),
    (False, "seed must be int, got a boolean"),
])
def test_bad_seed(value, message):
    assert bad(chat(seed=value)).message == message


def test_bad_stream():
    assert bad(chat(stream="yes")).message == "stream must be bool, got str"


def test_bad_model():
    assert bad(chat(model=3)).message == "model must be str, got int"


def test_n():
    assert parse(chat()).n == 1
    assert parse(chat(n=4)).n == 4
    assert bad(chat(n=5)).message == "n must be between 1 and 4 (RESIDENT_MAX_CHOICES), got 5"
    assert bad(chat(n=0)).message == "n must be between 1 and 4 (RESIDENT_MAX_CHOICES), got 0"
    assert bad(chat(n=2), {SESSION_HEADER: NEW_SESSION}).message.startswith(
        "n > 1 cannot be used in a session: a session holds one conversation")


@pytest.mark.parametrize("headers", [{}, {SESSION_HEADER: NEW_SESSION}])
def test_close_without_a_session_header(headers):
    message = bad({"requestType": "CLOSE"}, headers).message
    assert message == "a CLOSE request needs the session id in the X-Amzn-SageMaker-Session-Id header"


@pytest.mark.parametrize("session_id", ["bad_id", "-abc", "x" * 257])
def test_invalid_session_id_in_the_header(session_id):
    with pytest.raises(InvalidSessionId) as info:
        parse(chat(), {SESSION_HEADER: session_id})
    assert info.value.status == 400
    assert info.value.type == "invalid_session_id"
    assert info.value.message.startswith(f"invalid session id {session_id[:64]!r}")


def test_invalid_session_id_in_the_header_of_a_close():
    with pytest.raises(InvalidSessionId):
        parse({"requestType": "CLOSE"}, {SESSION_HEADER: "bad_id"})


@pytest.mark.parametrize("request_type", ["OPEN", "close", 1])
def test_unknown_request_type(request_type):
    message = bad(chat(requestType=request_type)).message
    assert message == f"requestType must be 'NEW_SESSION' or 'CLOSE', got {request_type!r}"


def test_error_body_shape():
    error = bad(b"[]")
    assert error.to_body() == {"error": {"type": "invalid_request_error",
                                         "message": "request body must be a JSON object",
                                         "code": "invalid_request_error"}}


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "stream", "n"])
def test_null_optional_fields_take_their_defaults(name):
    request = parse(chat(**{name: None}))
    assert request.sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert request.stream is False


# ---------------------------------------------------------------- responses


IDS = CompletionIds(model="llava-tiny", id="chatcmpl-abc", created=1700000000)
USAGE = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=3)
USAGE_DICT = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
              "prompt_tokens_details": {"cached_tokens": 3}}


def test_usage_to_dict():
    assert USAGE.to_dict() == USAGE_DICT


def test_completion_ids_defaults():
    ids = CompletionIds(model="m")
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", ids.id)
    assert isinstance(ids.created, int) and ids.created > 1_700_000_000
    assert CompletionIds(model="m").id != ids.id


def test_completion_body_with_session():
    assert completion_body(IDS, [message_choice(0, "A cat.", "stop")], USAGE, "abc-1") == {
        "id": "chatcmpl-abc", "object": "chat.completion", "created": 1700000000, "model": "llava-tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "A cat."}, "finish_reason": "stop"}],
        "usage": USAGE_DICT,
        "session_id": "abc-1",
    }


def test_completion_body_without_session_has_no_session_id_key():
    body = completion_body(IDS, [message_choice(0, "x", "length")], USAGE, None)
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["choices"][0]["finish_reason"] == "length"


def test_chunk_body():
    assert chunk_body(IDS, {"content": "A"}) == {
        "id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "llava-tiny",
        "choices": [{"index": 0, "delta": {"content": "A"}, "finish_reason": None}],
    }


def test_message_choice_with_tool_calls_and_index():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert message_choice(2, None, "tool_calls", tool_calls=[call]) == {
        "index": 2, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
        "finish_reason": "tool_calls"}
    assert chunk_body(IDS, {"content": "b"}, index=1)["choices"][0]["index"] == 1


def test_last_chunk_body_with_usage():
    body = chunk_body(IDS, {}, finish_reason="stop", usage=USAGE)
    assert body["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert body["usage"] == USAGE_DICT


def test_sse_framing():
    assert sse({"a": 1, "b": [1, 2]}) == 'data: {"a":1,"b":[1,2]}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"
    assert sse({"t": "é"}) == 'data: {"t":"\\u00e9"}\n\n'


def test_content_parts_are_capped_before_they_are_walked():
    parts = [{"type": "text", "text": "a"}] * 3
    body = {"messages": [{"role": "user", "content": parts}, {"role": "user", "content": parts}]}
    limits = PromptLimits(max_parts=5)
    with pytest.raises(BadRequest) as info:
        parse_request(json.dumps(body), {}, default_max_tokens=8, max_new_tokens=8, limits=limits)
    assert info.value.message == ("the messages have 6 content parts; at most 5 per request "
                                  "(RESIDENT_MAX_CONTENT_PARTS)")
    assert len(parse_request(json.dumps({"messages": body["messages"][:1]}), {}, default_max_tokens=8,
                             max_new_tokens=8, limits=limits).messages[0].parts) == 3
