"""Shared KV prefixes, side by side with vLLM's CPU build (prefix caching on) in one run.

    .venv/bin/python benchmarks/shared_prefix.py --vllm-python build/vllm-venv/bin/python \\
        --out benchmarks/results/shared_prefix.json

Scenarios (the same token ids for both engines; random ids from the model's vocabulary, so a real
model rarely ends an answer early; each answer's length is reported):
  (a) resend     a stateless client resends its history: turn 1 = a 1,200-token history, 16 new tokens;
                 turn 2 = that history + turn 1's answer + a 20-token question, 16 new tokens.
                 Reported: turn 2's latency and cached tokens.
  (b) system     six conversations on one 800-token system prompt, each with its own 20-token question,
                 8 new tokens, one after another. Reported: conversations 2-6's mean latency and cached
                 tokens; ours stateless and as six sessions (held open, then the bytes they hold:
                 the prefix once, against six private copies).
Each repeat draws new prompts (no engine finds another repeat's prefix). Order: ours (repeat 1),
vLLM (every repeat, one process: its start-up is long), ours (repeat 2 ..): our figures are the
median over our repeats, vLLM's over its.

Model: models/smollm2-135m-instruct (``make models``), a real checkpoint tuned by neither engine,
float32 on both. vLLM runs in its own interpreter (benchmarks/requirements-vllm.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_peer_arguments, format_table, run_peer_worker, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "smollm2-135m-instruct"
HISTORY, QUESTION, RESEND_NEW = 1200, 20, 16
SYSTEM, CONVERSATIONS, SYSTEM_NEW = 800, 6, 8


def workload(seed: int, vocab: int) -> dict:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    return {"history": ids(HISTORY), "question": ids(QUESTION), "system": ids(SYSTEM),
            "questions": [ids(QUESTION) for _ in range(CONVERSATIONS)]}


# ---------------------------------------------------------------- ours


def ours(model: Path, seeds: list[int], block_tokens: int, threads: int) -> list[dict]:
    from session.config import EngineConfig
    from session.engine import Engine, GenerationRequest
    from session.engine.events import EventStream, Finished
    from session.types import SamplingParams

    engine = Engine(EngineConfig(model_path=str(model), kv_block_tokens=block_tokens, speculative="off",
                                 max_device_adapters=0, threads=threads)).start()

    def ask(ids, max_tokens, **kwargs):
        request = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=max_tokens), stream=EventStream(),
                                    token_ids=list(ids), **kwargs)
        began = time.perf_counter()
        engine.submit(request)
        while True:
            event = request.stream.get(timeout=600)
            if isinstance(event, Finished):
                return {"s": time.perf_counter() - began, "cached": event.usage.cached_tokens,
                        "tokens": list(event.token_ids)}
            if type(event).__name__ in ("Failed", "Cancelled"):
                raise RuntimeError(f"request failed: {event}")

    try:
        vocab = engine.parts.runner.info.vocab_size
        ask(workload(10_000, vocab)["history"][:200], 4)  # warm-up: kernels built, threads measured
        out = []
        for seed in seeds:
            w = workload(seed, vocab)
            one = ask(w["history"], RESEND_NEW)
            two = ask(w["history"] + one["tokens"] + w["question"], RESEND_NEW)
            stateless = [ask(w["system"] + q, SYSTEM_NEW) for q in w["questions"]]
            w2 = workload(seed + 500, vocab)  # the session variant on another system prompt
            opened = [ask(w2["system"] + q, SYSTEM_NEW, session_id=f"b{seed}-{i}", open_session=True)
                      for i, q in enumerate(w2["questions"])]
            pool = engine.parts.runner.kv_pool(block_tokens)
            usage = {kind: blocks * pool.block_nbytes for kind, blocks in pool.blocks.usage().items()}
            private_copies = CONVERSATIONS * (SYSTEM // block_tokens) * pool.block_nbytes
            out.append({"seed": seed, "resend": {"turn1": one, "turn2": two}, "system": stateless,
                        "sessions": opened, "bytes": {"held": usage, "prefix_once": (SYSTEM // block_tokens)
                                                       * pool.block_nbytes, "six_private_copies": private_copies}})
            for i in range(CONVERSATIONS):
                from session.engine import CloseRequest
                engine.submit(CloseRequest(session_id=f"b{seed}-{i}", stream=EventStream()))
        return out
    finally:
        engine.stop()


# ---------------------------------------------------------------- vLLM (its own interpreter)


def vllm_worker(model: Path, seeds: list[int], kv_cache_gb: int) -> list[dict]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(model), dtype="float32", enable_prefix_caching=True, max_model_len=4096, seed=0)
    vocab = llm.get_tokenizer().vocab_size if hasattr(llm.get_tokenizer(), "vocab_size") else 49152

    def ask(ids, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        began = time.perf_counter()
        [result] = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        return {"s": time.perf_counter() - began, "cached": result.num_cached_tokens or 0,
                "tokens": list(result.outputs[0].token_ids)}

    ask(workload(10_000, vocab)["history"][:200], 4)
    out = []
    for seed in seeds:
        w = workload(seed, vocab)
        one = ask(w["history"], RESEND_NEW)
        two = ask(w["history"] + one["tokens"] + w["question"], RESEND_NEW)
        out.append({"seed": seed, "resend": {"turn1": one, "turn2": two},
                    "system": [ask(w["system"] + q, SYSTEM_NEW) for q in w["questions"]]})
    return out


def run_vllm(python: str, model: Path, seeds: list[int], kv_cache_gb: int) -> list[dict]:
    return run_peer_worker(__file__, python, model, seeds, kv_cache_gb)


# ---------------------------------------------------------------- report


def summarize(runs: list[dict]) -> dict:
    med = statistics.median
    out = {"resend_turn2_s": med(r["resend"]["turn2"]["s"] for r in runs),
           "resend_turn2_cached": med(r["resend"]["turn2"]["cached"] for r in runs),
           "resend_turn2_tokens": med(len(r["resend"]["turn2"]["tokens"]) for r in runs),
           "system_2to6_s": med(statistics.mean(c["s"] for c in r["system"][1:]) for r in runs),
           "system_2to6_cached": med(statistics.mean(c["cached"] for c in r["system"][1:]) for r in runs),
           "system_tokens": med(statistics.mean(len(c["tokens"]) for c in r["system"]) for r in runs)}
    if "sessions" in runs[0]:
        out["sessions_2to6_s"] = med(statistics.mean(c["s"] for c in r["sessions"][1:]) for r in runs)
        out["sessions_2to6_cached"] = med(statistics.mean(c["cached"] for c in r["sessions"][1:]) for r in runs)
        out["bytes"] = runs[-1]["bytes"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--block-tokens", type=int, default=32, help="our KV block size")
    add_peer_arguments(parser, REPO / "benchmarks" / "results" / "shared_prefix.json")
    args = parser.parse_args()
    if args.worker:
        args.out.write_text(json.dumps(vllm_worker(args.model, [int(s) for s in args.seeds.split(",")],
                                                   args.kv_cache_gb)))
        return 0
    seeds = list(range(1, args.repeats + 1))
    ours_runs = ours(args.model, seeds[:1], args.block_tokens, args.threads)
    peer_runs = run_vllm(args.vllm_python, args.model, seeds, args.kv_cache_gb) if args.vllm_python else []
    ours_runs += ours(args.model, seeds[1:], args.block_tokens, args.threads) if seeds[1:] else []
    mine, peer = summarize(ours_runs), summarize(peer_runs) if peer_runs else None
    rows = [["(a) resend: turn 2 latency (s)", mine["resend_turn2_s"]],
            ["(a) resend: turn 2 cached tokens", mine["resend_turn2_cached"]],
            ["(a) resend: turn 2 new tokens", mine["resend_turn2_tokens"]],
            ["(b) system, stateless: conversations 2-6 mean latency (s)", mine["system_2to6_s"]],
            ["(b) system, stateless: cached tokens", mine["system_2to6_cached"]],
            ["(b) system, sessions: conversations 2-6 mean latency (s)", mine["sessions_2to6_s"]],
            ["(b) system, sessions: cached tokens", mine["sessions_2to6_cached"]]]
    peer_keys = ["resend_turn2_s", "resend_turn2_cached", "resend_turn2_tokens", "system_2to6_s",
                 "system_2to6_cached", "system_2to6_s", "system_2to6_cached"]
    table = []
    for (label, value), key in zip(rows, peer_keys):
        theirs = peer[key] if peer else None
        ratio = f"{value / theirs:.2f}" if theirs and label.endswith("(s)") else ""
        table.append([label, f"{value:.3f}" if label.endswith("(s)") else int(value),
                      "" if theirs is None else (f"{theirs:.3f}" if label.endswith("(s)") else int(theirs)), ratio])
    print(format_table(["scenario", "ours", "vLLM", "ours / vLLM"], table))
    held = mine["bytes"]
    print(f"\nsix sessions on one {SYSTEM}-token system prompt hold (bytes): {held['held']}; the prefix once: "
          f"{held['prefix_once']}; six private copies would be {held['six_private_copies']}")
    write_json(args.out, {"ours": ours_runs, "vllm": peer_runs, "summary": {"ours": mine, "vllm": peer},
                          "block_tokens": args.block_tokens, "model": str(args.model)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
