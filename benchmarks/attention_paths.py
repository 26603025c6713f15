"""Decode step time, batched vs per-row attention, interleaved in one run (the RESIDENT_ATTENTION choice).

Workload (LLaVA-shaped, models/llava-bench): B sessions, each with a prefilled context of
``--context`` tokens (576 image tokens + a question, by default), then decode steps for all B
together. Each round times one step of every path on its own copy of the sessions (same weights,
same contexts), so background load hits both paths alike; the table gives the median ms per step
and per token, and the ratio per_row / batched (> 1: batched is faster).

Run: python -m benchmarks.attention_paths [--levels 1 16] [--steps 32] [--context 600] [--threads 1]

``--layouts`` instead times the per-row path over a head-major and a token-major pool
(session/model/kv_pool.py; CPU uses head-major) and checks that both give the same logits, with
torch's attention on both (RESIDENT_CPU_KERNELS=false: our kernels read head-major pools only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import BENCH_MODEL, REPO, ensure_bench_model, format_table, median, write_json

PATHS = ("per_row", "batched")
LAYOUTS = ("consecutive", "interleaved")  # how each session's blocks lie in the pool
POOL_LAYOUTS = ("head-major", "token-major")  # the pool's own layout (session/model/kv_cache.py)


def sessions(runner, num_rows: int, context: int, block_tokens: int, interleaved: bool, pool=None) -> list:
    """``num_rows`` caches holding ``context`` tokens each (distinct random embeddings). ``interleaved``
    prefills them a block at a time in turn, so that no session's blocks are consecutive in the pool
    (as after sessions grew side by side while decoding): per-row reads then gather instead of slicing."""
    generator = torch.Generator().manual_seed(num_rows)
    kvs = [pool.new_cache(runner.info.max_positions) if pool is not None else
           runner.new_kv_cache(block_tokens=block_tokens, max_tokens=runner.info.max_positions)
           for _ in range(num_rows)]
    # made on the host (one seeded generator whatever the device), then moved to the runner's device
    embeds = [torch.randn(context, runner.info.hidden_size, generator=generator).to(runner.device, runner.dtype)
              for _ in kvs]
    chunk = block_tokens if interleaved else context
    for start in range(0, context, chunk):
        for kv, e in zip(kvs, embeds):
            runner.prefill(kv, e[start : start + chunk])
    return kvs


def synchronize(runner) -> None:
    """Wait for the device's queued work (CUDA launches return before the kernels run), so a step's
    wall time is the step's, not its launches'; nothing on CPU."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def measure(runner, num_rows: int, context: int, steps: int, block_tokens: int) -> dict:
    """Median seconds per decode step, per (path, layout), measured round-robin."""
    cases = [(path, layout) for layout in LAYOUTS for path in PATHS]
    caches = {case: sessions(runner, num_rows, context, block_tokens, case[1] == "interleaved") for case in cases}
    times: dict[tuple, list[float]] = {case: [] for case in cases}
    tokens = [7] * num_rows
    for step in range(steps + 2):  # the first two rounds warm up
        for case in cases:
            runner.decode_attention = case[0]
            synchronize(runner)
            began = time.perf_counter()
            runner.decode(caches[case], tokens)
            synchronize(runner)
            if step >= 2:
                times[case].append(time.perf_counter() - began)
    for kvs in caches.values():
        for kv in kvs:
            kv.release()
    return {case: median(t) for case, t in times.items()}


def measure_pool_layouts(runner, num_rows: int, context: int, steps: int, block_tokens: int) -> dict:
    """Median seconds per per-row decode step over a head-major and a token-major pool (the same
    contexts, consecutive blocks), measured round-robin; and whether both gave the same logits."""
    from session.model.kv_cache import KVPool

    info = runner.info
    pools = {layout: KVPool(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                            dtype=runner.kv_dtype, device=runner.device, block_tokens=block_tokens,
                               head_major=layout == "head-major") for layout in POOL_LAYOUTS}
    caches = {layout: sessions(runner, num_rows, context, block_tokens, False, pool) for layout, pool in pools.items()}
    times: dict[str, list[float]] = {layout: [] for layout in pools}
    logits = {}
    runner.decode_attention = "per_row"
    for step in range(steps + 2):  # the first two rounds warm up
        for layout, kvs in caches.items():
            synchronize(runner)
            began = time.perf_counter()
            logits[layout] = runner.decode(kvs, [7] * num_rows)
            synchronize(runner)
            if step >= 2:
                times[layout].append(time.perf_counter() - began)
    same = torch.equal(*logits.values())
    return {layout: median(t) for layout, t in times.items()} | {"same_logits": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(BENCH_MODEL))
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's CPU default is 1)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="RESIDENT_DTYPE of the runner")
    parser.add_argument("--layouts", action="store_true",
                        help="instead: per-row decode over a head-major vs a token-major pool (CPU's choice)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    ensure_bench_model(args.model_path)
    if args.threads:
        torch.set_num_threads(args.threads)
    from session.model.runner import ModelRunner

    # --layouts: torch's attention over both pools (our CPU kernels read a head-major pool only, so
    # with them the two columns would compare kernels, not layouts)
    runner = ModelRunner(args.model_path, device=args.device, dtype=args.dtype, cpu_kernels=not args.layouts)
    if args.layouts:
        return main_layouts(args, runner)
    results, rows = {}, []
    for level in args.levels:
        step_s = measure(runner, level, args.context, args.steps, args.block_tokens)
        for layout in LAYOUTS:
            per_row, batched = step_s["per_row", layout], step_s["batched", layout]
            results[f"{level}/{layout}"] = {"per_row_s": per_row, "batched_s": batched}
            rows.append([level, layout, 1000 * per_row, 1000 * batched, 1000 * per_row / level,
                         1000 * batched / level, per_row / batched])
    print(f"device {runner.device}, {torch.get_num_threads()} threads, context {args.context} tokens, "
          f"blocks of {args.block_tokens}")
    print(format_table(["batch", "blocks", "per_row ms/step", "batched ms/step", "per_row ms/token",
                        "batched ms/token", "per_row / batched"], rows))
    write_json(args.out / "attention_paths.json", {"settings": vars(args) | {"out": str(args.out)},
                                                   "results": results})
    return 0


def main_layouts(args, runner) -> int:
    results, rows = {}, []
    for level in args.levels:
        step_s = measure_pool_layouts(runner, level, args.context, args.steps, args.block_tokens)
        results[str(level)] = step_s
        rows.append([level, 1000 * step_s["head-major"], 1000 * step_s["token-major"],
                     step_s["token-major"] / step_s["head-major"], step_s["same_logits"]])
    print(f"device {runner.device}, {runner.dtype}, {torch.get_num_threads()} threads, context {args.context} "
          f"tokens, blocks of {args.block_tokens}, per-row attention")
    print(format_table(["batch", "head-major ms/step", "token-major ms/step", "token / head", "same logits"], rows))
    write_json(args.out / "attention_layouts.json", {"settings": vars(args) | {"out": str(args.out)},
                                                     "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
