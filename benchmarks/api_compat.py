"""What an application gets from a server's OpenAI API, case by case, with the clients applications use.

    python -m benchmarks.api_compat --base-url http://127.0.0.1:8080/v1 --model smollm2-135m-instruct \\
        [--label resident] [--out benchmarks/results/api_compat-resident.json]

Runs the same cases against any OpenAI-compatible server (Resident through ``make serve``, vLLM's
``vllm serve``) with the openai SDK, langchain-openai and litellm, and prints one row per case: pass,
or what failed (the status and the server's message, or the check that did not hold). A case passes
when the call succeeds AND its answer holds what was asked: JSON that validates against the schema,
tool-call arguments that validate against the function's parameters, n choices, logprobs present.
Forced outputs are checked for validity, never for meaning (the models are small). Two result files
side by side: ``python -m benchmarks.api_compat --compare A.json B.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema

REPO = Path(__file__).resolve().parent.parent
PRODUCT = {"type": "object", "additionalProperties": False, "required": ["brand", "colour", "size"],
           "properties": {"brand": {"type": "string", "maxLength": 20},
                          "colour": {"enum": ["red", "green", "blue", "black"]},
                          "size": {"enum": ["S", "M", "L"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
DESCRIBE = [{"role": "user", "content": "Describe a red running shoe as JSON: brand, colour, size."}]


class Cases:
    """Every case, as a method ``case_<name>`` returning nothing (it raises on a failed check)."""

    def __init__(self, base_url: str, model: str, max_tokens: int):
        import openai

        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)

    def chat(self, **fields):
        return self.client.chat.completions.create(model=self.model, max_tokens=self.max_tokens, **fields)

    # ---------------------------------------------------------------- plain paths

    def case_models_list(self):
        ids = [m.id for m in self.client.models.list().data]
        assert self.model in ids, f"{self.model!r} not in {ids}"

    def case_chat(self):
        assert self.chat(messages=ASK).choices[0].message.content

    def case_chat_stream(self):
        text = "".join(c.choices[0].delta.content or "" for c in self.chat(messages=ASK, stream=True) if c.choices)
        assert text

    def case_stream_include_usage(self):
        chunks = list(self.chat(messages=ASK, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].choices == [], "usage not in a last chunk without choices"

    def case_max_completion_tokens(self):
        answer = self.client.chat.completions.create(model=self.model, messages=ASK, max_completion_tokens=5)
        assert answer.usage.completion_tokens <= 5

    def case_seed_temperature_top_p(self):
        first, second = (self.chat(messages=ASK, seed=7, temperature=0.8, top_p=0.9).choices[0].message.content
                         for _ in range(2))
        assert first == second, "the same seed gave different answers"

    def case_stop_and_user(self):
        assert self.chat(messages=ASK, stop=["\n"], user="tester").choices[0].message.content is not None

    # ---------------------------------------------------------------- what applications build on

    def case_n_2(self):
        answer = self.chat(messages=ASK, n=2, temperature=1.0, seed=3)
        assert [c.index for c in answer.choices] == [0, 1]

    def case_logprobs(self):
        content = self.chat(messages=ASK, logprobs=True, top_logprobs=2).choices[0].logprobs.content
        assert content and all(len(e.top_logprobs) == 2 for e in content)

    def case_penalties(self):
        assert self.chat(messages=ASK, presence_penalty=0.5, frequency_penalty=0.5).choices[0].message.content

    def case_logit_bias(self):
        assert self.chat(messages=ASK, logit_bias={"0": -100}).choices[0].message.content is not None

    def case_json_object(self):
        content = self.chat(messages=DESCRIBE, response_format={"type": "json_object"}).choices[0].message.content
        assert isinstance(json.loads(content), dict)

    def case_json_schema_strict(self):
        content = self.chat(messages=DESCRIBE, response_format={"type": "json_schema", "json_schema": {
            "name": "product", "schema": PRODUCT, "strict": True}}).choices[0].message.content
        jsonschema.validate(json.loads(content), PRODUCT)

    def case_sdk_parse_pydantic(self):
        from pydantic import BaseModel

        class Product(BaseModel):
            brand: str
            size: str

        parsed = self.client.chat.completions.parse(model=self.model, messages=DESCRIBE, response_format=Product,
                                                    max_tokens=self.max_tokens).choices[0].message.parsed
        assert isinstance(parsed, Product)

    def _calls(self, message) -> list:
        calls = message.tool_calls or []
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        return calls

    def case_tools_auto(self):
        choice = self.chat(messages=ASK, tools=[WEATHER], tool_choice="auto").choices[0]
        self._calls(choice.message)  # a call (valid) or content: both are answers
        assert choice.message.tool_calls or choice.message.content is not None

    def case_tools_required(self):
        choice = self.chat(messages=ASK, tools=[WEATHER], tool_choice="required").choices[0]
        assert self._calls(choice.message), "no tool call"
        assert choice.finish_reason == "tool_calls", choice.finish_reason

    def case_tools_named(self):
        message = self.chat(messages=ASK, tools=[WEATHER],
                            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
        names = [c.function.name for c in self._calls(message)]
        assert names and set(names) == {"get_weather"}, names

    def case_tools_stream(self):
        names = [call.function.name for chunk in self.chat(messages=ASK, tools=[WEATHER], tool_choice="required",
                                                           stream=True)
                 if chunk.choices for call in chunk.choices[0].delta.tool_calls or [] if call.function.name]
        assert names == ["get_weather"] * len(names) and names, names

    def case_tool_result_round_trip(self):
        message = self.chat(messages=ASK, tools=[WEATHER], tool_choice="required").choices[0].message
        call = self._calls(message)[0]
        history = ASK + [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        assert self.chat(messages=history, tools=[WEATHER]).choices[0].message is not None

    def case_completions(self):
        text = self.client.completions.create(model=self.model, prompt="The sky is", max_tokens=8).choices[0].text
        assert isinstance(text, str) and text

    def case_completions_echo(self):
        answer = self.client.completions.create(model=self.model, prompt="The sky is", max_tokens=4, echo=True)
        assert answer.choices[0].text.startswith("The sky is")

    # ---------------------------------------------------------------- LangChain, litellm

    def _langchain(self):
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(base_url=self.base_url, api_key="none", model=self.model, temperature=0,
                          max_tokens=self.max_tokens, max_retries=0)

    def case_langchain_invoke_stream_batch(self):
        llm = self._langchain()
        assert llm.invoke("Hi").content
        assert "".join(c.content for c in llm.stream("Hi"))
        assert len(llm.batch(["Hi", "Hello"])) == 2

    def case_langchain_structured_default(self):
        from pydantic import BaseModel

        class Product(BaseModel):
            brand: str
            size: str

        assert isinstance(self._langchain().with_structured_output(Product).invoke(DESCRIBE[0]["content"]), Product)

    def case_langchain_structured_function_calling(self):
        from pydantic import BaseModel

        class Product(BaseModel):
            brand: str
            size: str

        result = self._langchain().with_structured_output(Product, method="function_calling").invoke(
            DESCRIBE[0]["content"])
        assert isinstance(result, Product)

    def case_langchain_bind_tools(self):
        message = self._langchain().bind_tools([WEATHER], tool_choice="any").invoke(ASK[0]["content"])
        assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"

    def case_litellm(self):
        import litellm

        answer = litellm.completion(model=f"openai/{self.model}", api_base=self.base_url, api_key="none",
                                    messages=DESCRIBE, max_tokens=self.max_tokens,
                                    response_format={"type": "json_object"})
        assert isinstance(json.loads(answer.choices[0].message.content), dict)


def run(base_url: str, model: str, max_tokens: int) -> list[dict]:
    cases = Cases(base_url, model, max_tokens)
    rows = []
    for name in sorted(n for n in dir(Cases) if n.startswith("case_")):
        started = time.perf_counter()
        try:
            getattr(cases, name)()
            outcome = "pass"
        except Exception as exc:  # the case's failure, whatever raised it, is the row's answer
            outcome = _short(exc)
        rows.append({"case": name[len("case_"):], "outcome": outcome, "seconds": time.perf_counter() - started})
    return rows


def _short(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) < 160 else text[:157] + "..."


def compare(paths: list[Path]) -> None:
    runs = [json.loads(p.read_text()) for p in paths]
    print("| case | " + " | ".join(r["label"] for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for i, row in enumerate(runs[0]["rows"]):
        print(f"| {row['case']} | " + " | ".join(r["rows"][i]["outcome"] for r in runs) + " |")
    print("| **passed** | " + " | ".join(f"{sum(x['outcome'] == 'pass' for x in r['rows'])} / {len(r['rows'])}"
                                       for r in runs) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--label", default="server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return
    rows = run(args.base_url, args.model, args.max_tokens)
    for row in rows:
        print(f"| {row['case']} | {row['outcome']} | {row['seconds']:.1f} s |")
    print(f"{args.label}: {sum(r['outcome'] == 'pass' for r in rows)} / {len(rows)} cases pass")
    out = args.out or REPO / "benchmarks" / "results" / f"api_compat-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "base_url": args.base_url, "model": args.model, "rows": rows},
                              indent=2))


if __name__ == "__main__":
    main()
