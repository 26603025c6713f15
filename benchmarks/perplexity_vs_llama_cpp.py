"""Perplexity beside llama.cpp's ``llama-perplexity`` on the same text and the same files: SmolLM2-135M-
Instruct as float32, int8, int4, and its GGUF files served as they are, with float32 or int8 activations.

The text: this Python's own ``collections/__init__.py`` (a file every machine has), written to a file
for llama-perplexity. Both score it as llama-perplexity does: consecutive chunks of --ctx tokens, each a
fresh context, the second half of each chunk scored (the first half is its context), perplexity =
exp(mean negative log-likelihood). Ours: transformers' model with our linears in place (session/model/
quantize.py, session/model/gguf.py: the modules the engine runs), the text tokenized by the model's own
tokenizer; llama.cpp tokenizes with its own copy of the same vocabulary, so the two may split a few
characters differently (the token counts are printed).

Rows (ours | llama.cpp): float32 | f32; int8 (per-channel, float rows) | Q8_0; Q8_0 file, float rows and
int8 rows | Q8_0; int4 in groups of 32 (the default) and of 64 (float rows) | Q4_1; Q4_1 file, float
rows and int8 rows | Q4_1; the float32 checkpoint in compressed-tensors' W4A16 (groups of 64,
symmetric, and groups of 32 with zero points: model_store/build_compressed.py, served packed) | Q4_1.
The files are benchmarks/vs_llama_cpp.py's (built there if absent).

Run: python -m benchmarks.perplexity_vs_llama_cpp [--ctx 512] [--chunks 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import REPO, format_table, write_json
from benchmarks.vs_llama_cpp import gguf_files

ROWS = [  # (label, RESIDENT_QUANTIZATION on the float32 checkpoint or None for the file, file type, int8 rows,
    #          RESIDENT_INT4_GROUP)
    ("float32", "none", "f32", False, 32), ("int8, float rows", "int8", "Q8_0", False, 32),
    ("Q8_0 file, float rows", None, "Q8_0", False, 32), ("Q8_0 file, int8 rows", None, "Q8_0", True, 32),
    ("int4 (groups of 32), float rows", "int4", "Q4_1", False, 32),
    ("int4 (groups of 64), float rows", "int4", "Q4_1", False, 64),
    ("Q4_1 file, float rows", None, "Q4_1", False, 32), ("Q4_1 file, int8 rows", None, "Q4_1", True, 32),
    ("W4A16 checkpoint, float rows", "w4a16", "Q4_1", False, 32),  # compressed-tensors (build_compressed.py)
    ("W4A16 asymmetric checkpoint, float rows", "w4a16-asym", "Q4_1", False, 32),
]


def model_for(row: tuple, model_path: Path, files: dict[str, Path]):
    """transformers' model with the engine's linears for ``row``; its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from session.checkpoints import locate
    from session.model import gguf
    from session.model.cpu import linear as cpu_linear
    from session.model.quantize import quantize_language_model

    _, method, kind, int8_rows, int4_group = row
    assert cpu_linear.INT8_KERNEL.load() and cpu_linear.INT4_KERNEL.load() and cpu_linear.Q8_KERNEL.load()
    if method in ("w4a16", "w4a16-asym"):
        from model_store.build_compressed import build
        from session.model import compressed

        folder = build(model_path, method)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     **compressed.load_kwargs("compressed-tensors")).eval()
        report = compressed.keep_packed(model, list(model.model.layers), str(folder), "compressed-tensors", "",
                                        int8_rows)
        print(report.describe(), file=sys.stderr)
        return model, AutoTokenizer.from_pretrained(folder)
    if method is not None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        if method != "none":
            quantize_language_model(model, list(model.model.layers), method, torch.device("cpu"), int8_rows=int8_rows,
                                    int4_largest=int4_group)
        return model, AutoTokenizer.from_pretrained(model_path)
    checkpoint = locate(files[kind])
    model = AutoModelForCausalLM.from_pretrained(checkpoint.folder, dtype=torch.float32, **checkpoint.kwargs).eval()
    report = gguf.keep_packed(model, list(model.model.layers), files[kind], "", int8_rows=int8_rows)
    print(report.describe(), file=sys.stderr)
    return model, AutoTokenizer.from_pretrained(checkpoint.folder, **checkpoint.kwargs)


def our_perplexity(model, tokenizer, text: str, ctx: int, chunks: int) -> tuple[float, int]:
    """(perplexity, tokens scored): llama-perplexity's chunks and halves."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, min(chunks, len(ids) // ctx) * ctx, ctx):
            chunk = torch.tensor([ids[start:start + ctx]])
            logits = model(input_ids=chunk).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits[ctx // 2 - 1:], chunk[0, ctx // 2:], reduction="sum")
            total, count = total + float(nll), count + ctx - ctx // 2
    return math.exp(total / count), count


def llama_perplexity(tools: Path, model: Path, text_file: Path, ctx: int, chunks: int, threads: int) -> float:
    result = subprocess.run([str(tools / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c", str(ctx),
                             "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)],
                            capture_output=True, text=True, timeout=1800, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{(result.stdout + result.stderr)[-2000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--llama-cpp", type=Path, default=REPO / "build" / "llama.cpp")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    tools = args.llama_cpp / "bin"
    if not (tools / "llama-perplexity").exists():
        print(f"no llama-perplexity in {tools}: run scripts/build_llama_cpp.sh first", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    files = gguf_files(args.model_path, args.llama_cpp, REPO / "build" / "gguf")
    text = Path(collections.__file__).read_text()
    text_file = REPO / "build" / "gguf" / "perplexity.txt"
    text_file.write_text(text)
    theirs = {kind: llama_perplexity(tools, files[kind], text_file, args.ctx, args.chunks, args.threads)
              for kind in ("f32", "Q8_0", "Q4_1")}
    table, results = [], {}
    for row in ROWS:
        model, tokenizer = model_for(row, args.model_path, files)
        ppl, scored = our_perplexity(model, tokenizer, text, args.ctx, args.chunks)
        label, kind = row[0], row[2]
        results[label] = {"ours": ppl, "tokens": scored, "llama_cpp": theirs[kind], "file": kind}
        table.append([label, f"{ppl:.3f}", kind, f"{theirs[kind]:.3f}"])
    print(f"perplexity on collections/__init__.py, {args.chunks} chunks of {args.ctx} tokens (second halves scored)")
    print(format_table(["ours", "perplexity", "llama.cpp", "perplexity"], table))
    write_json(args.out / "perplexity_vs_llama_cpp.json", {"ctx": args.ctx, "chunks": args.chunks, "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
