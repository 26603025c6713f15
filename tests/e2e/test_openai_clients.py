"""The client libraries applications use, against ``python -m launch serve`` of SmolLM2-135M-Instruct:
the openai SDK (structured output, ``parse``, tools, streamed tool calls, tool results, n, logprobs,
/v1/completions, its typed errors), langchain-openai (``with_structured_output`` both ways,
``bind_tools``) and litellm (json_object, tools). SmolLM2 answers poorly, but a forced answer (a JSON
schema, a tool-call grammar) must always be valid: the tests assert validity, not meaning. The schemas
are bounded (short strings, enums, no extra keys) so that each answer ends well within max_tokens.
One server start."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.conftest import REPO
from tests.e2e.serving import launched_serve

pytestmark = pytest.mark.e2e

MAX_TOKENS = 96  # a forced answer here ends in under 80 tokens; a cut one would not parse

PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                   "category": {"type": "string", "enum": ["book", "toy", "food"]},
                   "in_stock": {"type": "boolean"}},
    "required": ["name", "category", "in_stock"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "minLength": 1, "maxLength": 20}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                      "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}  # tool name -> its schema
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_PRODUCT = [{"role": "user", "content": "Describe a product from a shop as JSON."}]


class Product(BaseModel):
    """A product in a shop."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict mode requires

    name: str = Field(min_length=1, max_length=20)
    category: Literal["book", "toy", "food"]
    in_stock: bool


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(min_length=1, max_length=20)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def served_model() -> tuple[str, str]:
    """(path, served name) of the SmolLM2 checkpoint, built once by ``make models``."""
    from model_store.build_smollm2 import build

    path = build(REPO / "models")
    return str(path), path.name


@pytest.fixture(scope="module")
def served(served_model, tmp_path_factory):
    """The /v1 URL of a running ``python -m launch serve`` of SmolLM2."""
    with launched_serve(tmp_path_factory.mktemp("serve"), MODEL=served_model[0], RESIDENT_SPECULATIVE="off") as url:
        yield url + "/v1"


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served, api_key="x", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(served_model) -> str:
    return served_model[1]


def chat(client: openai.OpenAI, model: str, **kwargs):
    return client.chat.completions.create(**{"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **kwargs})


def assert_valid_call(call, tool_names: set[str]) -> None:
    """A tool call the SDK typed: a known function whose arguments are JSON matching its parameters."""
    assert call.type == "function" and call.id
    assert call.function.name in tool_names
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# ---------------------------------------------------------------- openai SDK


def test_models_list_has_the_served_name(client, model):
    [listed] = client.models.list().data
    assert (listed.id, listed.owned_by) == (model, "resident")
    assert listed.model_extra["max_model_len"] == 8192  # SmolLM2's max_position_embeddings


def test_strict_json_schema_answer_validates(client, model):
    answer = chat(client, model, messages=ASK_PRODUCT, response_format={
        "type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT_SCHEMA, "strict": True}})
    [choice] = answer.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PRODUCT_SCHEMA)


def test_parse_returns_the_pydantic_model(client, model):
    answer = client.chat.completions.parse(model=model, messages=ASK_PRODUCT, max_tokens=MAX_TOKENS,
                                           temperature=0, response_format=Product)
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, Product)
    assert parsed == Product.model_validate_json(answer.choices[0].message.content)


def test_required_tool_choice_answers_one_valid_call(client, model):
    answer = chat(client, model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False)
    [choice] = answer.choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert_valid_call(call, set(PARAMETERS))


def test_required_tool_choice_with_parallel_calls_answers_valid_calls(client, model):
    """parallel_tool_calls left at its default (true), as langchain and litellm send it: SmolLM2 calls
    both tools and stops within 80 tokens (64 cut it: "length"); each call is valid."""
    answer = chat(client, model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required")
    [choice] = answer.choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call, set(PARAMETERS))
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client, model):
    answer = chat(client, model, messages=ASK_WEATHER, tools=TOOLS, parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    [choice] = answer.choices
    assert choice.finish_reason == "stop"  # OpenAI ends a call the request named as "stop"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_call(call, {"get_time"})


def test_streamed_tool_call_accumulates_to_the_same_function(client, model):
    request = {"messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
               "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.chat.completions.create(model=model, **request).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(model=model, stream_options={"include_usage": True}, **request) as stream:
        event_types = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in event_types
    [choice] = final.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == whole.function.name
    assert_valid_call(call, set(PARAMETERS))
    assert final.usage.completion_tokens > 0


def test_a_tool_result_turn_is_answered(client, model):
    first = chat(client, model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False).choices[0].message
    [call] = first.tool_calls
    messages = [*ASK_WEATHER, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "c"})}]
    answer = chat(client, model, messages=messages, tools=TOOLS, max_tokens=24)
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0


def test_n_seeded_samples_are_two_choices_and_repeat(client, model):
    request = {"messages": [{"role": "user", "content": "Name a colour."}], "n": 2, "temperature": 1, "seed": 3,
               "max_tokens": 12}
    first = client.chat.completions.create(model=model, **request)
    again = client.chat.completions.create(model=model, **request)
    assert [choice.index for choice in first.choices] == [0, 1]
    assert all(choice.message.content for choice in first.choices)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_logprobs_give_two_top_alternatives_per_token(client, model):
    answer = chat(client, model, messages=ASK_WEATHER, logprobs=True, top_logprobs=2, max_tokens=6)
    [choice] = answer.choices
    entries = choice.logprobs.content
    assert len(entries) == answer.usage.completion_tokens > 0
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_completions_answer_text_and_echo_the_prompt(client, model):
    prompt = "The capital of France is"
    [plain] = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices
    [echoed] = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, echo=True).choices
    assert plain.text and plain.finish_reason in ("stop", "length")
    assert echoed.text == prompt + plain.text


def test_completions_suffix_is_a_bad_request_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="def add(a, b):", suffix="x", max_tokens=8)
    assert refused.value.status_code == 400
    assert "suffix" in refused.value.message


def refusals_of_an_unknown_model(client) -> list[openai.NotFoundError]:
    with pytest.raises(openai.NotFoundError) as chat_refused:
        client.chat.completions.create(model="nope", messages=ASK_WEATHER, max_tokens=4)
    with pytest.raises(openai.NotFoundError) as completion_refused:
        client.completions.create(model="nope", prompt="Hello", max_tokens=4)
    return [chat_refused.value, completion_refused.value]


def test_an_unknown_model_is_not_found(client):
    for refused in refusals_of_an_unknown_model(client):
        assert refused.status_code == 404 and "nope" in refused.message


def test_an_unknown_model_error_carries_openai_code(client):
    """OpenAI's 404 says ``"code": "model_not_found"`` (the SDK's ``.code``); GET /v1/models/nope here does."""
    for refused in refusals_of_an_unknown_model(client):
        assert refused.code == "model_not_found"


# ---------------------------------------------------------------- langchain-openai


@pytest.fixture(scope="module")
def langchain_chat(served, model):
    """(ChatOpenAI, the request bodies it sent): the bodies say which method the library chose."""
    from langchain_openai import ChatOpenAI

    sent: list[dict] = []
    http_client = httpx.Client(timeout=180, event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]})
    llm = ChatOpenAI(base_url=served, api_key="x", model=model, temperature=0, max_tokens=MAX_TOKENS,
                     max_retries=0, http_client=http_client)
    yield llm, sent
    http_client.close()


def test_langchain_structured_output_by_json_schema(langchain_chat):
    llm, sent = langchain_chat
    product = llm.with_structured_output(Product).invoke("Describe a product from a shop.")
    assert isinstance(product, Product)
    assert sent[-1]["response_format"]["type"] == "json_schema"  # the installed version's default method


def test_langchain_structured_output_by_function_calling(langchain_chat):
    llm, sent = langchain_chat
    product = llm.with_structured_output(Product, method="function_calling").invoke("Describe a product from a shop.")
    assert isinstance(product, Product)
    assert sent[-1]["tool_choice"] == {"type": "function", "function": {"name": "Product"}}


def test_langchain_bound_tool_is_called_with_valid_args(langchain_chat):
    from langchain_core.tools import tool

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm, sent = langchain_chat
    # strict: langchain drops the schema's additionalProperties otherwise, and SmolLM2 then adds keys
    answer = llm.bind_tools([get_weather], tool_choice="any", strict=True).invoke("What is the weather in Paris?")
    assert sent[-1]["tool_choice"] == "required"
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"
    for call in answer.tool_calls:
        WeatherArgs.model_validate(call["args"])


# ---------------------------------------------------------------- litellm


@pytest.fixture(scope="module")
def litellm(served):
    """litellm, imported with its bundled model-cost map: at import it would fetch one from GitHub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm
    return litellm


def litellm_completion(litellm, served, model, **kwargs):
    return litellm.completion(model=f"openai/{model}", api_base=served, api_key="x", temperature=0, **kwargs)


def test_litellm_json_object_answer_is_an_object(litellm, served, model):
    question = 'Give the capital of France as a JSON object with the key "capital".'
    answer = litellm_completion(litellm, served, model, messages=[{"role": "user", "content": question}],
                                max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    [choice] = answer.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_litellm_required_tool_choice_gives_tool_calls(litellm, served, model):
    answer = litellm_completion(litellm, served, model, messages=ASK_WEATHER, max_tokens=MAX_TOKENS, tools=TOOLS,
                                tool_choice="required")
    calls = answer.choices[0].message.tool_calls
    assert calls
    for call in calls:
        assert call.function.name in PARAMETERS
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
