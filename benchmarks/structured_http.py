"""Constrained vs free decoding over HTTP, against any OpenAI-compatible server (ours or vLLM's).

    python -m benchmarks.structured_http --base-url http://127.0.0.1:8080/v1 --model smollm2-135m-instruct \\
        --label resident [--concurrency 1 8]

For each concurrency C: C distinct product-extraction requests at once, greedy, ``response_format``
json_schema strict (benchmarks.structured's schema), 64 new tokens at most; then the same requests
free, run (``ignore_eos``, which vLLM takes too) to the length of their constrained twin, so both decode
the same tokens after the same prompt. Each kind runs once unmeasured, then ``--repeats`` times; the
best run is kept. Reported: completion tokens/s over the batch's wall time, constrained / free, and
how many constrained answers validate. Then two validity rates: the schema suite (tests/schema_suite.py,
74 schemas as strict ``response_format``, 16 at a time, greedy): answers that validate, answers cut at
``max_tokens``, answers finished but invalid, schemas refused; and tool calls (``tool_choice``
"required", 16 questions): answers whose calls all parse and validate against the function's schema.
Run it against each server in turn on the same machine (nothing else running), then ``--compare``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp
import jsonschema

from benchmarks.structured import SCHEMA, body

REPO = Path(__file__).resolve().parent.parent


async def batch(session: aiohttp.ClientSession, url: str, model: str, concurrency: int, constrained: bool,
                lengths: list[int] | None = None) -> tuple[float, int, int, list[int]]:
    async def one(i: int) -> dict:
        request = {**body(i, constrained, lengths), "model": model, "temperature": 0}
        async with session.post(f"{url}/chat/completions", json=request) as response:
            answer = await response.json()
            assert response.status == 200, answer
            return answer
    started = time.perf_counter()
    answers = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    valid = 0
    for answer in answers:
        try:
            jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    each = [a["usage"]["completion_tokens"] for a in answers]
    return wall, sum(each), valid, each


async def measure(url: str, model: str, concurrency: list[int], repeats: int) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for c in concurrency:
            lengths = (await batch(session, url, model, c, True))[3]  # warm-up; the lengths free rows run to
            await batch(session, url, model, c, False, lengths)
            row = {"concurrency": c}
            for constrained in (False, True):
                runs = [await batch(session, url, model, c, constrained, None if constrained else lengths)
                        for _ in range(repeats)]
                wall, tokens, valid, _ = min(runs, key=lambda r: r[0] / max(r[1], 1))
                kind = "constrained" if constrained else "free"
                row[f"{kind}_tok_s"], row[f"{kind}_valid"] = tokens / wall, f"{valid}/{c}"
            row["ratio"] = row["constrained_tok_s"] / row["free_tok_s"]
            rows.append(row)
    return rows


async def suite_validity(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int = 400) -> dict:
    from tests.schema_suite import SCHEMAS, format_checker

    async def one(i: int, name: str, schema: dict) -> str:
        request = {"model": model, "temperature": 0, "max_tokens": max_tokens,
                   "messages": [{"role": "user", "content": f"Answer {i} in JSON."}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                              "strict": True}}}
        async with session.post(f"{url}/chat/completions", json=request) as response:
            answer = await response.json()
        if response.status != 200:
            return "refused"
        choice = answer["choices"][0]
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema, format_checker=format_checker())
            return "valid"
        except (ValueError, jsonschema.ValidationError):
            return "cut" if choice["finish_reason"] == "length" else "invalid"
    outcomes = []
    for start in range(0, len(SCHEMAS), 16):
        outcomes += await asyncio.gather(*(one(start + i, name, schema)
                                           for i, (name, schema) in enumerate(SCHEMAS[start:start + 16])))
    return {kind: outcomes.count(kind) for kind in ("valid", "cut", "invalid", "refused")} | {"total": len(outcomes)}


async def tool_validity(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    from benchmarks.api_compat import WEATHER

    cities = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Accra", "Perth", "Dakar", "Hanoi",
              "Bern", "Riga", "Doha", "Kyiv", "Sofia"]

    async def one(city: str) -> bool:
        request = {"model": model, "temperature": 0, "max_tokens": 96, "tools": [WEATHER], "tool_choice": "required",
                   "messages": [{"role": "user", "content": f"What is the weather in {city}?"}]}
        async with session.post(f"{url}/chat/completions", json=request) as response:
            answer = await response.json()
        calls = (answer["choices"][0]["message"].get("tool_calls") or []) if response.status == 200 else []
        try:
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return bool(calls)
    results = await asyncio.gather(*(one(city) for city in cities))
    return {"valid": sum(results), "total": len(results)}


async def validity(url: str, model: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        return {"suite": await suite_validity(session, url, model), "tools": await tool_validity(session, url, model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--label", default="server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="the folder results go to")
    args = parser.parse_args()
    if args.compare:
        runs = [json.loads(p.read_text()) for p in args.compare]
        print("| server | concurrency | free tok/s | constrained tok/s | constrained / free | valid |")
        print("|---|---|---|---|---|---|")
        for run in runs:
            for r in run["rows"]:
                print(f"| {run['label']} | {r['concurrency']} | {r['free_tok_s']:.1f} | {r['constrained_tok_s']:.1f} "
                      f"| {r['ratio']:.2f}x | {r['constrained_valid']} |")
        print("\n| server | schema suite: valid | cut at max_tokens | finished invalid | refused | forced tool calls valid |")
        print("|---|---|---|---|---|---|")
        for run in runs:
            suite, tools = run["validity"]["suite"], run["validity"]["tools"]
            print(f"| {run['label']} | {suite['valid']} / {suite['total']} | {suite['cut']} | {suite['invalid']} "
                  f"| {suite['refused']} | {tools['valid']} / {tools['total']} |")
        return
    rows = asyncio.run(measure(args.base_url, args.model, args.concurrency, args.repeats))
    valid = asyncio.run(validity(args.base_url, args.model))
    out = args.out / f"structured_http-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "base_url": args.base_url, "rows": rows, "validity": valid},
                              indent=2))
    print(f"{args.label}: schema suite {valid['suite']}, forced tool calls {valid['tools']}")
    for r in rows:
        print(f"{args.label} @{r['concurrency']}: free {r['free_tok_s']:.1f} tok/s, constrained "
              f"{r['constrained_tok_s']:.1f} tok/s ({r['ratio']:.2f}x), valid {r['constrained_valid']}")


if __name__ == "__main__":
    main()
