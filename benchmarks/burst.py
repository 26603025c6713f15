"""The token-budget step under a burst of cold prompts, side by side with vLLM's CPU build in one run.

    .venv/bin/python benchmarks/burst.py --vllm-python build/vllm-venv/bin/python \\
        --out benchmarks/results/burst.json

Scenarios (the same token ids for both engines: random ids from the model's vocabulary; greedy):
  (c) burst     4 streams decode (64-token prompts, up to 400 new tokens); once each has streamed,
                12 cold 600-token prompts arrive at once (16 new tokens each). Reported: the burst's
                first-token latency (p50, and the worst of 12) and the decoding streams' longest
                gap between two tokens while the burst is served.
  (d) follow    4 conversations each hold a 300-token opening and its 16-token answer (ours: open
                sessions; vLLM: the same turn sent stateless, so its prefix cache holds it); then
                12 cold 600-token prompts arrive, and 0.2 s later each conversation's 20-token
                follow-up (16 new tokens; to vLLM the whole history again, as an OpenAI client sends
                it). Reported: the follow-ups' first-token latency (median and worst) and the burst's.
Each engine serves requests concurrently as it would behind its server (ours: ``Engine.submit`` from
client threads; vLLM: ``AsyncLLM.generate``). Ours runs once per token budget of ``--budgets``
(RESIDENT_STEP_TOKEN_BUDGET); the comparison rows use ``--budget``. vLLM runs with its defaults
(chunked prefill and prefix caching on), its scheduler settings recorded in the JSON.

AVX2 on an AVX-512 CPU, both engines' AVX2 builds in one run (an instruction-set check, not an AVX2
CPU's caches and clocks)::

    RESIDENT_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python \
        benchmarks/burst.py --vllm-python build/vllm-venv/bin/python

(ours: our kernels, ATen's and oneDNN's capped; vLLM's worker inherits the same and loads ``_C_AVX2``).

Model: models/smollm2-135m-instruct (``make models``), float32 on both. vLLM runs in its own
interpreter (benchmarks/requirements-vllm.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_peer_arguments, format_table, run_peer_worker, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "smollm2-135m-instruct"
STREAMS, STREAM_PROMPT, STREAM_NEW = 4, 64, 400
BURST, BURST_PROMPT, BURST_NEW = 12, 600, 16
TALKS, OPENING, OPENING_NEW, QUESTION, FOLLOW_NEW = 4, 300, 16, 20, 16
FOLLOW_DELAY_S = 0.2


def workload(seed: int, vocab: int) -> dict:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    return {"streams": [ids(STREAM_PROMPT) for _ in range(STREAMS)], "burst": [ids(BURST_PROMPT) for _ in range(BURST)],
            "openings": [ids(OPENING) for _ in range(TALKS)], "questions": [ids(QUESTION) for _ in range(TALKS)],
            "burst2": [ids(BURST_PROMPT) for _ in range(BURST)]}


def model_vocab(model: Path) -> int:
    """The checkpoint's vocabulary size (config.json), the range both engines' random prompts draw from."""
    config = json.loads((model / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])  # a VLM's: its language model's


def longest_gap(times: list[float], since: float, until: float) -> float:
    """The longest wait for a token of a stream inside [since, until] (the wait into the window counts)."""
    inside = [t for t in times if since <= t <= until]
    before = [t for t in times if t < since]
    marks = ([before[-1]] if before else []) + inside
    return max((b - a for a, b in zip(marks, marks[1:])), default=0.0)


def report(streams: list[list[float]], burst: list[dict], began: float, follow: list[dict] | None = None) -> dict:
    """Latencies of one scenario from its requests' token times (``{"sent", "times", "tokens"}``)."""
    ttft = sorted(r["times"][0] - r["sent"] for r in burst)
    served = max(r["times"][0] for r in burst)
    out = {"burst_ttft_p50_s": statistics.median(ttft), "burst_ttft_max_s": ttft[-1],
           "burst_tokens": statistics.mean(r["tokens"] for r in burst)}
    if streams:
        out["stream_longest_gap_s"] = max(longest_gap(times, began, served) for times in streams)
    if follow is not None:
        first = sorted(r["times"][0] - r["sent"] for r in follow)
        out.update(follow_ttft_median_s=statistics.median(first), follow_ttft_max_s=first[-1],
                   follow_tokens=statistics.mean(r["tokens"] for r in follow))
    return out


# ---------------------------------------------------------------- ours


def still_starting(streams: list[dict], since: float, timeout_s: float = 600) -> bool:
    """Whether a stream has yet to stream 4 pieces (the burst arrives once every stream decodes). A stream
    that ended first (EOS, an error) or a wait past ``timeout_s`` raises instead of waiting for ever."""
    pending = [s for s in streams if len(s["times"]) < 4]
    ended = [s["id"] for s in pending if ("done" in s and s["done"].is_set()) or ("task" in s and s["task"].done())]
    if ended:
        raise RuntimeError(f"stream(s) {ended} ended before streaming 4 pieces: no decode for the burst to meet")
    if pending and time.perf_counter() - since > timeout_s:
        raise TimeoutError(f"{len(pending)} stream(s) did not start decoding within {timeout_s:.0f} s")
    return bool(pending)


class Client:
    """Requests to one of our engines as a server's client threads send them: ``send`` submits and a
    thread records the time of each streamed piece; ``wait`` blocks until they end."""

    def __init__(self, engine):
        self.engine = engine

    def send(self, ids, max_tokens, **kwargs) -> dict:
        from session.engine import GenerationRequest
        from session.engine.events import Cancelled, EventStream, Failed, Finished, TextDelta
        from session.types import SamplingParams

        request = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=max_tokens), stream=EventStream(),
                                    token_ids=list(ids), request_id=f"q{random.random()}", **kwargs)
        record = {"sent": time.perf_counter(), "times": [], "tokens": 0, "id": request.request_id,
                  "done": threading.Event()}

        def read():
            while True:
                event = request.stream.get(timeout=600)
                if isinstance(event, TextDelta):
                    record["times"].append(time.perf_counter())
                elif isinstance(event, (Finished, Cancelled, Failed)):
                    if isinstance(event, Finished):
                        record["tokens"] = len(event.token_ids)
                        record["answer"] = list(event.token_ids)
                    elif isinstance(event, Failed):
                        record["error"] = str(event.error)
                    record["done"].set()
                    return

        self.engine.submit(request)
        threading.Thread(target=read, daemon=True).start()
        return record

    @staticmethod
    def wait(records):
        for r in records:
            if not r["done"].wait(600):
                raise TimeoutError(f"request {r['id']} did not end within 600 s")
            if "error" in r:
                raise RuntimeError(f"request failed: {r['error']}")


def ours(model: Path, seeds: list[int], budget: int, threads: int) -> list[dict]:
    from session.config import EngineConfig
    from session.engine import Engine

    engine = Engine(EngineConfig(model_path=str(model), speculative="off", max_device_adapters=0, threads=threads,
                                 step_token_budget=budget)).start()
    client = Client(engine)
    send, wait = client.send, client.wait

    try:
        vocab = model_vocab(model)
        wait([send(workload(10_000, vocab)["burst"][0], 4)])  # warm-up: kernels built, threads measured
        out = []
        for seed in seeds:
            w = workload(seed, vocab)
            streams = [send(ids, STREAM_NEW) for ids in w["streams"]]
            since = time.perf_counter()
            while still_starting(streams, since):
                time.sleep(0.01)
            began = time.perf_counter()
            burst = [send(ids, BURST_NEW) for ids in w["burst"]]
            wait(burst)
            c = report([s["times"] for s in streams], burst, began)
            for s in streams:
                engine.cancel(s["id"])
            wait(streams)
            talks = [send(ids, OPENING_NEW, session_id=f"t{seed}-{i}", open_session=True)
                     for i, ids in enumerate(w["openings"])]
            wait(talks)
            burst = [send(ids, BURST_NEW) for ids in w["burst2"]]
            time.sleep(FOLLOW_DELAY_S)
            follow = [send(q, FOLLOW_NEW, session_id=f"t{seed}-{i}") for i, q in enumerate(w["questions"])]
            wait(burst + follow)
            d = report([], burst, 0.0, follow)
            out.append({"seed": seed, "burst": c, "follow": d,
                        "follow_answers": [r["answer"] for r in follow]})
        return out
    finally:
        engine.stop()


# ---------------------------------------------------------------- vLLM (its own interpreter)


AVX2_SITE = """import torch
torch.cpu._is_avx512_supported = lambda: False  # vLLM's platform then imports vllm._C_AVX2
"""


def cap_vllm_at_avx2() -> None:
    """Make this process and every one vLLM spawns (its engine core, its workers) see no AVX-512, so
    that each loads ``vllm._C_AVX2``: vLLM asks torch's CPU probe, which reads the hardware, not
    ATEN_CPU_CAPABILITY. A ``sitecustomize`` on PYTHONPATH runs in every spawned interpreter."""
    import tempfile

    import torch

    torch.cpu._is_avx512_supported = lambda: False
    site = Path(tempfile.mkdtemp(prefix="avx2-site-"))
    (site / "sitecustomize.py").write_text(AVX2_SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))


def vllm_worker(model: Path, seeds: list[int], kv_cache_gb: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if os.environ.get("RESIDENT_KERNEL_ISA", "").lower() == "avx2":  # vLLM loads its AVX2 library too
        cap_vllm_at_avx2()
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model), dtype="float32", enable_prefix_caching=True,
                                                       max_model_len=4096, seed=0))
    counter = [0]

    def send(ids, max_tokens) -> dict:
        counter[0] += 1
        rid = f"q{counter[0]}"
        record = {"sent": time.perf_counter(), "times": [], "tokens": 0, "id": rid, "answer": []}

        async def run():
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
            async for output in engine.generate(TokensPrompt(prompt_token_ids=list(ids)), params, rid):
                if output.outputs and output.outputs[0].token_ids:
                    record["times"].append(time.perf_counter())
                    record["answer"] += list(output.outputs[0].token_ids)
            record["tokens"] = len(record["answer"])

        record["task"] = asyncio.ensure_future(run())
        return record

    async def wait(records):
        await asyncio.gather(*(r["task"] for r in records))

    async def main():
        vocab = model_vocab(model)
        await wait([send(workload(10_000, vocab)["burst"][0], 4)])
        out = []
        for seed in seeds:
            w = workload(seed, vocab)
            streams = [send(ids, STREAM_NEW) for ids in w["streams"]]
            since = time.perf_counter()
            while still_starting(streams, since):
                await asyncio.sleep(0.01)
            began = time.perf_counter()
            burst = [send(ids, BURST_NEW) for ids in w["burst"]]
            await wait(burst)
            c = report([s["times"] for s in streams], burst, began)
            for s in streams:
                await engine.abort(s["id"])
            await asyncio.gather(*(s["task"] for s in streams), return_exceptions=True)
            talks = [send(ids, OPENING_NEW) for ids in w["openings"]]
            await wait(talks)
            burst = [send(ids, BURST_NEW) for ids in w["burst2"]]
            await asyncio.sleep(FOLLOW_DELAY_S)
            follow = [send(o + t["answer"] + q, FOLLOW_NEW) for o, t, q in zip(w["openings"], talks, w["questions"])]
            await wait(burst + follow)
            d = report([], burst, 0.0, follow)
            out.append({"seed": seed, "burst": c, "follow": d, "follow_answers": [r["answer"] for r in follow]})
        return out

    try:
        runs = asyncio.get_event_loop().run_until_complete(main())
    finally:
        engine.shutdown()
    scheduler = engine.vllm_config.scheduler_config
    return {"runs": runs, "scheduler": {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
                                        "max_num_seqs": scheduler.max_num_seqs,
                                        "chunked_prefill": scheduler.enable_chunked_prefill}}


def run_vllm(python: str, model: Path, seeds: list[int], kv_cache_gb: int) -> dict:
    return run_peer_worker(__file__, python, model, seeds, kv_cache_gb)


# ---------------------------------------------------------------- report

KEYS = [("(c) burst: first token p50 (s)", "burst", "burst_ttft_p50_s"),
        ("(c) burst: first token worst (s)", "burst", "burst_ttft_max_s"),
        ("(c) decoding streams: longest stall (s)", "burst", "stream_longest_gap_s"),
        ("(d) follow-ups: first token median (s)", "follow", "follow_ttft_median_s"),
        ("(d) follow-ups: first token worst (s)", "follow", "follow_ttft_max_s"),
        ("(d) cold burst: first token p50 (s)", "follow", "burst_ttft_p50_s")]


def summarize(runs: list[dict]) -> dict:
    return {f"{scenario}.{key}": statistics.median(r[scenario][key] for r in runs) for _, scenario, key in KEYS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--budget", type=int, default=256, help="our token budget in the comparison")
    parser.add_argument("--budgets", default="64,256,1024", help="our token budgets measured (comma-separated)")
    add_peer_arguments(parser, REPO / "benchmarks" / "results" / "burst.json")
    args = parser.parse_args()
    if args.worker:
        args.out.write_text(json.dumps(vllm_worker(args.model, [int(s) for s in args.seeds.split(",")],
                                                   args.kv_cache_gb)))
        return 0
    seeds = list(range(1, args.repeats + 1))
    budgets = sorted({int(b) for b in args.budgets.split(",")} | {args.budget})
    ours_runs = {budget: ours(args.model, seeds[:1], budget, args.threads) for budget in budgets}
    peer = run_vllm(args.vllm_python, args.model, seeds, args.kv_cache_gb) if args.vllm_python else None
    for budget in budgets:
        ours_runs[budget] += ours(args.model, seeds[1:], budget, args.threads) if seeds[1:] else []
    mine = {budget: summarize(runs) for budget, runs in ours_runs.items()}
    theirs = summarize(peer["runs"]) if peer else None
    table = []
    for label, scenario, key in KEYS:
        value, other = mine[args.budget][f"{scenario}.{key}"], theirs[f"{scenario}.{key}"] if theirs else None
        table.append([label, f"{value:.3f}", "" if other is None else f"{other:.3f}",
                      f"{value / other:.2f}" if other else ""])
    print(f"ours with a token budget of {args.budget}; vLLM {peer['scheduler'] if peer else '(not run)'}")
    print(format_table(["scenario", "ours", "vLLM", "ours / vLLM"], table))
    print("\nours by token budget (RESIDENT_STEP_TOKEN_BUDGET):")
    print(format_table(["budget", *[label for label, _, _ in KEYS]],
                       [[budget, *[f"{mine[budget][f'{s}.{k}']:.3f}" for _, s, k in KEYS]] for budget in budgets]))
    same = None
    if peer:  # the same model, greedy, float32: the follow-ups' answers should agree
        pairs = [(a, b) for r, p in zip(ours_runs[args.budget], peer["runs"])
                 for a, b in zip(r["follow_answers"], p["follow_answers"])]
        same = sum(a == b for a, b in pairs)
        print(f"\nfollow-up answers equal to vLLM's: {same} of {len(pairs)}")
    write_json(args.out, {"ours": {str(b): runs for b, runs in ours_runs.items()}, "vllm": peer,
                          "summary": {"ours": {str(b): s for b, s in mine.items()}, "vllm": theirs},
                          "budget": args.budget, "model": str(args.model), "follow_answers_equal": same})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
