"""Adapters: base vs one adapter vs a mix of four at the same concurrency; and 100 registered
adapters with 8 on the device under a random access pattern (latency including loads).

Runs the engine in-process on the LLaVA-shaped benchmark model's language model (text prompts:
adapters change the LM only). Demo adapters for it are built on first use under
models/adapters-bench (all-linear and attention-only, ranks 4-16); the 100-adapter pool copies
them under new names, so loads from disk are real.

Run: python -m benchmarks.adapters [--concurrency 8] [--requests 32] [--new-tokens 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import BENCH_MODEL, REPO, format_table, percentile, write_json
from launch.torchserve import ensure_demo_models

MIX = ["tone", "domain", "customer", "terse"]


def run_batch(engine, adapters: list[str | None], new_tokens: int, concurrency: int, prompts) -> dict:
    """Send one request per entry of ``adapters`` (None: base), ``concurrency`` at a time."""
    from session.engine import GenerationRequest
    from session.engine.events import EventStream, Failed, Finished
    from session.types import SamplingParams

    latencies: list[float] = []
    tokens: list[int] = []
    gate = threading.Semaphore(concurrency)
    errors: list = []

    def one(index: int, adapter: str | None) -> None:
        with gate:
            # ignore_eos: base and adapters answer differently; each runs to new_tokens all the same
            request = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                                        stream=EventStream(deltas=False), token_ids=prompts[index % len(prompts)],
                                        adapter=adapter)
            start = time.perf_counter()
            engine.submit(request)
            while not isinstance(event := request.stream.get(timeout=600), (Finished, Failed)):
                pass
            if isinstance(event, Failed):
                errors.append(event.error)
            else:
                tokens.append(len(event.token_ids))
            latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(adapters)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return {"tokens_per_s": sum(tokens) / wall, "p50_s": percentile(latencies, 50),
            "p99_s": percentile(latencies, 99), "requests": len(adapters)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(BENCH_MODEL))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--pool", type=int, default=100, help="registered adapters for the random-access run")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if Path(args.model_path).resolve() == BENCH_MODEL.resolve():
        ensure_demo_models(only=["bench"])
    from model_store.build_adapters import build_all
    from session.config import EngineConfig
    from session.engine import Engine

    adapters_dir = REPO / "models" / f"adapters-{Path(args.model_path).name}"
    build_all(Path(args.model_path), adapters_dir, count=4)
    pool_dir = REPO / "build" / "adapter-pool"
    for i in range(args.pool):
        target = pool_dir / f"pool-{i:03d}"
        if not target.exists():
            shutil.copytree(adapters_dir / MIX[i % 4], target)

    engine = Engine(EngineConfig(model_path=args.model_path, adapters_dir=str(adapters_dir), dtype=args.dtype,
                                 max_batch_size=args.concurrency, max_context_tokens=1024)).start()
    prompts = [engine.parts.formatter.opening(_question(i)).token_ids for i in range(16)]
    run_batch(engine, [None, "tone"], 4, 2, prompts)  # warm-up
    results = {}
    workloads = {"base": [None] * args.requests, "one adapter": ["domain"] * args.requests,
                 "mix of 4": [MIX[i % 4] for i in range(args.requests)]}
    for name, adapters in workloads.items():
        for adapter in set(adapters) - {None}:  # resident before timing: this measures serving, not loading
            run_batch(engine, [adapter], 2, 1, prompts)
        results[name] = run_batch(engine, adapters, args.new_tokens, args.concurrency, prompts)
        print(f"{name}: {results[name]}", flush=True)
    engine.stop()

    pool_engine = Engine(EngineConfig(model_path=args.model_path, adapters_dir=str(pool_dir), max_device_adapters=8,
                                      dtype=args.dtype,
                                      max_host_adapters=32, max_batch_size=args.concurrency, max_context_tokens=1024),
                         runner=engine.parts.runner).start()
    rng = random.Random(0)
    names = [f"pool-{rng.randrange(args.pool):03d}" for _ in range(args.requests * 2)]
    results[f"{args.pool} adapters, 8 on device, random"] = run_batch(pool_engine, names, args.new_tokens,
                                                                       args.concurrency, prompts)
    registry = pool_engine.parts.adapters
    loads = {"from_disk": registry.num_loads_from_disk, "to_device": registry.num_loads_to_device,
             "device_evictions": registry.num_device_evictions}
    pool_engine.stop()

    rows = [[name, r["requests"], r["tokens_per_s"], r["p50_s"], r["p99_s"]] for name, r in results.items()]
    print()
    print(format_table(["workload", "requests", "tokens/s", "p50 s", "p99 s"], rows))
    ratio = results["mix of 4"]["tokens_per_s"] / results["base"]["tokens_per_s"]
    print(f"mixed-adapter throughput / base throughput: {ratio:.2f} (aim >= 0.85)")
    print(f"random-access pool: {loads}")
    write_json(args.out / "adapters.json", {"settings": {k: str(v) for k, v in vars(args).items()},
                                            "results": results, "mix_over_base": ratio, "pool_loads": loads})
    return 0


def _question(i: int):
    from session.types import Message, TextPart

    return (Message("user", (TextPart(f"Question {i}: explain what a context manager does in Python."),)),)


if __name__ == "__main__":
    sys.exit(main())
