"""Prompts arriving while speculative streams decode: the verify and the step's prompt chunks in ONE
target pass, against the same steps run apart (the chunks' pass, then the verify), in one run.

    .venv/bin/python -m benchmarks.speculative_burst [--repeats 3] [--budget 256]

Scenario (greedy, SmolLM2-135M-Instruct float32, prompt-lookup speculation so that no draft model is
needed): 4 streams decode up to 300 tokens from 64-token prompts that repeat a 16-token pattern (the
lookup's proposals are then often accepted); once each has streamed, 8 cold 400-token prompts arrive
at once (16 new tokens each). Reported per mode, medians over ``--repeats`` runs on one engine (after
a warm-up run of each), the modes' order alternating: the burst's first token (p50 and worst), the streams' longest stall while the
burst is served, and the target passes of the steps that speculated and fed chunks. The two modes'
answers are compared (the same tokens, or the packed pass is wrong). Shared prefixes are off: both
modes feed the same prompts, so the second would otherwise find the first's blocks published.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.burst import MODEL, Client, report, still_starting  # noqa: E402
from benchmarks.common import format_table, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STREAMS, PATTERN, REPEATS_IN_PROMPT, STREAM_NEW = 4, 16, 4, 300
BURST, BURST_PROMPT, BURST_NEW = 8, 400, 16
MODES = {"one pass": True, "apart": False}  # mode -> Executor.packs_verify


def workload(seed: int, vocab: int) -> dict:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    return {"streams": [ids(PATTERN) * REPEATS_IN_PROMPT for _ in range(STREAMS)],
            "burst": [ids(BURST_PROMPT) for _ in range(BURST)]}


def count_packed(engine, log: list[int]) -> None:
    """Append, per step that speculated and fed prompt chunks, the target passes it ran."""
    runner, speculator, steps = engine.parts.runner, engine.parts.executor.speculator, engine._steps
    run = steps.run

    def counted(plan, ended):
        passes, speculated = runner.num_passes, speculator.num_steps + speculator.num_plain_steps
        run(plan, ended)
        if plan.prefill and speculator.num_steps + speculator.num_plain_steps > speculated:
            log.append(runner.num_passes - passes)

    steps.run = counted


def one_run(client: Client, seed: int, vocab: int) -> dict:
    w = workload(seed, vocab)
    streams = [client.send(ids, STREAM_NEW) for ids in w["streams"]]
    since = time.perf_counter()
    while still_starting(streams, since):
        time.sleep(0.01)
    began = time.perf_counter()
    burst = [client.send(ids, BURST_NEW) for ids in w["burst"]]
    client.wait(burst)
    out = report([s["times"] for s in streams], burst, began)
    client.wait(streams)
    out["answers"] = [r["answer"] for r in streams + burst]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--budget", type=int, default=256, help="RESIDENT_STEP_TOKEN_BUDGET")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "speculative_burst.json")
    args = parser.parse_args()
    from session.config import EngineConfig
    from session.engine import Engine

    # no shared prefixes: each mode's run feeds the same prompts, which the other mode's run would have published
    engine = Engine(EngineConfig(model_path=str(args.model), speculative="ngram", max_device_adapters=0,
                                 step_token_budget=args.budget, prefix_cache_bytes=0)).start()
    client, passes = Client(engine), {mode: [] for mode in MODES}
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    log: list[int] = []
    count_packed(engine, log)
    try:
        vocab = engine.parts.runner.info.vocab_size
        for packed in MODES.values():  # warm-up: kernels built, shapes seen, threads measured, in both modes
            engine.parts.executor.packs_verify = packed
            one_run(client, 10_000, vocab)
        for seed in range(1, args.repeats + 1):
            order = list(MODES.items()) if seed % 2 else list(MODES.items())[::-1]
            for mode, packed in order:
                engine.parts.executor.packs_verify = packed
                log.clear()
                runs[mode].append(one_run(client, seed, vocab))
                passes[mode] += log
        stats = engine.stats().speculation
    finally:
        engine.stop()
    keys = [("burst first token p50 (s)", "burst_ttft_p50_s"), ("burst first token worst (s)", "burst_ttft_max_s"),
            ("streams' longest stall (s)", "stream_longest_gap_s")]
    table = {mode: {key: statistics.median(r[key] for r in rs) for _, key in keys} for mode, rs in runs.items()}
    rows = [[label, *[f"{table[mode][key]:.3f}" for mode in MODES]] for label, key in keys]
    rows.append(["target passes per speculating step with chunks",
                 *[f"{statistics.mean(passes[m]):.2f} over {len(passes[m])} steps" if passes[m] else "no such step"
                   for m in MODES]])
    same = all(a["answers"] == b["answers"] for a, b in zip(runs["one pass"], runs["apart"]))
    print(f"budget {args.budget}, {args.repeats} runs per mode, alternating; speculation: {stats}")
    print(format_table(["", *MODES], rows))
    print(f"answers equal in both modes: {same}")
    write_json(args.out, {"budget": args.budget, "repeats": args.repeats, "medians": table,
                          "passes": passes, "answers_equal": same, "speculation": stats})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
