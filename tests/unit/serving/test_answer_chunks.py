"""How the chat service shapes a stream with tools (``_ChatAnswer.chunks``): content goes out as it comes
until what may be a tool call, which is settled when the answer is finished."""

from __future__ import annotations

from session.engine.events import Finished, TextDelta
from session.serving.answer_bodies import CompletionIds
from session.serving.answers import _ChatAnswer
from session.serving.row_streams import _Choice
from session.serving.tools import ToolSupport
from session.types import Usage
from tests.unit.serving.test_protocol import chat, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
IDS = CompletionIds(model="m", id="chatcmpl-1", created=1)
USAGE = Usage(prompt_tokens=3, completion_tokens=9, cached_tokens=0)


def answer_for(**fields) -> _ChatAnswer:
    return _ChatAnswer(parse(chat(tools=[WEATHER], **fields)), ToolSupport.of("{{ messages }}", {}))


def run(pieces: list[str], finish_reason: str = "stop", **fields) -> list[dict]:
    answer = answer_for(stream=True, **fields)
    choice = _Choice(index=0, stream=None, request_id="r")
    events = [TextDelta(piece) for piece in pieces] + [finished(pieces, finish_reason)]
    return [c["choices"][0] for event in events for c in answer.chunks(choice, event, IDS, lambda e: None)]


def finished(pieces: list[str], finish_reason: str = "stop") -> Finished:
    return Finished(session_id=None, text="".join(pieces), token_ids=(), finish_reason=finish_reason, usage=USAGE)


def streamed_message(out: list[dict]) -> tuple[str | None, list[str]]:
    """The message a client puts together from the stream's deltas: (content, called function names)."""
    content = "".join(c["delta"].get("content") or "" for c in out) or None
    return content, [call["function"]["name"] for c in out for call in c["delta"].get("tool_calls", [])]


def plain_message(pieces: list[str], finish_reason: str = "stop", **fields) -> tuple[str | None, list[str]]:
    message = answer_for(**fields).choice(0, finished(pieces, finish_reason), lambda e: None)["message"]
    return message["content"], [call["function"]["name"] for call in message.get("tool_calls") or []]


def test_content_before_a_call_streams_and_the_call_comes_whole_at_the_end():
    out = run(["Let me check. <to", "ol_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}",
               "\n</tool_call>"])
    assert [c["delta"] for c in out[:-2]] == [{"content": "Let me check. "}]  # "<to" held: it may start a call
    [call] = out[-2]["delta"]["tool_calls"]
    assert (call["index"], call["function"]) == (0, {"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    assert out[-1] == {"index": 0, "delta": {}, "finish_reason": "tool_calls"}


def test_text_that_only_looked_like_a_call_is_sent_at_the_end():
    out = run(["a <to", "ast> b"])
    assert "".join(c["delta"].get("content", "") for c in out) == "a <toast> b"
    assert out[-1]["finish_reason"] == "stop"


def test_a_forced_call_holds_everything():
    out = run(['<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'], tool_choice="required")
    assert [list(c["delta"]) for c in out] == [["tool_calls"], []]
    assert out[-1]["finish_reason"] == "tool_calls"


CUT_CALL = ['<tool_call>\n{"name": "get_', 'weather", "argu']  # max_tokens ended it inside the call


def test_a_forced_call_cut_short_streams_no_markup_as_content():
    """As the plain answer has it: no content, no call, finish_reason "length" (the stream used to send
    the cut call's markup as content)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = run(CUT_CALL, finish_reason="length", tool_choice=choice)
        assert out == [{"index": 0, "delta": {}, "finish_reason": "length"}]
        assert streamed_message(out) == plain_message(CUT_CALL, "length", tool_choice=choice) == (None, [])


def test_a_call_cut_short_in_auto_mode_streams_its_markup_as_the_plain_answer_has_it():
    out = run(["Checking. "] + CUT_CALL, finish_reason="length")
    assert streamed_message(out) == plain_message(["Checking. "] + CUT_CALL, "length")
    assert streamed_message(out)[0] == 'Checking. <tool_call>\n{"name": "get_weather", "argu'


def test_text_after_a_call_streams_as_the_plain_answer_has_it():
    pieces = ["Sure. ", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', " Done."]
    out = run(pieces)
    assert streamed_message(out) == plain_message(pieces) == ("Sure.  Done.", ["get_weather"])
    assert [list(c["delta"]) for c in out] == [["content"], ["content"], ["tool_calls"], []]
