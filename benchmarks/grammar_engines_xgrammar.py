"""The xgrammar half of benchmarks/grammar_engines.py, run in xgrammar's own interpreter.

xgrammar requires torch and triton, which must not enter our environment, so this script imports
nothing of ours: the job (tokenizer folder, schemas, llguidance's answers as token ids, seeds, a
valid and a violating example per unsupported schema) comes as JSON, and the measurements go back
as JSON in the shape benchmarks/grammar_engines.py measures llguidance in, with xgrammar's own
answers (drawn as llguidance's are) for the other side to check.

Run (by grammar_engines.py): <xgrammar python> benchmarks/grammar_engines_xgrammar.py JOB.json OUT.json
Exit status 3: xgrammar is not importable in this interpreter.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

NOT_INSTALLED = 3


def timed(run):
    began = time.perf_counter()
    value = run()
    return value, time.perf_counter() - began


def allows(bitmask, token_id: int) -> bool:
    return bool((int(bitmask[0, token_id >> 5]) >> (token_id & 31)) & 1)


def walk(xgr, compiled, token_ids: list[int], eos: int, bitmask) -> dict:
    """For each answer token: fill the mask, check the token is in it, accept it; then EOS.
    ``walk_error``: None, or [the position of the token the engine would not take, why]."""
    matcher = xgr.GrammarMatcher(compiled)
    mask_s, consume_s = [], []
    for position, token_id in enumerate(token_ids + [eos]):
        _, seconds = timed(lambda: matcher.fill_next_token_bitmask(bitmask))
        mask_s.append(seconds)
        if not allows(bitmask, token_id):
            return {"mask_s": mask_s, "consume_s": consume_s, "walk_error": [position, "not in the mask"]}
        accepted, seconds = timed(lambda token_id=token_id: matcher.accept_token(token_id))
        consume_s.append(seconds)
        if not accepted:
            return {"mask_s": mask_s, "consume_s": consume_s, "walk_error": [position, "refused"]}
    error = None if matcher.is_terminated() else [len(token_ids), "not terminated after EOS"]
    return {"mask_s": mask_s, "consume_s": consume_s, "walk_error": error}


def measure_schema(xgr, tokenizer_info, schema: dict, token_ids: list[int], eos: int, repeats: int, bitmask) -> dict:
    """Cold compile (no cache) to a ready matcher, its first mask, a matcher from the compiled grammar, a walk."""
    compiler = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False)
    text = json.dumps(schema)
    try:
        compiled = compiler.compile_json_schema(text)
    except Exception as error:  # xgrammar raises RuntimeError/ValueError subclasses; we record which schema
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    compile_s, first_mask_s = [], []
    for _ in range(repeats):
        matcher, seconds = timed(lambda: xgr.GrammarMatcher(compiler.compile_json_schema(text)))
        compile_s.append(seconds)
        first_mask_s.append(seconds + timed(lambda matcher=matcher: matcher.fill_next_token_bitmask(bitmask))[1])
    cached_s = [timed(lambda: xgr.GrammarMatcher(compiled))[1] for _ in range(repeats * 5)]
    return {"error": None, "compile_s": statistics.median(compile_s), "first_mask_s": statistics.median(first_mask_s),
            "cached_s": statistics.median(cached_s), **walk(xgr, compiled, token_ids, eos, bitmask)}


def sample(xgr, tokenizer_info, schema: dict, seed: int, eos: int, bitmask, max_tokens: int = 400) -> dict:
    """tests/schema_suite.sample_answer under xgrammar's mask: gaussian logits, compact separators.
    ``stopped``: whether the matcher terminated (EOS drawn) before ``max_tokens``."""
    import numpy as np

    compiled = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled)
    rng = np.random.default_rng(seed)
    num_vocab = tokenizer_info.vocab_size
    token_ids: list[int] = []
    while not matcher.is_terminated() and len(token_ids) < max_tokens:
        matcher.fill_next_token_bitmask(bitmask)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:num_vocab]  # [V]
        token_id = int(np.argmax(np.where(allowed, rng.standard_normal(num_vocab), -np.inf)))
        if not matcher.accept_token(token_id):
            raise AssertionError(f"xgrammar's mask allowed token {token_id} and then refused it")
        if token_id != eos:
            token_ids.append(token_id)
    return {"token_ids": token_ids, "stopped": matcher.is_terminated()}


def enforces(xgr, tokenizer_info, schema: dict, examples: list[str]) -> str:
    """'refused' (a compile error), else as grammar_engines.verdict: 'ignored' (the violating example
    is accepted), 'enforced', or 'over-restricted' (the valid example is refused too)."""
    try:
        compiled = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False).compile_json_schema(json.dumps(schema))
    except Exception:  # any compile error is a refusal here
        return "refused"

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    valid, violating = examples
    if accepts(violating):
        return "ignored"
    return "enforced" if accepts(valid) else "over-restricted"


def main(job_path: str, out_path: str) -> int:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return NOT_INSTALLED
    from importlib.metadata import version

    job = json.loads(open(job_path).read())
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(job["tokenizer"])
    setup_s = [timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=job["num_vocab"]))[1]
               for _ in range(3)]
    tokenizer_info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=job["num_vocab"])
    bitmask = xgr.allocate_token_bitmask(1, job["num_vocab"])  # [1, ceil(V / 32)] int32
    xgr.GrammarCompiler(tokenizer_info, cache_enabled=False).compile_json_schema('{"type": "boolean"}')  # warm-up
    schemas = {name: measure_schema(xgr, tokenizer_info, schema, job["answers"][name], job["eos"], job["repeats"],
                                    bitmask)
               for name, schema in job["schemas"]}
    answers = None if not job["sample"] else {
        name: sample(xgr, tokenizer_info, schema, job["seeds"][name], job["eos"], bitmask)
        for name, schema in job["schemas"]}
    unsupported = {name: enforces(xgr, tokenizer_info, schema, job["examples"][name])
                   for name, schema, _ in job["unsupported"]}
    result = {"version": version("xgrammar"), "cpu_count": os.cpu_count(), "setup_s": statistics.median(setup_s),
              "schemas": schemas, "answers": answers, "unsupported": unsupported}
    open(out_path, "w").write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
