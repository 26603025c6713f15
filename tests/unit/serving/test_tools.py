"""session/serving/tools.py: tools/tool_choice parsing, call formats, streaming hold-back, call grammars."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import transformers

from session.errors import BadRequest
from session.serving.tool_calls import ToolCall, parse_tool_calls, streamable_prefix
from session.serving.tool_fields import MAX_TOOLS, Tool, ToolChoice, parse_tool_choice, parse_tools
from session.serving.tool_format import ToolFormat, detect_tool_format, template_renders_tools
from session.serving.tool_grammar import tool_call_grammar
from session.serving.tool_prompt import call_text, tools_system_prompt
from session.serving.tools import ToolSupport, finish_reason
from session.types import Message, TextPart

MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / "smollm2-135m-instruct"
TEMPLATES = Path(__file__).parent / "templates"
CALL_ID_RE = re.compile(r"call_[0-9a-f]{24}")
MISTRAL_ID_RE = re.compile(r"[A-Za-z0-9]{9}")
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM_PARAMETERS = {
    "type": "object",
    "properties": {
        "hour": {"$ref": "#/$defs/hour"},
        "repeat": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["work", "home"]}, "maxItems": 2},
    },
    "required": ["hour"],
    "additionalProperties": False,
    "$defs": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
}
TOOLS = (Tool("get_weather", "Weather for a city", WEATHER_PARAMETERS), Tool("set_alarm", None, ALARM_PARAMETERS))
SCHEMAS = {tool.name: tool.parameters for tool in TOOLS}
REQUIRED = ToolChoice("required")


def raw_tool(name="get_weather", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def bad_request(call) -> str:
    with pytest.raises(BadRequest) as info:
        call()
    return info.value.message


def only_call(text: str, fmt: ToolFormat) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, fmt)
    ids = MISTRAL_ID_RE if fmt is ToolFormat.MISTRAL else CALL_ID_RE  # Mistral's templates take 9 alphanumerics
    assert all(ids.fullmatch(call.id) for call in calls)
    return content, [(call.name, call.arguments) for call in calls]


# ---------------------------------------------------------------- parse_tools / parse_tool_choice


def test_parse_tools_reads_every_field_and_defaults_the_parameters():
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = parse_tools([raw_tool("search", description="Web search", parameters=params, strict=True),
                         raw_tool("now-1")])
    assert tools == (Tool("search", "Web search", params, True),
                     Tool("now-1", None, {"type": "object", "properties": {}}, False))
    assert parse_tools(None) == () and parse_tools([]) == ()


@pytest.mark.parametrize("raw, message", [
    ({"type": "function"}, "tools must be a list of {type, function} objects, got dict"),
    (["x"], "tools[0] must be an object"),
    ([raw_tool(), {"type": "retrieval"}], "tools[1].type must be 'function', got 'retrieval'"),
    ([{"type": "function"}], "tools[0].function must be an object with a name"),
    ([raw_tool("a b")], "tools[0].function.name must be 1-64 letters, digits, '_' or '-', got 'a b'"),
    ([raw_tool("x" * 65)], f"tools[0].function.name must be 1-64 letters, digits, '_' or '-', got '{'x' * 65}'"),
    ([raw_tool(None)], "tools[0].function.name must be 1-64 letters, digits, '_' or '-', got None"),
    ([raw_tool(), raw_tool("f", description=3)], "tools[1].function.description must be a string"),
    ([raw_tool(parameters=[])], "tools[0].function.parameters must be an object (a JSON schema)"),
    ([raw_tool(strict="yes")], "tools[0].function.strict must be a boolean"),
    ([raw_tool("a"), raw_tool("b"), raw_tool("a")], "tools[2].function.name 'a' is already the name of tools[0]"),
])
def test_parse_tools_rejects_with_the_path(raw, message):
    assert bad_request(lambda: parse_tools(raw)) == message


def test_parse_tools_takes_at_most_128():
    assert len(parse_tools([raw_tool(f"f{i}") for i in range(MAX_TOOLS)])) == MAX_TOOLS
    raw = [raw_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]
    assert bad_request(lambda: parse_tools(raw)) == "tools has 129 entries; at most 128"


def test_parse_tool_choice_modes():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("auto", ()) == ToolChoice("none")
    assert parse_tool_choice("none", TOOLS) == ToolChoice("none")
    assert parse_tool_choice("required", TOOLS) == ToolChoice("required")
    forced = {"type": "function", "function": {"name": "set_alarm"}}
    assert parse_tool_choice(forced, TOOLS) == ToolChoice("function", "set_alarm")


@pytest.mark.parametrize("raw, tools, message", [
    ("any", TOOLS, "tool_choice must be one of ['none', 'auto', 'required'] or a function, got 'any'"),
    ("required", (), "tool_choice 'required' needs a non-empty tools list"),
    ({"type": "function", "function": {"name": "get_weather"}}, (),
     "tool_choice.function.name 'get_weather' is not among tools"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "tool_choice.function.name 'nope' is not among tools"),
    ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name must be a string"),
    ({"type": "function"}, TOOLS, "tool_choice.function.name must be a string"),
    ({"function": {"name": "get_weather"}}, TOOLS,
     "tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}"),
    (3, TOOLS, "tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}"),
])
def test_parse_tool_choice_rejects(raw, tools, message):
    assert bad_request(lambda: parse_tool_choice(raw, tools)) == message


def test_tool_and_call_shapes():
    assert TOOLS[0].to_template() == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_PARAMETERS}}
    assert TOOLS[1].to_template() == {"type": "function",
                                      "function": {"name": "set_alarm", "parameters": ALARM_PARAMETERS}}
    call = ToolCall("call_" + "a" * 24, "set_alarm", '{"hour": 7}')
    function = {"name": "set_alarm", "arguments": '{"hour": 7}'}
    assert call.to_openai() == {"id": "call_" + "a" * 24, "type": "function", "function": function}
    assert call.to_openai(index=1) == {"index": 1, "id": "call_" + "a" * 24, "type": "function", "function": function}


# ---------------------------------------------------------------- parse_tool_calls


HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HERMES_TWO = HERMES_ONE + '\n<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>'
PARIS = ("get_weather", '{"city": "Paris", "unit": "c"}')
SEVEN = ("set_alarm", '{"hour": 7}')
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
LLAMA_SEVEN = '{"name": "set_alarm", "parameters": {"hour": 7}}'


@pytest.mark.parametrize("text, content, calls", [
    (HERMES_ONE, None, [PARIS]),
    (HERMES_TWO, None, [PARIS, SEVEN]),
    ("Let me check.\n" + HERMES_ONE, "Let me check.", [PARIS]),
    (HERMES_ONE + "\nDone.", "Done.", [PARIS]),
    (HERMES_ONE[:-len("</tool_call>")], None, [PARIS]),  # closing tag missing at the end
    ('<tool_call>{"name":"set_alarm","arguments":{"hour":7}}', None, [SEVEN]),
    ('<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7\n</tool_call>\n' + HERMES_ONE,
     '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7\n</tool_call>', [PARIS]),
    ('<tool_call>\n{"name": "set_alarm"', '<tool_call>\n{"name": "set_alarm"', []),
    ('<tool_call>\n["set_alarm"]\n</tool_call>', '<tool_call>\n["set_alarm"]\n</tool_call>', []),
    ('<tool_call>\n{"name": "echo", "arguments": {"text": "</tool_call>"}}\n</tool_call>', None,
     [("echo", '{"text": "</tool_call>"}')]),
    ('<tool_call>\n{"name": "set_alarm", "arguments": "{\\"hour\\": 7}"}\n</tool_call>', None, [SEVEN]),
    ('<tool_call>\n{"name": "set_alarm"}\n</tool_call>', None, [("set_alarm", "{}")]),
    ('<tool_call>\n{"name": "w", "arguments": {"city": "Zürich"}}\n</tool_call>', None,
     [("w", '{"city": "Zürich"}')]),
    ("Just text.", "Just text.", []),
    ("  ", None, []),
])
def test_parse_hermes(text, content, calls):
    assert only_call(text, ToolFormat.HERMES) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None, [PARIS]),
    ('<|python_tag|>{"name": "set_alarm", "arguments": {"hour": 7}}', None, [SEVEN]),
    (LLAMA_ONE + "; " + LLAMA_SEVEN, None, [PARIS, SEVEN]),
    ('Checking.<|python_tag|>{"name": "set_alarm", "parameters": {"hour": 7}}', "Checking.", [SEVEN]),
    ('{"name": "set_alarm", "parameters": {"hour": 7', '{"name": "set_alarm", "parameters": {"hour": 7', []),
    (LLAMA_SEVEN + '; {"name": ', LLAMA_SEVEN + '; {"name":', []),
    ('{"answer": 4}', '{"answer": 4}', []),
    ("The answer is {4}.", "The answer is {4}.", []),
])
def test_parse_llama3_json(text, content, calls):
    assert only_call(text, ToolFormat.LLAMA3_JSON) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', None, [PARIS]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
     '{"name": "set_alarm", "arguments": {"hour": 7}, "id": "abcdefghi"}]', None, [PARIS, SEVEN]),
    ('Sure. [TOOL_CALLS] [{"name": "set_alarm", "arguments": {"hour": 7}}]', "Sure.", [SEVEN]),
    ('[TOOL_CALLS] [{"name": "set_alarm", "arguments": {"hour": 7}',
     '[TOOL_CALLS] [{"name": "set_alarm", "arguments": {"hour": 7}', []),
    ('[TOOL_CALLS] [{"name": "set_alarm", "arguments": {"hour": 7}}, 3]',
     '[TOOL_CALLS] [{"name": "set_alarm", "arguments": {"hour": 7}}, 3]', []),
    ('[TOOL_CALLS]set_alarm[ARGS]{"hour": 7}', None, [SEVEN]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]set_alarm[ARGS]{"hour": 7}', None,
     [PARIS, SEVEN]),
    ('[TOOL_CALLS]set_alarm[ARGS]{"hour": ', '[TOOL_CALLS]set_alarm[ARGS]{"hour":', []),
    ("No tools needed.", "No tools needed.", []),
])
def test_parse_mistral(text, content, calls):
    assert only_call(text, ToolFormat.MISTRAL) == (content, calls)


def test_call_ids_are_unique():
    _, calls = parse_tool_calls(HERMES_TWO * 50, ToolFormat.HERMES)
    assert len(calls) == 100 and len({call.id for call in calls}) == 100


# ---------------------------------------------------------------- streamable_prefix


@pytest.mark.parametrize("fmt, text, streamable", [
    (ToolFormat.HERMES, "Hello", 5),
    (ToolFormat.HERMES, "Hello <", 6),
    (ToolFormat.HERMES, "Hello <tool_ca", 6),
    (ToolFormat.HERMES, "Hello <tool_call>", 6),
    (ToolFormat.HERMES, 'Hello <tool_call>\n{"name"', 6),
    (ToolFormat.HERMES, "a <b", 4),  # "<b" can no longer become "<tool_call>"
    (ToolFormat.HERMES, "x </tool", 8),
    (ToolFormat.HERMES, "<tool_call>", 0),
    (ToolFormat.HERMES, "", 0),
    (ToolFormat.MISTRAL, "Sure [TOOL", 5),
    (ToolFormat.MISTRAL, "Sure [TOOL_CALLS] [", 5),
    (ToolFormat.MISTRAL, "a [b]", 5),
    (ToolFormat.LLAMA3_JSON, '{"name": "get', 0),
    (ToolFormat.LLAMA3_JSON, '  \n{', 0),
    (ToolFormat.LLAMA3_JSON, "  ", 0),  # may still turn out to be a call
    (ToolFormat.LLAMA3_JSON, "", 0),
    (ToolFormat.LLAMA3_JSON, "Hello {x}", 9),
    (ToolFormat.LLAMA3_JSON, "Hi <|python", 3),
    (ToolFormat.LLAMA3_JSON, "Hi <|python_tag|>{", 3),
])
def test_streamable_prefix(fmt, text, streamable):
    assert streamable_prefix(text, fmt) == streamable


# ---------------------------------------------------------------- templates


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.mark.parametrize("name, fmt", [
    ("qwen2.5-instruct.jinja", ToolFormat.HERMES),
    ("llama-3.1-instruct.jinja", ToolFormat.LLAMA3_JSON),
    ("mistral-7b-instruct-v0.3.jinja", ToolFormat.MISTRAL),
])
def test_real_templates_are_detected_and_render_the_tools(tokenizer, name, fmt):
    source = template(name)
    assert detect_tool_format(source) is fmt
    assert template_renders_tools(source)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOLS[0].to_template()], chat_template=source, tokenize=False)
    assert '"get_weather"' in text and '"maxLength": 8' in text


def test_templates_that_know_no_tools(tokenizer):
    assert detect_tool_format(None) is ToolFormat.HERMES
    assert detect_tool_format(tokenizer.chat_template) is ToolFormat.HERMES
    assert not template_renders_tools(tokenizer.chat_template)
    assert not template_renders_tools(None)
    assert not template_renders_tools("{# tools #}{{ 'use <tools> or tools' }} tools {{ messages[0].content }}")
    assert template_renders_tools("{% if tools is defined %}x{% endif %}")
    # Llama 3.2's template has no <|python_tag|>, only the JSON instructions and the ipython role
    assert detect_tool_format('{{- \'"parameters": \' }}{%- if message.role == "ipython" %}') is ToolFormat.LLAMA3_JSON


def test_tools_system_prompt_hermes_is_exact():
    prompt = tools_system_prompt((Tool("ping", None, {"type": "object", "properties": {}}),), ToolFormat.HERMES)
    assert prompt == (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>")


def test_tools_system_prompt_llama3_and_mistral_are_exact():
    ping = (Tool("ping", "Is it up?", {"type": "object", "properties": {}}),)
    schema = '{"type": "function", "function": {"name": "ping", "description": "Is it up?", ' \
             '"parameters": {"type": "object", "properties": {}}}}'
    assert tools_system_prompt(ping, ToolFormat.LLAMA3_JSON) == (
        "You have access to the following functions. To call a function, please respond with JSON for a function "
        'call. Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        "value}. Do not use variables.\n\n" + json.dumps(ping[0].to_template(), indent=4))
    assert tools_system_prompt(ping, ToolFormat.MISTRAL) == (
        f"You have access to the following functions:\n[{schema}]\n\n"
        "To call functions, respond with [TOOL_CALLS] followed by a JSON list of the calls: "
        '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]')


# ---------------------------------------------------------------- tool_call_grammar


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


def matcher(llg_tokenizer, grammar: str) -> llguidance.LLMatcher:
    # "grammar" is how the grammar compiler reads Lark (it would read GBNF too): both must work
    compiled = llguidance.LLMatcher(llg_tokenizer, llguidance.grammar_from("grammar", grammar), log_level=0)
    assert not compiled.is_error(), compiled.get_error()
    return compiled


def accepts(llg_tokenizer, tokenizer, grammar: str, text: str, prefix_ids: tuple[int, ...] = ()) -> bool:
    m = matcher(llg_tokenizer, grammar)
    return m.consume_tokens([*prefix_ids, *tokenizer.encode(text, add_special_tokens=False)]) and m.is_accepting()


def test_no_grammar_without_a_forced_call():
    assert tool_call_grammar(TOOLS, ToolChoice("auto"), ToolFormat.HERMES, True, {}) is None
    assert tool_call_grammar(TOOLS, ToolChoice("none"), ToolFormat.HERMES, True, {}) is None


def test_the_hermes_grammar_text():
    ping = Tool("ping", None, {"type": "object", "properties": {}})
    style = ('"x-guidance": {"whitespace_flexible": false, "item_separator": ", ?", "key_separator": ": ?", '
             '"lenient": true}')
    assert tool_call_grammar((ping,), REQUIRED, ToolFormat.HERMES, True, {"</tool_call>": 9}) == (
        "%llguidance {}\n"
        'start: call ("\\n" call)*\n'
        'call: "<tool_call>" "\\n" function "\\n" <[9]>\n'
        "function: function_0\n"
        'function_0: "{\\"name\\": \\"ping\\", \\"arguments\\": " arguments_0 "}"\n'
        'arguments_0: %json {"type": "object", "properties": {}, ' + style + "}\n")


@pytest.mark.parametrize("fmt, one, two", [
    (ToolFormat.HERMES, HERMES_ONE, HERMES_TWO),
    (ToolFormat.LLAMA3_JSON, LLAMA_ONE, LLAMA_ONE + "; " + LLAMA_SEVEN),
])
def test_grammar_accepts_valid_calls_and_parallel_only_when_asked(llg_tokenizer, tokenizer, fmt, one, two):
    single = tool_call_grammar(TOOLS, REQUIRED, fmt, False, {})
    parallel = tool_call_grammar(TOOLS, REQUIRED, fmt, True, {})
    assert accepts(llg_tokenizer, tokenizer, single, one)
    assert not accepts(llg_tokenizer, tokenizer, single, two)
    assert accepts(llg_tokenizer, tokenizer, parallel, one)
    assert accepts(llg_tokenizer, tokenizer, parallel, two)


def test_grammar_holds_arguments_to_the_schema(llg_tokenizer, tokenizer):
    grammar = tool_call_grammar(TOOLS, REQUIRED, ToolFormat.HERMES, False, {})

    def call(name: str, arguments: str) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'

    assert accepts(llg_tokenizer, tokenizer, grammar, call("set_alarm", '{"hour":23,"repeat":true,"tags":["home"]}'))
    assert accepts(llg_tokenizer, tokenizer, grammar, call("get_weather", '{"city": "Oslo", "unit": "f", "days": 3}'))
    for name, arguments in [
        ("set_alarm", '{"hour": "7"}'),  # a string where an integer is required
        ("set_alarm", '{"hour": 24}'),  # out of the $ref'd range
        ("set_alarm", '"hour"'),  # a string where the object is required
        ("set_alarm", "{}"),  # "hour" is required
        ("get_weather", '{"city": "Oslo", "unit": "k"}'),  # not in the enum
        ("get_weather", '{"unit": "c", "city": "Oslo"}'),  # llguidance keeps the schema's property order
        ("get_weather", '{"city": "Oslo", "unit": "c", "wind": 1}'),  # additionalProperties: false
        ("get_weather", '{ "city": "Oslo", "unit": "c"}'),  # no free whitespace
        ("get_time", "{}"),  # not a tool
    ]:
        assert not accepts(llg_tokenizer, tokenizer, grammar, call(name, arguments)), (name, arguments)


def test_grammar_for_a_named_function_refuses_the_others(llg_tokenizer, tokenizer):
    grammar = tool_call_grammar(TOOLS, ToolChoice("function", "set_alarm"), ToolFormat.LLAMA3_JSON, False, {})
    assert accepts(llg_tokenizer, tokenizer, grammar, LLAMA_SEVEN)
    assert not accepts(llg_tokenizer, tokenizer, grammar, LLAMA_ONE)


def test_grammar_uses_special_tokens_by_id(llg_tokenizer, tokenizer):
    # SmolLM2 has no [TOOL_CALLS]; its special tokens <reponame> (4) and <file_sep> (5) stand in
    calls, args = 4, 5
    mistral = tool_call_grammar(TOOLS, REQUIRED, ToolFormat.MISTRAL, True, {"[TOOL_CALLS]": calls})
    two = ' [{"name": "set_alarm", "arguments": {"hour": 7}}, {"name": "set_alarm", "arguments": {"hour": 8}}]'
    assert accepts(llg_tokenizer, tokenizer, mistral, two, (calls,))
    assert accepts(llg_tokenizer, tokenizer, mistral, two.lstrip(), (calls,))
    assert not accepts(llg_tokenizer, tokenizer, mistral, "[TOOL_CALLS]" + two)  # the text is not the token
    newer = tool_call_grammar(TOOLS, REQUIRED, ToolFormat.MISTRAL, False, {"[TOOL_CALLS]": calls, "[ARGS]": args})
    m = matcher(llg_tokenizer, newer)
    ids = [calls, *tokenizer.encode("set_alarm", add_special_tokens=False), args,
           *tokenizer.encode('{"hour": 7}', add_special_tokens=False)]
    assert m.consume_tokens(ids) and m.is_accepting()


def test_the_matcher_stops_when_the_calls_are_complete(llg_tokenizer, tokenizer):
    m = matcher(llg_tokenizer, tool_call_grammar(TOOLS, REQUIRED, ToolFormat.HERMES, False, {}))
    assert m.consume_tokens(tokenizer.encode(HERMES_ONE, add_special_tokens=False))
    # nothing can follow one call: stopped already, and EOS is the only token the mask allows
    assert m.is_stopped() and allowed_ids(m, llg_tokenizer.vocab_size) == [tokenizer.eos_token_id]
    assert m.consume_token(tokenizer.eos_token_id)


# ---------------------------------------------------------------- sampling under the mask


def allowed_ids(m: llguidance.LLMatcher, vocab_size: int) -> list[int]:
    return np.flatnonzero(allowed_mask(m, vocab_size)).tolist()


def allowed_mask(m: llguidance.LLMatcher, vocab_size: int) -> np.ndarray:
    words = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)  # bit j of 32-bit word w is token 32w+j
    return np.unpackbits(words, bitorder="little")[:vocab_size].astype(bool)


def sample_answer(m: llguidance.LLMatcher, vocab_size: int, rng: np.random.Generator,
                  max_tokens: int = 300) -> list[int]:
    """Random logits, masked: each step draws uniformly among the tokens the grammar allows."""
    ids: list[int] = []
    while not m.is_stopped() and len(ids) < max_tokens:
        logits = np.where(allowed_mask(m, vocab_size), rng.standard_normal(vocab_size), -np.inf)
        token = int(np.argmax(logits))
        assert m.consume_token(token)
        ids.append(token)
    return ids


def decode(llg_tokenizer, ids: list[int], eos_id: int, markers: dict[int, str]) -> str:
    """The answer's text, special tokens written as their markers, EOS dropped."""
    pieces, run = [], []
    for token in ids + [eos_id]:
        if token in markers or token == eos_id:
            pieces.append(llg_tokenizer.decode_str(run))
            pieces.append(markers.get(token, ""))
            run = []
        else:
            run.append(token)
    return "".join(pieces)


@pytest.mark.parametrize("fmt, special_token_ids", [
    (ToolFormat.HERMES, {}),
    (ToolFormat.LLAMA3_JSON, {}),
    (ToolFormat.MISTRAL, {"[TOOL_CALLS]": 4}),
    (ToolFormat.MISTRAL, {"[TOOL_CALLS]": 4, "[ARGS]": 5}),
])
def test_random_answers_under_the_mask_parse_into_valid_calls(llg_tokenizer, tokenizer, fmt, special_token_ids):
    grammar = tool_call_grammar(TOOLS, REQUIRED, fmt, True, special_token_ids)
    compiled = matcher(llg_tokenizer, grammar)
    markers = {token_id: text for text, token_id in special_token_ids.items()}
    rng = np.random.default_rng(0)
    num_calls = 0
    for _ in range(20):
        m = compiled.deep_copy()
        ids = sample_answer(m, llg_tokenizer.vocab_size, rng)
        assert m.is_stopped(), decode(llg_tokenizer, ids, tokenizer.eos_token_id, markers)
        text = decode(llg_tokenizer, ids, tokenizer.eos_token_id, markers)
        content, calls = parse_tool_calls(text, fmt)
        assert content is None and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        num_calls += len(calls)
    assert num_calls > 20  # parallel answers did happen


# ---------------------------------------------------------------- one served model (ToolSupport)


TEMPLATE_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Oslo", "unit": "c"}}}


def test_support_of_a_template_that_knows_no_tools_describes_them_and_writes_calls_as_text():
    support = ToolSupport.of("{{ messages }}", {})
    assert (support.fmt, support.renders_tools) == (ToolFormat.HERMES, False)
    history = (Message("user", (TextPart("weather?"),)), Message("assistant", (), tool_calls=(TEMPLATE_CALL,)),
               Message("tool", (TextPart("3 C"),), tool_call_id="call_1"))
    messages, template_tools = support.prompt(history, TOOLS, opening=True)
    assert template_tools is None
    assert messages[0] == Message("system", (TextPart(tools_system_prompt(TOOLS, ToolFormat.HERMES)),))
    assert messages[2] == Message("assistant", (TextPart(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'),))
    assert messages[3] == Message("user", (TextPart("<tool_response>\n3 C\n</tool_response>"),))
    with_system = (Message("system", (TextPart("Be brief."),)), *history[:1])
    assert support.prompt(with_system, TOOLS, opening=True)[0][0].parts == (
        TextPart("Be brief."), TextPart("\n\n" + tools_system_prompt(TOOLS, ToolFormat.HERMES)))
    follow_up, _ = support.prompt(history[1:], TOOLS, opening=False)
    assert [m.role for m in follow_up] == ["assistant", "user"]  # no second tools description


def test_support_of_a_template_that_renders_tools_hands_them_over_in_an_opening_only():
    support = ToolSupport.of((TEMPLATES / "qwen2.5-instruct.jinja").read_text(), {})
    assert (support.fmt, support.renders_tools) == (ToolFormat.HERMES, True)
    history = (Message("user", (TextPart("weather?"),)),)
    messages, template_tools = support.prompt(history, TOOLS, opening=True)
    assert messages == history and template_tools == [tool.to_template() for tool in TOOLS]
    assert support.prompt(history, TOOLS, opening=False) == (history, None)


def test_support_grammar_answer_and_finish_reason():
    support = ToolSupport.of("{{ messages }}", {})
    assert support.grammar(TOOLS, ToolChoice("auto"), True) is None
    constraint = support.grammar(TOOLS, REQUIRED, False)
    assert (constraint.kind, constraint.what) == ("lark", "tools")
    assert constraint.source == tool_call_grammar(TOOLS, REQUIRED, ToolFormat.HERMES, False, {})
    text = '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>'
    assert support.answer(text, ToolChoice("none")) == (text, [])
    content, [call] = support.answer(text, ToolChoice("auto"))
    assert content is None and (call.name, json.loads(call.arguments)) == ("set_alarm", {"hour": 7})
    cut = text + '\n<tool_call>\n{"name": "set_al'
    content, calls = support.answer(cut, REQUIRED)  # a forced answer cut by max_tokens: its whole calls only
    assert content is None and [c.name for c in calls] == ["set_alarm"]
    assert support.answer(cut, ToolChoice("auto"))[0] == '<tool_call>\n{"name": "set_al'  # auto: the rest is content
    assert finish_reason("stop", [call], ToolChoice("auto")) == "tool_calls"
    assert finish_reason("stop", [call], ToolChoice("function", "set_alarm")) == "stop"  # OpenAI's, for a named call
    assert finish_reason("length", [call], REQUIRED) == "length"
    assert finish_reason("stop", [], ToolChoice("auto")) == "stop"


@pytest.mark.parametrize("fmt, expected", [
    (ToolFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'),
    (ToolFormat.MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]'),
])
def test_call_text_is_what_each_format_parses_back(fmt, expected):
    assert call_text((TEMPLATE_CALL,), fmt) == expected
    _, [call] = parse_tool_calls(expected, fmt)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo", "unit": "c"})
