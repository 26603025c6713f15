"""Grammar engines for structured output, llguidance against xgrammar, on SmolLM2's tokenizer over the
schema suite (tests/schema_suite.py).

Measured for each engine: setting up its tokenizer info; a cold compile per schema, to a matcher
ready for its first mask (xgrammar with its cache off) and to that first mask; a matcher from an
already compiled grammar (llguidance: ``deep_copy`` of a fresh matcher; xgrammar:
``GrammarMatcher(compiled)``); and, walking each schema's sampled answer (``sample_answer``, the
answers the grammar test validates) on a freshly compiled grammar, the time to fill each token's
mask into a preallocated int32 bitmask, then to consume the token. Both compile with their defaults
(flexible whitespace). Coverage: the suite schemas each refuses, the answers xgrammar will not walk,
xgrammar's own answers (drawn the same way under its mask) that do not end, fail jsonschema or fail
llguidance's grammar, and what xgrammar does with the keywords llguidance refuses (refuses,
enforces, over-restricts or ignores).

xgrammar pulls torch and triton, so it runs in its own interpreter (benchmarks/grammar_engines_xgrammar.py):
    python3 -m venv /tmp/xgr && /tmp/xgr/bin/pip install torch==2.13.0 xgrammar transformers numpy

Run: python -m benchmarks.grammar_engines [--xgrammar-python /tmp/xgr/bin/python] [--repeats 3] [--no-length-bounds]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import transformers

from benchmarks.common import REPO, format_table, median, percentile, write_json
from tests.schema_suite import SCHEMAS, UNSUPPORTED, format_checker, sample_answer, seed_of

MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
WORKER = Path(__file__).with_name("grammar_engines_xgrammar.py")
NOT_INSTALLED = 3  # the worker's exit status when xgrammar does not import

# name -> (an instance the schema accepts, one it refuses), for each UNSUPPORTED schema.
EXAMPLES = {
    "unique_items": ("[1,2]", "[1,1]"),
    "contains": ("[3]", "[1]"),
    "not": ("1", '"x"'),
    "if_then_else": ('"xy"', '"x"'),
    "dependent_required": ('{"a":"x","b":"y"}', '{"a":"x"}'),
    "dependent_schemas": ('{"a":"x","b":"y"}', '{"a":"x"}'),
    "property_names": ('{"a1":1}', '{"b":1}'),
    "unevaluated_properties": ('{"a":1}', '{"b":1}'),
    "dynamic_ref": ("1", '"x"'),
    "one_of_overlapping": ("1.5", "1"),
    "format_iri": ('"https://example.org/café"', '"not an iri"'),
}


def without_length_bounds(schema):
    """The schema less every minLength and maxLength: the answers sampled under it still match, and
    the masks inside free strings no longer count characters."""
    if isinstance(schema, dict):
        return {key: without_length_bounds(value) for key, value in schema.items()
                if key not in ("minLength", "maxLength")}
    if isinstance(schema, list):
        return [without_length_bounds(value) for value in schema]
    return schema


def timed(run):
    began = time.perf_counter()
    value = run()
    return value, time.perf_counter() - began


def allows(bitmask, token_id: int) -> bool:
    return bool((int(bitmask[0, token_id >> 5]) >> (token_id & 31)) & 1)


def walk(matcher: llguidance.LLMatcher, token_ids: list[int], eos: int, bitmask) -> dict:
    """For each answer token: fill the mask, check the token is in it, consume it; then EOS.
    ``walk_error``: None, or [the position of the token the engine would not take, why]."""
    mask_s, consume_s = [], []
    for position, token_id in enumerate(token_ids + [eos]):
        _, seconds = timed(lambda: llg_numpy.fill_next_token_bitmask(matcher, bitmask))
        mask_s.append(seconds)
        if not allows(bitmask, token_id):
            return {"mask_s": mask_s, "consume_s": consume_s, "walk_error": [position, "not in the mask"]}
        consumed, seconds = timed(lambda token_id=token_id: matcher.consume_token(token_id))
        consume_s.append(seconds)
        if not consumed:
            return {"mask_s": mask_s, "consume_s": consume_s, "walk_error": [position, "refused"]}
    return {"mask_s": mask_s, "consume_s": consume_s, "walk_error": None}


def measure_llguidance_schema(tokenizer, schema: dict, token_ids: list[int], repeats: int, bitmask) -> dict:
    """The measurements of grammar_engines_xgrammar.measure_schema, for llguidance (which compiles in
    the LLMatcher constructor and builds its lexer lazily, during masks)."""
    def compile_matcher():
        return llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)

    template = compile_matcher()
    if template.is_error():
        return {"error": template.get_error().splitlines()[0][:200]}
    compile_s, first_mask_s = [], []
    for _ in range(repeats):
        matcher, seconds = timed(compile_matcher)
        compile_s.append(seconds)
        first_mask_s.append(seconds + timed(lambda matcher=matcher: llg_numpy.fill_next_token_bitmask(matcher,
                                                                                                     bitmask))[1])
    fresh = compile_matcher()
    cached_s = [timed(fresh.deep_copy)[1] for _ in range(repeats * 5)]
    return {"error": None, "compile_s": median(compile_s), "first_mask_s": median(first_mask_s),
            "cached_s": median(cached_s), **walk(fresh.deep_copy(), token_ids, tokenizer.eos_token, bitmask)}


def verdict(accepts_valid: bool, accepts_violating: bool) -> str:
    """What an engine that compiled a schema does with its keyword, from the two examples."""
    if accepts_violating:
        return "ignored"
    return "enforced" if accepts_valid else "over-restricted"


def enforces(tokenizer, schema: dict, examples: tuple[str, str]) -> str:
    """'refused' (an error matcher), else verdict() on the valid and the violating example."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)
    if matcher.is_error():
        return "refused"

    def accepts(text: str) -> bool:
        copy = matcher.deep_copy()
        return copy.consume_tokens(tokenizer.tokenize_str(text)) and copy.is_accepting()

    return verdict(*(accepts(text) for text in examples))


def measure_llguidance(hf_tokenizer, num_vocab: int, schemas: list[tuple[str, dict]], answers: dict[str, list[int]],
                       repeats: int) -> dict:
    setup_s = [timed(lambda: llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=num_vocab))[1] for _ in range(3)]
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=num_vocab)
    bitmask = llg_numpy.allocate_token_bitmask(1, num_vocab)  # [1, ceil(V / 32)] int32
    llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema({"type": "boolean"}))  # warm-up
    measured = {name: measure_llguidance_schema(tokenizer, schema, answers[name], repeats, bitmask)
                for name, schema in schemas}
    unsupported = {name: enforces(tokenizer, schema, EXAMPLES[name]) for name, schema, _ in UNSUPPORTED}
    return {"version": version("llguidance"), "cpu_count": os.cpu_count(), "setup_s": median(setup_s),
            "schemas": measured, "unsupported": unsupported}


def measure_xgrammar(python: str, num_vocab: int, eos: int, schemas: list[tuple[str, dict]],
                     answers: dict[str, list[int]], repeats: int, sample: bool):
    """The worker's measurements, or None when ``python`` is missing or lacks xgrammar. With ``sample``,
    also xgrammar's own answers (drawn as ``sample_answer`` draws llguidance's)."""
    if not python or not Path(python).exists():
        return None
    job = {"tokenizer": str(MODEL_DIR), "num_vocab": num_vocab, "eos": eos, "repeats": repeats,
           "schemas": schemas, "answers": answers, "seeds": {name: seed_of(name) for name, _ in schemas},
           "sample": sample, "unsupported": UNSUPPORTED, "examples": EXAMPLES}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        done = subprocess.run([python, str(WORKER), str(job_path), str(out_path)], capture_output=True, text=True,
                              check=False)
        if done.returncode == NOT_INSTALLED:
            return None
        if done.returncode:
            raise RuntimeError(f"the xgrammar worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def check_answer(schema: dict, answer: dict, hf_tokenizer, tokenizer: llguidance.LLTokenizer) -> str | None:
    """Why another engine's answer for ``schema`` fails, or None: it must end, be JSON that validates
    against the schema, and walk llguidance's default grammar to EOS."""
    if not answer["stopped"]:
        return "no end in 400 tokens"
    try:
        value = json.loads(hf_tokenizer.decode(answer["token_ids"]))
    except json.JSONDecodeError as error:
        return f"not JSON: {error.msg}"
    try:
        jsonschema.validate(value, schema, format_checker=format_checker())
    except jsonschema.ValidationError as error:  # its message quotes the whole instance: name the keyword instead
        return f"invalid: fails {error.validator!r} at {list(error.absolute_path)}"
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)
    accepted = matcher.try_consume_tokens(answer["token_ids"])
    if accepted < len(answer["token_ids"]) or not matcher.is_accepting():
        return f"llguidance refuses: {describe([accepted, 'refused'], answer['token_ids'], tokenizer)}"
    return None


def answer_failures(answers: dict[str, dict], schemas: list[tuple[str, dict]], hf_tokenizer,
                    tokenizer: llguidance.LLTokenizer) -> dict[str, str]:
    """schema name -> why that answer fails, for the answers that do."""
    schema_by_name = dict(schemas)
    failures = {name: check_answer(schema_by_name[name], answer, hf_tokenizer, tokenizer)
                for name, answer in answers.items()}
    return {name: why for name, why in failures.items() if why}


def walked_by_all(results: dict[str, dict]) -> list[str]:
    """The schemas every engine compiled and walked to EOS: the timings compare over these alone."""
    return [name for name in next(iter(results.values()))["schemas"]
            if all(r["schemas"][name]["error"] is None and r["schemas"][name]["walk_error"] is None
                   for r in results.values())]


def summary(engine: str, result: dict, names: list[str], answers: dict[str, list[int]],
            tokenizer: llguidance.LLTokenizer) -> dict:
    """One table row: medians and tails over ``names`` (times in ms or us); coverage over the whole suite."""
    timed_schemas = [result["schemas"][name] for name in names]
    compile_ms = [1e3 * r["compile_s"] for r in timed_schemas]
    first_mask_ms = [1e3 * r["first_mask_s"] for r in timed_schemas]
    cached_us = [1e6 * r["cached_s"] for r in timed_schemas]
    mask_us = [1e6 * s for r in timed_schemas for s in r["mask_s"]]
    consume_us = [1e6 * s for r in timed_schemas for s in r["consume_s"]]
    return {"engine": f"{engine} {result['version']}", "setup_ms": 1e3 * result["setup_s"],
            "compile_p50_ms": median(compile_ms), "compile_max_ms": max(compile_ms),
            "first_mask_p50_ms": median(first_mask_ms), "first_mask_max_ms": max(first_mask_ms),
            "cached_p50_us": median(cached_us), "cached_max_us": max(cached_us),
            "mask_p50_us": median(mask_us), "mask_p90_us": percentile(mask_us, 90),
            "mask_p99_us": percentile(mask_us, 99), "mask_max_us": max(mask_us),
            "consume_p50_us": median(consume_us), "num_masks": len(mask_us),
            "refused": sorted(name for name, r in result["schemas"].items() if r["error"] is not None),
            "walk_errors": {name: describe(r["walk_error"], answers[name], tokenizer)
                            for name, r in result["schemas"].items() if r["error"] is None and r["walk_error"]}}


def describe(walk_error: list, token_ids: list[int], tokenizer: llguidance.LLTokenizer) -> str:
    """'<reason>: ...<the answer's last 16 bytes> + <the token refused>'."""
    position, reason = walk_error
    prefix = tokenizer.decode_str(token_ids[:position])[-16:]
    return f"{reason}: ...{prefix!r} + {tokenizer.decode_str(token_ids[position:position + 1])!r}"


def print_report(rows: list[dict], results: dict[str, dict]) -> None:
    print(format_table(
        ["engine", "setup ms", "compile p50/max ms", "to 1st mask p50/max ms", "cached p50/max us",
         "mask p50/p90/p99/max us", "consume p50 us", "refused"],
        [[r["engine"], f"{r['setup_ms']:.0f}", f"{r['compile_p50_ms']:.2f} / {r['compile_max_ms']:.1f}",
          f"{r['first_mask_p50_ms']:.2f} / {r['first_mask_max_ms']:.1f}",
          f"{r['cached_p50_us']:.0f} / {r['cached_max_us']:.0f}",
          f"{r['mask_p50_us']:.0f} / {r['mask_p90_us']:.0f} / {r['mask_p99_us']:.0f} / {r['mask_max_us']:.0f}",
          f"{r['consume_p50_us']:.0f}", f"{len(r['refused'])}/{len(SCHEMAS)}"] for r in rows]))
    for row in rows:
        print(f"{row['engine']}: refused {row['refused'] or 'none'}; the answers it would not walk: "
              f"{'none' if not row['walk_errors'] else ''}")
        for name, error in row["walk_errors"].items():
            print(f"  {name}: {error}")
    if "xgrammar" in results and results["xgrammar"]["answers"] is not None:
        failures = results["xgrammar"]["answer_failures"]
        print(f"xgrammar's own answers that fail (end, jsonschema, llguidance's grammar): {'none' if not failures else ''}")
        for name, why in failures.items():
            print(f"  {name}: {why}")
    names = [name for name, _, _ in UNSUPPORTED]
    print(format_table(["keyword llguidance refuses"] + list(results),
                       [[name] + [results[engine]["unsupported"][name] for engine in results] for name in names]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xgrammar-python", default="/tmp/xgr/bin/python",
                        help="an interpreter with xgrammar, torch and transformers (empty: llguidance only)")
    parser.add_argument("--repeats", type=int, default=3, help="cold compiles per schema (median)")
    parser.add_argument("--no-length-bounds", action="store_true",
                        help="drop minLength/maxLength from the schemas (the answers stay valid)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    num_vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=num_vocab)
    answers = {name: sample_answer(tokenizer, name, schema).token_ids for name, schema in SCHEMAS}
    schemas = [(name, without_length_bounds(schema)) for name, schema in SCHEMAS] if args.no_length_bounds else SCHEMAS
    results = {"llguidance": measure_llguidance(hf_tokenizer, num_vocab, schemas, answers, args.repeats)}
    # Unbounded strings never end under random logits: xgrammar's own answers are drawn on the suite as it is.
    xgrammar = measure_xgrammar(args.xgrammar_python, num_vocab, tokenizer.eos_token, schemas, answers, args.repeats,
                                sample=not args.no_length_bounds)
    if xgrammar is None:
        print(f"xgrammar: not installed (no xgrammar in {args.xgrammar_python or 'an empty --xgrammar-python'})")
    else:
        results["xgrammar"] = xgrammar
        if xgrammar["answers"] is not None:
            xgrammar["answer_failures"] = answer_failures(xgrammar["answers"], schemas, hf_tokenizer, tokenizer)
    names = walked_by_all(results)
    rows = [summary(engine, result, names, answers, tokenizer) for engine, result in results.items()]
    print(f"{len(SCHEMAS)} schemas{' without string length bounds' if args.no_length_bounds else ''}; timings over "
          f"the {len(names)} every engine walked ({rows[0]['num_masks']} masks); {os.cpu_count()} CPUs")
    print_report(rows, results)
    name = "grammar_engines_no_length_bounds.json" if args.no_length_bounds else "grammar_engines.json"
    write_json(args.out / name, {"num_schemas": len(SCHEMAS), "no_length_bounds": args.no_length_bounds,
                                 "timed_schemas": names, "summary": rows, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
