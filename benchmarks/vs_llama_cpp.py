"""Decode speed beside llama.cpp on the same CPU, in one run: SmolLM2-135M-Instruct in float32, int8 and
int4 weights, ours (RESIDENT_QUANTIZATION=none, int8, int4: our kernels, float32 activations) against
llama.cpp's f32, Q8_0 and Q4_1 (and Q4_0) files of the same checkpoint.

llama.cpp: built by scripts/build_llama_cpp.sh from the copy vendored in llama-cpp-python's sdist
(native flags). Its GGUF files are made here from our float32 checkpoint with its own
``convert_hf_to_gguf.py`` (``--outtype f32``, a copy of the checkpoint whose config.json names its
architecture) and ``llama-quantize``. Its number: ``llama-bench -p 0 -n N -t T`` (tokens generated
from an empty context, the mean of its repetitions).

Ours: the engine, one request at a time, chat prompts of about 30 tokens, at most N new tokens; per
answer of at least 16 tokens (tokens - 1) / (Finished - Started), the median
(benchmarks/quantization.py's measure). The two servers alternate, each measured twice.

Run: python -m benchmarks.vs_llama_cpp [--llama-cpp build/llama.cpp] [--new-tokens 128] [--threads 2]
                                      [--prompts 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO, format_table, median, write_json
from benchmarks.quantization import answer_all, chat_prompts

PAIRS = [("float32", "none", "f32"), ("int8", "int8", "Q8_0"), ("int4", "int4", "Q4_1"), (None, None, "Q4_0")]


def gguf_files(model_path: Path, llama_cpp: Path, out: Path, types: list[str]) -> dict[str, Path]:
    """Our float32 checkpoint as llama.cpp's f32 GGUF, and each other type by llama-quantize (kept in ``out``)."""
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
    files = {"f32": f32}
    for kind in types:
        if kind == "f32":
            continue
        target = out / f"smollm2-{kind.lower()}.gguf"
        if not target.exists():
            subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), str(f32), str(target), kind], check=True,
                           capture_output=True, timeout=1200)
        files[kind] = target
    return files


def llama_bench(binary: Path, model: Path, new_tokens: int, threads: int) -> float:
    """llama-bench's mean generation speed (tokens/s) from an empty context."""
    result = subprocess.run([str(binary), "-m", str(model), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
                             "-r", "3", "-o", "json"], check=True, capture_output=True, text=True, timeout=1200)
    runs = json.loads(result.stdout)
    return float(runs[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--llama-cpp", type=Path, default=REPO / "build" / "llama.cpp")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="times each engine is measured, alternating")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not (args.llama_cpp / "bin" / "llama-bench").exists():
        print(f"no llama.cpp in {args.llama_cpp}: run scripts/build_llama_cpp.sh first", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    files = gguf_files(args.model_path, args.llama_cpp, REPO / "build" / "gguf", [kind for *_, kind in PAIRS])
    prompts = chat_prompts(AutoTokenizer.from_pretrained(str(args.model_path)), args.prompts)
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for label, method, kind in PAIRS:
            theirs.setdefault(kind, []).append(llama_bench(args.llama_cpp / "bin" / "llama-bench", files[kind],
                                                           args.new_tokens, args.threads))
            if method is not None:
                run = answer_all(str(args.model_path), "float32", method, prompts, args.new_tokens, args.threads)
                ours.setdefault(label, []).append(run["tokens_per_s"])
    rows = []
    for label, _, kind in PAIRS:
        mine = median(ours[label]) if label else None
        other = median(theirs[kind])
        rows.append([label or "-", f"{mine:.1f}" if mine else "-", kind, f"{other:.1f}",
                     f"{mine / other:.2f}x" if mine else "-"])
    print(f"SmolLM2-135M-Instruct decode on CPU, {args.threads} threads, up to {args.new_tokens} new tokens; "
          f"medians of {args.rounds} alternating rounds")
    print(format_table(["ours", "tok/s", "llama.cpp", "tok/s", "ours / llama.cpp"], rows))
    write_json(args.out / "vs_llama_cpp.json", {"threads": args.threads, "new_tokens": args.new_tokens,
                                                 "ours": ours, "llama_cpp": theirs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
