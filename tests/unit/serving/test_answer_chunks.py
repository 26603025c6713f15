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


def run(pieces: list[str], **fields) -> list[dict]:
    answer = _ChatAnswer(parse(chat(tools=[WEATHER], stream=True, **fields)), ToolSupport.of("{{ messages }}", {}))
    choice = _Choice(index=0, stream=None, request_id="r")
    deltas = []
    for piece in pieces:
        deltas += [c["choices"][0] for c in answer.chunks(choice, TextDelta(piece), IDS, lambda e: None)]
    finished = Finished(session_id=None, text="".join(pieces), token_ids=(), finish_reason="stop", usage=USAGE)
    return deltas + [c["choices"][0] for c in answer.chunks(choice, finished, IDS, lambda e: None)]


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
