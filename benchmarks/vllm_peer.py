"""The optional peer: vLLM's CPU build on the same decode and follow-up workload as our engine.

Run with the peer's own interpreter, never the project's (install: benchmarks/requirements-vllm.txt):

    build/vllm-venv/bin/python benchmarks/vllm_peer.py --model models/llava-bench \\
        --out benchmarks/results/vllm_peer.json

It loads the model with vLLM's offline API (prefix caching on, block size 32, float32) and measures:
  decode     at each concurrency C (default 1, 4, 16): C sessions, each a distinct 336x336 image plus
             the opening question, submitted together; 64 new tokens each, greedy, ignore_eos. Every
             batch runs once unmeasured first, so the measured runs find their prompts in the prefix
             cache and all C requests decode side by side, as resident sessions do. Per-token decode
             latency is (last token - first token) / (tokens - 1) from vLLM's per-request engine
             timestamps (RequestOutput.metrics), median over requests; aggregate decode tokens/s is
             the decode tokens of the batch over the span from its first first-token to its last token.
  follow-up  N two-turn conversations: turn 1 = a new image + the ~20-token opening question,
             turn 2 = the whole history as text (what a stateless OpenAI client sends) + a ~15-token
             follow-up; 32 new tokens each turn. Turn 2's latency is the wall time of llm.chat.

The questions and images are those of benchmarks.first_vs_followup (same seeds, same texts).
The model directory is read as is, except that a checkpoint saved by transformers 5 (vision tower
keys without the ``vision_model.`` level) is rewritten once, renamed only, into build/vllm-peer/.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import format_table, median, percentile, write_json  # noqa: E402
from benchmarks.first_vs_followup import FOLLOWUP_QUESTIONS, WARMUP_SEED, has_vision, opening_message, user_message  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FOLLOWUP_SEED_BASE = 1_000  # turn-1 images of the follow-up test; distinct from the decode batches' seeds
# The peer configuration: prefix caching with 32-token blocks, float32 as our engine runs.
ENGINE_OPTIONS = {"enable_prefix_caching": True, "block_size": 32, "dtype": "float32", "max_model_len": 4096}


# ---------------------------------------------------------------- environment and model


def configure_environment(args: argparse.Namespace) -> dict[str, str]:
    """Set vLLM's CPU knobs before vllm is imported; returns what was set, for the JSON.

    The engine core and its worker are spawned processes, so the variables reach them from here.
    """
    settings = {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb),
        # "auto" on 2 cores: one OpenMP thread bound to core 0, core 1 left to the engine core process.
        "VLLM_CPU_OMP_THREADS_BIND": args.omp_cpus,
        "VLLM_LOGGING_LEVEL": "INFO" if args.verbose else "WARNING",
    }
    preload = [str(p) for p in _preload_libraries() if args.preload]
    if preload:  # vLLM's CPU guide asks for Intel OpenMP (shipped in the venv by intel-openmp) preloaded
        settings["LD_PRELOAD"] = ":".join(preload + [os.environ.get("LD_PRELOAD", "")]).rstrip(":")
    os.environ.update(settings)
    return settings


def _preload_libraries() -> list[Path]:
    candidates = [Path(sys.prefix) / "lib" / "libiomp5.so",
                  Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")]
    return [p for p in candidates if p.exists()]


def vllm_checkpoint(model_dir: Path, cache_root: Path) -> Path:
    """``model_dir`` itself if vLLM can load its weights, else a renamed copy under ``cache_root``.

    transformers 5 saves LLaVA's CLIP tower as ``vision_tower.encoder.*``; vLLM's loader expects
    ``vision_tower.vision_model.encoder.*``. Tensors are copied unchanged; other files are symlinked.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = model_dir / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        keys = list(f.keys())
        if not any(k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") for k in keys):
            return model_dir
        target = cache_root / model_dir.resolve().name
        converted = target / "model.safetensors"
        if converted.exists() and converted.stat().st_mtime >= weights.stat().st_mtime:
            return target
        target.mkdir(parents=True, exist_ok=True)
        tensors = {_vllm_key(k): f.get_tensor(k) for k in keys}
    save_file(tensors, str(converted), metadata={"format": "pt"})
    for source in model_dir.iterdir():
        link = target / source.name
        if source.name != "model.safetensors" and not link.exists():
            link.symlink_to(source.resolve())
    return target


def _vllm_key(key: str) -> str:
    prefix = "vision_tower."
    if key.startswith(prefix) and not key.startswith(prefix + "vision_model."):
        return prefix + "vision_model." + key[len(prefix):]
    return key


def load_llm(model: Path, max_num_batched_tokens: int, dtype: str, images: bool):
    """vLLM's offline engine. The encoder cache holds ``max_num_batched_tokens`` image tokens: at
    the default 4096 only 7 of 576-token images stay encoded, so a batch of 16 resident sessions
    would re-encode its images while decoding, and the decode figures would time CLIP instead."""
    from vllm import LLM

    multimodal = {"limit_mm_per_prompt": {"image": 1}} if images else {}
    return LLM(model=str(model), **(ENGINE_OPTIONS | {"dtype": dtype}), **multimodal, seed=0,
               max_num_batched_tokens=max_num_batched_tokens,
               disable_log_stats=False)  # per-request timestamps (RequestOutput.metrics) need stats on


# ---------------------------------------------------------------- conversations


def greedy(max_tokens: int):
    from vllm import SamplingParams

    # ignore_eos: random weights may emit EOS at any step; every request then decodes exactly max_tokens.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class RequestTiming:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache
    output_tokens: int
    ttft_s: float  # engine: queued -> first token
    decode_s: float  # engine: first token -> last token
    per_token_s: float  # decode_s / (output_tokens - 1)
    first_token_ts: float  # engine core monotonic clock, only comparable within one run
    last_token_ts: float


def timing_of(output) -> RequestTiming:
    stats = output.metrics
    if stats is None or not stats.first_token_ts:
        raise RuntimeError("vLLM returned no request metrics; the LLM must be built with disable_log_stats=False")
    tokens = len(output.outputs[0].token_ids)
    decode_s = stats.last_token_ts - stats.first_token_ts
    return RequestTiming(prompt_tokens=len(output.prompt_token_ids), cached_tokens=output.num_cached_tokens or 0,
                         output_tokens=tokens, ttft_s=stats.first_token_ts - stats.queued_ts, decode_s=decode_s,
                         per_token_s=decode_s / max(tokens - 1, 1), first_token_ts=stats.first_token_ts,
                         last_token_ts=stats.last_token_ts)


# ---------------------------------------------------------------- decode


@dataclass
class DecodeRun:
    concurrency: int
    wall_s: float  # llm.chat for the whole batch, prompt rendering included
    decode_tokens_per_s: float  # sum(tokens - 1) / (last last-token - first first-token)
    end_to_end_tokens_per_s: float  # sum(tokens) / wall_s
    requests: list[RequestTiming]


def decode_batch(llm, concurrency: int, new_tokens: int, images: bool) -> DecodeRun:
    conversations = [[opening_message(i, images)] for i in range(concurrency)]
    start = time.perf_counter()
    outputs = llm.chat(conversations, greedy(new_tokens), use_tqdm=False)
    wall_s = time.perf_counter() - start
    requests = [timing_of(o) for o in outputs]
    span_s = max(r.last_token_ts for r in requests) - min(r.first_token_ts for r in requests)
    decode_tokens = sum(r.output_tokens - 1 for r in requests)
    return DecodeRun(concurrency=concurrency, wall_s=wall_s, decode_tokens_per_s=decode_tokens / span_s,
                     end_to_end_tokens_per_s=sum(r.output_tokens for r in requests) / wall_s, requests=requests)


def measure_decode(llm, concurrency: int, new_tokens: int, repeats: int, images: bool) -> list[DecodeRun]:
    """One unmeasured batch (fills the prefix cache, compiles this batch size), then ``repeats`` measured."""
    decode_batch(llm, concurrency, new_tokens, images)
    return [decode_batch(llm, concurrency, new_tokens, images) for _ in range(repeats)]


def summarize_decode(runs: list[DecodeRun]) -> dict:
    per_token = [r.per_token_s for run in runs for r in run.requests]
    return {"concurrency": runs[0].concurrency, "runs": len(runs),
            "per_token_ms_median": 1e3 * median(per_token), "per_token_ms_p90": 1e3 * percentile(per_token, 90),
            "decode_tokens_per_s": median([run.decode_tokens_per_s for run in runs]),
            "end_to_end_tokens_per_s": median([run.end_to_end_tokens_per_s for run in runs]),
            "ttft_ms_median": 1e3 * median([r.ttft_s for run in runs for r in run.requests]),
            "mean_prompt_tokens": sum(r.prompt_tokens for run in runs for r in run.requests) / len(per_token),
            "mean_cached_tokens": sum(r.cached_tokens for run in runs for r in run.requests) / len(per_token)}


# ---------------------------------------------------------------- two-turn conversation


@dataclass
class Conversation:
    seed: int
    first_s: float  # wall time of turn 1 (new image, cold prefix cache)
    followup_s: float  # wall time of turn 2 (whole history re-sent, prefix cache warm)
    first: RequestTiming
    followup: RequestTiming


def converse(llm, seed: int, followup_question: str, new_tokens: int, images: bool) -> Conversation:
    opening = opening_message(seed, images)
    start = time.perf_counter()
    [first] = llm.chat([opening], greedy(new_tokens), use_tqdm=False)
    first_s = time.perf_counter() - start
    history = [opening, {"role": "assistant", "content": first.outputs[0].text}, user_message(followup_question)]
    start = time.perf_counter()
    [followup] = llm.chat(history, greedy(new_tokens), use_tqdm=False)
    followup_s = time.perf_counter() - start
    return Conversation(seed=seed, first_s=first_s, followup_s=followup_s, first=timing_of(first),
                        followup=timing_of(followup))


def measure_followups(llm, conversations: int, new_tokens: int, images: bool) -> list[Conversation]:
    converse(llm, WARMUP_SEED, FOLLOWUP_QUESTIONS[0], new_tokens, images)  # warm-up, not counted
    return [converse(llm, FOLLOWUP_SEED_BASE + i, FOLLOWUP_QUESTIONS[i % len(FOLLOWUP_QUESTIONS)], new_tokens,
                     images) for i in range(conversations)]


def summarize_followups(conversations: list[Conversation]) -> dict:
    followup_s = [c.followup_s for c in conversations]
    return {"n": len(conversations), "followup_s_median": median(followup_s),
            "followup_s_p90": percentile(followup_s, 90), "first_s_median": median([c.first_s for c in conversations]),
            "followup_ttft_ms_median": 1e3 * median([c.followup.ttft_s for c in conversations]),
            "followup_per_token_ms_median": 1e3 * median([c.followup.per_token_s for c in conversations]),
            "mean_followup_prompt_tokens": sum(c.followup.prompt_tokens for c in conversations) / len(conversations),
            "mean_followup_cached_tokens": sum(c.followup.cached_tokens for c in conversations) / len(conversations)}


# ---------------------------------------------------------------- output


def report(decode: list[dict], followup: dict) -> str:
    headers = ["vLLM CPU: decode", "per-token ms (median)", "p90 ms", "decode tok/s", "end-to-end tok/s",
               "prompt tok", "cached tok"]
    rows = [[f"concurrency {d['concurrency']}", d["per_token_ms_median"], d["per_token_ms_p90"],
             d["decode_tokens_per_s"], d["end_to_end_tokens_per_s"], round(d["mean_prompt_tokens"], 1),
             round(d["mean_cached_tokens"], 1)] for d in decode]
    lines = [format_table(headers, rows), ""]
    lines.append(format_table(
        ["vLLM CPU: 2-turn", "n", "median s", "p90 s", "ttft ms", "per-token ms", "prompt tok", "cached tok"],
        [["first turn (new image)", followup["n"], followup["first_s_median"], "", "", "", "", ""],
         ["follow-up (history re-sent)", followup["n"], followup["followup_s_median"], followup["followup_s_p90"],
          followup["followup_ttft_ms_median"], followup["followup_per_token_ms_median"],
          round(followup["mean_followup_prompt_tokens"], 1), round(followup["mean_followup_cached_tokens"], 1)]]))
    return "\n".join(lines)


def versions() -> dict[str, str]:
    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "llava-bench")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm_peer.json")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="measured batches per concurrency")
    parser.add_argument("--conversations", type=int, default=5, help="two-turn conversations measured")
    parser.add_argument("--turn-tokens", type=int, default=32, help="new tokens in each turn")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="vLLM's per-step token budget, also its encoder cache size (image tokens)")
    parser.add_argument("--kv-cache-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV")
    parser.add_argument("--omp-cpus", default="auto",
                        help="VLLM_CPU_OMP_THREADS_BIND: 'auto' (vLLM's choice), '0-1', 'nobind', ...")
    parser.add_argument("--no-preload", dest="preload", action="store_false",
                        help="do not LD_PRELOAD the venv's Intel OpenMP (and tcmalloc where installed)")
    parser.add_argument("--verbose", action="store_true", help="vLLM's INFO logs")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.decode_tokens < 2 or args.turn_tokens < 1 or args.repeats < 1 \
            or args.conversations < 1 or args.kv_cache_gb < 1:
        parser.error("need concurrency >= 1, --decode-tokens >= 2, --turn-tokens, --repeats, --conversations, "
                     "--kv-cache-gb >= 1")
    if not (args.model / "config.json").exists():
        parser.error(f"{args.model} has no config.json; build it: .venv/bin/python -m model_store.build_models "
                     "--only bench")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    environment = configure_environment(args)
    model = vllm_checkpoint(args.model, REPO / "build" / "vllm-peer")
    start = time.perf_counter()
    images = has_vision(args.model)  # a text-only model gets FIRST_QUESTION after a ~500-token document
    llm = load_llm(model, args.max_num_batched_tokens, args.dtype, images)
    load_s = time.perf_counter() - start
    decode_runs = {c: measure_decode(llm, c, args.decode_tokens, args.repeats, images) for c in args.concurrency}
    conversations = measure_followups(llm, args.conversations, args.turn_tokens, images)
    decode = [summarize_decode(runs) for runs in decode_runs.values()]
    followup = summarize_followups(conversations)
    print(report(decode, followup))
    settings = {"model": str(args.model), "loaded_from": str(model), "load_s": load_s, **ENGINE_OPTIONS,
                "dtype": args.dtype,
                "max_num_batched_tokens": args.max_num_batched_tokens, "decode_tokens": args.decode_tokens,
                "repeats": args.repeats, "turn_tokens": args.turn_tokens, "temperature": 0, "ignore_eos": True,
                "environment": environment, "versions": versions(), "cpu_count": os.cpu_count(),
                # Other work on the machine inflates latencies; a high load here flags a noisy run.
                "loadavg_1m_at_end": os.getloadavg()[0]}
    path = write_json(args.out, {
        "engine": "vllm-cpu", "decode": decode, "followup": followup, "settings": settings,
        "decode_runs": [asdict(run) for runs in decode_runs.values() for run in runs],
        "conversations": [asdict(c) for c in conversations]})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
