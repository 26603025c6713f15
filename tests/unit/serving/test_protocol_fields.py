"""The chat-completions fields beyond the plain chat: logprobs, penalties, bias, the benchmark clients'
extensions, response_format and vLLM's guided_* fields, stream_options, and the fields refused by name."""

from __future__ import annotations

import json

import pytest

from session.types import JSON_STYLE, Constraint
from tests.unit.serving.test_protocol import bad, chat, parse


def test_logprobs_and_top_logprobs():
    assert parse(chat()).sampling.logprobs is None
    assert parse(chat(logprobs=True)).sampling.logprobs == 0
    assert parse(chat(logprobs=True, top_logprobs=5)).sampling.logprobs == 5
    assert bad(chat(logprobs=True, top_logprobs=21)).message == "top_logprobs must be between 0 and 20, got 21"
    assert bad(chat(top_logprobs=2)).message == "top_logprobs needs logprobs: true"


def test_penalties_bias_and_extensions():
    sampling = parse(chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100, "3": 2.5},
                          top_k=40, min_tokens=3, ignore_eos=True, repetition_penalty=1.2)).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert (sampling.top_k, sampling.min_tokens, sampling.ignore_eos, sampling.repetition_penalty) == (40, 3, True, 1.2)
    assert sampling.processed and not sampling.plain
    assert parse(chat(top_k=-1)).sampling.top_k == 0
    assert bad(chat(presence_penalty=3)).message == "presence_penalty must be between -2 and 2, got 3.0"
    assert bad(chat(logit_bias={"x": 1})).message == "logit_bias keys must be token ids, got 'x'"
    assert bad(chat(logit_bias={"1": 101})).message == "logit_bias['1'] must be between -100 and 100, got 101.0"
    assert bad(chat(repetition_penalty=0)).message == "repetition_penalty must be in (0, 10], got 0.0"
    assert parse(chat(min_tokens=8, max_tokens=8)).sampling.min_tokens == 8
    assert bad(chat(min_tokens=9, max_tokens=8)).message == "min_tokens must not exceed max_tokens (8), got 9"


def test_response_format_kinds():
    assert parse(chat(response_format={"type": "text"})).sampling.constraint is None
    obj = parse(chat(response_format={"type": "json_object"})).sampling.constraint
    assert obj.kind == "json_schema" and json.loads(obj.source) == {"type": "object",
                                                                     "x-guidance": {**JSON_STYLE, "lenient": False}}
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    strict = parse(chat(response_format={"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    loose = parse(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert strict.sampling.constraint.what == "response_format.json_schema"
    assert json.loads(loose.sampling.constraint.source)["x-guidance"]["lenient"] is True
    assert strict.sampling.constraint.key != loose.sampling.constraint.key
    again = parse(chat(response_format={"type": "json_schema",
                                        "json_schema": {"name": "y", "strict": True,
                                                        "schema": dict(reversed(list(schema.items())))}}))
    assert again.sampling.constraint.key == strict.sampling.constraint.key
    assert parse(chat(response_format={"type": "regex", "regex": "[0-9]+"})).sampling.constraint == \
        Constraint("regex", "[0-9]+", "response_format.regex")
    assert parse(chat(guided_grammar="start: \"a\"")).sampling.constraint.kind == "lark"
    assert parse(chat(guided_json='{"type": "integer"}')).sampling.constraint.what == "guided_json"
    assert bad(chat(response_format={"type": "xml"})).message.startswith("response_format.type 'xml' is not supported")
    assert bad(chat(response_format={"type": "json_object"}, guided_regex="a")).message == \
        "at most one of ['response_format', 'guided_regex'] may be given"
    assert "cannot be combined" in bad(chat(response_format={"type": "json_object"}, ignore_eos=True)).message


def test_stream_options_include_usage():
    assert parse(chat(stream=True, stream_options={"include_usage": True})).include_usage is True
    assert parse(chat(stream=True)).include_usage is False
    assert bad(chat(stream_options={"include_usage": True})).message == \
        "stream_options is only allowed with stream: true"


@pytest.mark.parametrize("name", ["functions", "audio", "prediction", "store"])
def test_fields_we_do_not_implement_are_named_as_not_supported(name):
    assert bad(chat(**{name: [{"x": 1}]})).message == f"field(s) ['{name}'] are not supported by this server"


def test_a_field_no_api_has_is_still_unknown():
    assert bad(chat(frobnicate=1)).message.startswith("unknown field(s) ['frobnicate']")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}


def test_tools_tool_choice_and_parallel_calls():
    request = parse(chat(tools=[WEATHER]))
    assert [t.name for t in request.tools] == ["get_weather"]
    assert request.tool_choice.mode == "auto" and request.parallel_tool_calls is True
    named = parse(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       parallel_tool_calls=False))
    assert (named.tool_choice.mode, named.tool_choice.name, named.parallel_tool_calls) == ("function", "get_weather", False)
    assert parse(chat(tools=[WEATHER], tool_choice="none")).tool_choice.mode == "none"
    assert bad(chat(tool_choice="required")).message == "tool_choice 'required' needs a non-empty tools list"
    assert bad(chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})).message == (
        "tool_choice 'required' and response_format both constrain the answer; give one")


def test_tool_messages_and_assistant_tool_calls():
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    request = parse({"messages": [{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": "Weather?"},
                                  {"role": "assistant", "content": None, "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "call_7", "content": "18 C"}], "tools": [WEATHER]})
    system, _, assistant, tool = request.messages
    assert system.role == "system"
    assert assistant.parts == () and assistant.tool_calls == (
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},)
    assert (tool.role, tool.tool_call_id, tool.parts[0].text) == ("tool", "call_7", "18 C")
    assert tool.template_extras() == {"tool_call_id": "call_7"}
    broken = dict(call, function={"name": "f", "arguments": "{oops"})
    assert bad({"messages": [{"role": "assistant", "tool_calls": [broken]}]}).message == (
        "messages[0].tool_calls[0].function.arguments is not valid JSON")
    assert bad({"messages": [{"role": "tool", "content": "x"}]}).message == "messages[0].tool_call_id must be str, got NoneType"
