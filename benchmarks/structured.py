"""Constrained vs free decoding through the invocation service, in one process, one run.

    python -m benchmarks.structured [--model models/smollm2-135m-instruct] [--concurrency 1 16]

For each concurrency C: C distinct requests at once, greedy, each held to an extraction schema
(strict, 64 new tokens at most), and the same requests free (no response_format) run with
ignore_eos to the same number of tokens as their constrained twin. Reported: decode
tokens/s over the batch (completion tokens / wall time, after one unmeasured warm-up batch of each
kind), the ratio constrained / free, the share of constrained answers that parse and validate, and
the grammar compile time, cold (first compile) and cached. Then (``--speculative ngram``) the same
constrained batches on an engine with prompt-lookup speculation: tokens/s against the plain engine's,
the answers checked equal (greedy speculation under a grammar is exact). No vLLM side here yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import jsonschema

from launch.torchserve import REPO
from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from session.types import Constraint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["brand", "colour", "size", "price"],
          "properties": {"brand": {"type": "string", "maxLength": 20},
                         "colour": {"enum": ["red", "green", "blue", "black", "white"]},
                         "size": {"enum": ["S", "M", "L", "XL"]},
                         "price": {"type": "number", "minimum": 0}}}
PRODUCTS = ["running shoe", "rain jacket", "wool scarf", "denim jeans", "leather belt", "cotton t-shirt",
            "ski gloves", "summer hat", "hiking boot", "silk tie", "sports bra", "swim shorts", "winter coat",
            "yoga pants", "baseball cap", "linen shirt"]


def body(i: int, constrained: bool, lengths: list[int] | None = None) -> dict:
    """Request i; a free one runs to ``lengths[i]`` tokens (ignore_eos): the length of its constrained
    twin's answer, so that both kinds decode the same number of tokens after the same prefill."""
    request = {"messages": [{"role": "user", "content": f"Describe a {PRODUCTS[i % len(PRODUCTS)]} for sale: "
                             "brand, colour, size and price, as JSON."}], "max_tokens": 64}
    if lengths is not None:
        request.update(max_tokens=lengths[i], ignore_eos=True)
    if constrained:
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "product", "schema": SCHEMA, "strict": True}}
    return request


async def batch(service: ChatService, concurrency: int, constrained: bool,
                lengths: list[int] | None = None) -> tuple[float, int, int, list[int]]:
    """(wall seconds, completion tokens, valid answers, each answer's tokens) of ``concurrency`` requests
    sent together."""
    start = time.perf_counter()
    responses = await asyncio.gather(*(service.invoke({}, json.dumps(body(i, constrained, lengths)))
                                       for i in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = valid = 0
    each = [r.body["usage"]["completion_tokens"] for r in responses]
    for response in responses:
        assert response.status == 200, response.body
        tokens += response.body["usage"]["completion_tokens"]
        try:
            jsonschema.validate(json.loads(response.body["choices"][0]["message"]["content"]), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return wall, tokens, valid, each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "structured.json")
    parser.add_argument("--speculative", default="ngram", help="the speculation compared on constrained rows "
                        "(ngram, or off to skip)")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model_path=str(args.model), speculative="off")).start()
    try:
        service = ChatService(engine, args.model.name)
        constraint = Constraint.json_schema(SCHEMA, "response_format.json_schema")
        t0 = time.perf_counter()
        engine.compile_grammar(Constraint.json_schema({"type": "object"}, "warm"))  # the vocabulary scan
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.compile_grammar(constraint)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.compile_grammar(constraint)
        cached = time.perf_counter() - t0
        rows = []
        for c in args.concurrency:
            result = {"concurrency": c}
            lengths = asyncio.run(batch(service, c, True))[3]  # warm-up, and the lengths free rows run to
            asyncio.run(batch(service, c, False, lengths))
            for constrained in (False, True):
                runs = [asyncio.run(batch(service, c, constrained, None if constrained else lengths))
                        for _ in range(args.repeats)]
                wall, tokens, valid, _ = min(runs, key=lambda r: r[0] / max(r[1], 1))
                key = "constrained" if constrained else "free"
                result[f"{key}_tok_s"] = tokens / wall
                result[f"{key}_valid"] = f"{valid}/{c}"
            result["ratio"] = result["constrained_tok_s"] / result["free_tok_s"]
            rows.append(result)
    finally:
        engine.stop()
    print(f"grammar compiler setup {setup * 1e3:.0f} ms; schema compile cold {cold * 1e3:.2f} ms, "
          f"cached {cached * 1e6:.0f} us")
    print("| concurrency | free tok/s | constrained tok/s | constrained / free | valid (constrained) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['free_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | {r['ratio']:.2f}x "
              f"| {r['constrained_valid']} |")
    speculative = [] if args.speculative == "off" else speculation_rows(args)
    if speculative:
        print(f"\nconstrained rows, speculative={args.speculative} vs off (greedy; answers equal: "
              f"{all(r['equal'] for r in speculative)})")
        print("| concurrency | off tok/s | speculative tok/s | speedup | proposals accepted |")
        print("|---|---|---|---|---|")
        for r in speculative:
            print(f"| {r['concurrency']} | {r['off_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x "
                  f"| {r['accepted']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup_s": setup, "compile_cold_s": cold, "compile_cached_s": cached,
                                    "rows": rows, "speculative": speculative}, indent=2))


def acceptance(engine) -> tuple[int, int]:
    """The speculator's running totals (accepted, proposed); zeros without one."""
    speculator = engine.parts.speculator
    return (0, 0) if speculator is None else (speculator.num_accepted, speculator.num_proposed)


def speculation_rows(args) -> list[dict]:
    """Constrained batches on a plain engine and on one with ``args.speculative``, one after the other."""
    results: dict[str, dict] = {}
    for mode in ("off", args.speculative):
        engine = Engine(EngineConfig(model_path=str(args.model), speculative=mode)).start()
        try:
            service = ChatService(engine, args.model.name)
            for c in args.concurrency:
                asyncio.run(batch(service, c, True))  # warm-up (and the controller's plain-step measure)
                a0, p0 = acceptance(engine)
                runs = [asyncio.run(answers(service, c)) for _ in range(args.repeats)]
                a1, p1 = acceptance(engine)
                wall, tokens, texts = min(runs, key=lambda r: r[0] / max(r[1], 1))
                # this concurrency's timed runs only (not the warm-ups, nor the other rows)
                accepted = "-" if engine.parts.speculator is None else f"{a1 - a0}/{p1 - p0}"
                results.setdefault(mode, {})[c] = (tokens / wall, texts, accepted)
        finally:
            engine.stop()
    off, spec = results["off"], results[args.speculative]
    return [{"concurrency": c, "off_tok_s": off[c][0], "spec_tok_s": spec[c][0], "speedup": spec[c][0] / off[c][0],
             "equal": off[c][1] == spec[c][1], "accepted": spec[c][2]} for c in args.concurrency]


async def answers(service: ChatService, concurrency: int) -> tuple[float, int, list[str]]:
    """(wall seconds, completion tokens, answers) of ``concurrency`` constrained requests sent together."""
    start = time.perf_counter()
    responses = await asyncio.gather(*(service.invoke({}, json.dumps(body(i, True))) for i in range(concurrency)))
    wall = time.perf_counter() - start
    return (wall, sum(r.body["usage"]["completion_tokens"] for r in responses),
            [r.body["choices"][0]["message"]["content"] for r in responses])


if __name__ == "__main__":
    main()
