"""Tool calls and ``n`` on a real checkpoint (SmolLM2-135M-Instruct) through the invocation service.

SmolLM2's own template knows no tools: they are described in the system message and calls are
Hermes' ``<tool_call>`` JSON. The same weights with Qwen2.5's template (which renders ``tools`` and
tool messages itself) check the template path. ``tool_choice`` "required" and a named function are
held by the grammar: arguments always parse and validate, and under greedy decoding the calls equal
transformers' ``generate`` with llguidance's mask, token for token."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import LogitsProcessorList

from session.families.vision import NO_IMAGES
from session.serving.chat_request import parse_request
from tests.conftest import REPO, chat_service
from tests.integration.test_structured_output import NEW, SESSION, GrammarProcessor, call, session_tokens

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
QWEN_TEMPLATE = REPO / "tests" / "unit" / "serving" / "templates" / "qwen2.5-instruct.jinja"


@pytest.fixture(scope="module")
def checkpoint(smollm2_path):
    return smollm2_path


@pytest.fixture(scope="module")
def service(checkpoint):
    with chat_service(checkpoint) as chat:
        yield chat


def with_template(checkpoint, folder, template):
    """The same weights and vocabulary in ``folder``, with another family's chat template."""
    folder.mkdir(exist_ok=True)
    for path in checkpoint.iterdir():
        if path.name != "chat_template.jinja":
            (folder / path.name).symlink_to(path)
    (folder / "chat_template.jinja").write_text(template.read_text())
    return folder


@pytest.fixture(scope="module")
def qwen_service(checkpoint, tmp_path_factory):
    """SmolLM2 with Qwen2.5's chat template (tools rendered by the template)."""
    with chat_service(with_template(checkpoint, tmp_path_factory.mktemp("smollm2-qwen-template"), QWEN_TEMPLATE)) as chat:
        yield chat


def calls_of(body: dict) -> list[dict]:
    message = body["choices"][0]["message"]
    for entry in message.get("tool_calls", []):
        assert entry["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", entry["id"])
        jsonschema.validate(json.loads(entry["function"]["arguments"]), SCHEMAS[entry["function"]["name"]])
    return message.get("tool_calls", [])


def reference_call(service, checkpoint, grammar_text: str, prompt: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    eos = service.engine.parts.runner.info.eos_token_ids
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=model.config.vocab_size, eos_token=list(eos))
    processor = GrammarProcessor(tokenizer, llguidance.grammar_from("grammar", grammar_text), len(prompt))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             logits_processor=LogitsProcessorList([processor]))
    return out[0, len(prompt):].tolist()


def test_required_calls_validate_and_equal_transformers_under_the_same_grammar(service, checkpoint):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 80}
    status, answer, headers = call(service, body, {SESSION: "NEW_SESSION"})
    assert status == 200, answer
    calls = calls_of(answer)
    assert calls and answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["choices"][0]["message"]["content"] is None
    session_id = headers[NEW].split(";")[0]
    prompt, generated = session_tokens(service, session_id, answer["usage"])
    text = service.engine.parts.tokenizer.decode(prompt)
    assert "# Tools" in text and '"name": "get_weather"' in text  # the tools, described in the system message
    request = parse_request(json.dumps(body), {}, default_max_tokens=64, max_new_tokens=256)
    grammar = service.tool_support().grammar(request.tools, request.tool_choice, request.parallel_tool_calls)
    assert generated == reference_call(service, checkpoint, grammar.source, prompt, 80)


def test_a_named_function_is_the_one_call_and_ends_as_stop(service):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 60, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    status, answer, _ = call(service, body)
    assert status == 200, answer
    assert [c["function"]["name"] for c in calls_of(answer)] == ["get_time"]
    assert answer["choices"][0]["finish_reason"] == "stop"  # as OpenAI ends a named tool_choice


def test_streamed_calls_are_deltas_equal_to_the_plain_answer(service):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 80}
    _, plain, _ = call(service, body)
    status, text, _ = call(service, {**body, "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == list(range(len(streamed)))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls_of(plain)]
    assert not any(d.get("content") for d in deltas)  # a forced answer is calls only
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert text.endswith("data: [DONE]\n\n")


def test_tool_results_come_back_stateless_and_in_a_session(service):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80}
    status, first, headers = call(service, body, {SESSION: "NEW_SESSION"})
    assert status == 200, first
    session_id = headers[NEW].split(";")[0]
    [made] = calls_of(first)[:1]
    result = {"role": "tool", "tool_call_id": made["id"], "content": "18 degrees, sunny"}
    status, follow, _ = call(service, {"messages": [result], "tools": [WEATHER], "max_tokens": 24},
                             {SESSION: session_id})
    assert status == 200, follow
    prompt, _ = session_tokens(service, session_id, follow["usage"])
    transcript = service.engine.parts.tokenizer.decode(prompt)
    assert transcript.endswith("<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert "</tool_call>" in transcript  # the call the model wrote is in its transcript as it wrote it

    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls_of(first)}, result]
    status, stateless, _ = call(service, {"messages": history, "tools": [WEATHER], "max_tokens": 24})
    assert status == 200, stateless
    rendered = service.engine.render_turn(*service.tool_support().prompt(
        parse_request(json.dumps({"messages": history}), {}, default_max_tokens=8, max_new_tokens=8).messages,
        parse_request(json.dumps({"messages": ASK, "tools": [WEATHER]}), {}, default_max_tokens=8,
                      max_new_tokens=8).tools, True)[:1], NO_IMAGES, True)
    text = service.engine.parts.tokenizer.decode(rendered.opening.token_ids)
    arguments = json.loads(made["function"]["arguments"])
    assert (f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": arguments})}\n</tool_call>'
            in text)
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert stateless["usage"]["prompt_tokens"] == len(rendered.opening.token_ids)


def test_a_template_that_renders_tools_gets_them_and_their_results(qwen_service):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 80}
    status, first, headers = call(qwen_service, body, {SESSION: "NEW_SESSION"})
    assert status == 200, first
    calls = calls_of(first)
    assert calls and first["choices"][0]["finish_reason"] == "tool_calls"
    session_id = headers[NEW].split(";")[0]
    prompt, _ = session_tokens(qwen_service, session_id, first["usage"])
    text = qwen_service.engine.parts.tokenizer.decode(prompt)
    assert "<tools>\n" + json.dumps(WEATHER) in text  # Qwen's own rendering of the tools
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C"}
    status, follow, _ = call(qwen_service, {"messages": [result], "tools": [WEATHER, TIME], "max_tokens": 16},
                             {SESSION: session_id})
    assert status == 200, follow
    prompt, _ = session_tokens(qwen_service, session_id, follow["usage"])
    assert qwen_service.engine.parts.tokenizer.decode(prompt).endswith(
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_auto_answers_are_content_or_valid_calls(service):
    questions = ["What is the weather in Rome?", "Tell me a joke.", "What time is it in Tokyo?", "Hi!"]
    for question in questions:
        status, answer, _ = call(service, {"messages": [{"role": "user", "content": question}],
                                           "tools": [WEATHER, TIME], "max_tokens": 60, "temperature": 1, "seed": 3})
        assert status == 200, answer
        choice = answer["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            assert calls_of(answer)
        else:
            assert "tool_calls" not in choice["message"] and "<tool_call>" not in (choice["message"]["content"] or "")\
                or choice["finish_reason"] == "length"


def test_n_answers_one_prompt_in_one_batch(service):
    body = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12, "n": 3,
            "temperature": 1.0, "seed": 11}
    status, answer, _ = call(service, body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in answer["choices"]]
    singles = [call(service, {**body, "n": 1, "seed": 11 + i})[1]["choices"][0]["message"]["content"]
               for i in range(3)]
    assert texts == singles  # row i samples with seed + i
    tokens = [call(service, {**body, "n": 1, "seed": 11 + i})[1]["usage"]["completion_tokens"] for i in range(3)]
    assert answer["usage"]["completion_tokens"] == sum(tokens)

    status, text, _ = call(service, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    streamed = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                        if c["choices"] and c["choices"][0]["index"] == i) for i in range(3)]
    assert streamed == texts
    assert chunks[-1]["usage"]["completion_tokens"] == sum(tokens)


def test_n_rows_share_a_long_prompts_prefill(service):
    long_question = "Here is a list: " + ", ".join(f"item {i}" for i in range(150)) + ". Which is first?"
    body = {"messages": [{"role": "user", "content": long_question}], "max_tokens": 4, "n": 2}
    status, answer, _ = call(service, body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] > 256
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256  # row 1 found row 0's blocks
    first, second = (c["message"]["content"] for c in answer["choices"])
    assert first == second  # greedy


def test_n_in_a_session_is_a_400(service):
    status, body, _ = call(service, {"messages": ASK, "n": 2}, {SESSION: "NEW_SESSION"})
    assert status == 400 and body["error"]["message"].startswith("n > 1 cannot be used in a session")


@pytest.mark.parametrize("template, fmt, marker", [("llama-3.1-instruct.jinja", "llama3_json", '"parameters": '),
                                                   ("mistral-7b-instruct-v0.3.jinja", "mistral", "[TOOL_CALLS]")])
def test_llama3_and_mistral_templates_render_tools_and_their_calls_parse(checkpoint, tmp_path, template, fmt, marker):
    with chat_service(with_template(checkpoint, tmp_path / "model", QWEN_TEMPLATE.parent / template)) as chat:
        support = chat.tool_support()
        assert (support.fmt.value, support.renders_tools) == (fmt, True)
        body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 80,
                "parallel_tool_calls": False}
        status, answer, headers = call(chat, body, {SESSION: "NEW_SESSION"})
        assert status == 200, answer
        [made] = calls_of(answer)
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
        prompt, generated = session_tokens(chat, headers[NEW].split(";")[0], answer["usage"])
        tokenizer = chat.engine.parts.tokenizer
        assert '"name": "get_weather"' in tokenizer.decode(prompt)  # the template rendered the tools
        assert marker in tokenizer.decode(generated) or fmt == "llama3_json"
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [made]},
                         {"role": "tool", "tool_call_id": made["id"], "name": made["function"]["name"],
                          "content": "18 C"}]
        status, follow, _ = call(chat, {"messages": history, "tools": [WEATHER, TIME], "max_tokens": 8})
        assert status == 200, follow
