"""Weight-only quantization (RESIDENT_QUANTIZATION) on SmolLM2-135M-Instruct, on CPU: what int8 and int4
cost against float32 in agreement and perplexity, and what they change in weight bytes and decode speed.

Per weights (float32, int8, int4; ATen's kernels, session/model/quantize.py), in each --dtypes
(RESIDENT_DTYPE: the activations' dtype, float32 and bfloat16 by default; ATen's kernels run
bfloat16 activations several times faster than float32 ones):
- agreement: greedy answers through the engine to N fixed chat prompts (the tokenizer's chat template)
  x T new tokens, against unquantized float32's answers (float32 through the engine is transformers' ``generate``
  token for token: tests/integration/test_smollm2.py). Reported: answers identical to the end, and
  the share of float32's tokens before each answer's first difference (after one, the rest of that
  answer is conditioned on other text); and teacher-forced: fed each prompt and float32's answer, the
  share of its tokens that are the quantized model's own greedy choice after the same prefix;
- perplexity on the first --ppl-tokens tokens of this Python's own ``collections/__init__.py``: one
  forward of transformers' model quantized as the engine quantizes it (``quantize_language_model``);
- decode tokens/s at 1 session: the same requests, one at a time; per answer of at least 16 tokens
  (tokens - 1) / (Finished - Started), the median;
- weight bytes: every parameter and buffer of the model (the start-up line's figures).

Run: python -m benchmarks.quantization [--prompts 20] [--new-tokens 64] [--ppl-tokens 1024] [--threads 0]
                                       [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, format_table, median, write_json

METHODS = ("none", "int8", "int4")  # "none": the float32 checkpoint as loaded
PROMPTS = [
    "What is the capital of France?", "Name three colours of the rainbow.", "Write one sentence about the sea.",
    "What is 12 times 12?", "Give me a tip for learning to cook.", "Explain what a CPU does, briefly.",
    "Write a haiku about autumn.", "What is the boiling point of water?", "List three fruits that are red.",
    "How do plants make their food?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Write a Python function that adds two numbers.", "What is a prime number?", "Suggest a name for a cat.",
    "Summarise the story of Cinderella in two sentences.", "What does a compiler do?",
    "Give two reasons to exercise.", "What is the largest planet in the solar system?",
    "Describe a rainy day in three sentences.",
]
MIN_TIMED_TOKENS = 16  # shorter answers are mostly prefill: left out of the decode speed


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False) for text in (PROMPTS * 2)[:count]]
    return [tokenizer(text)["input_ids"] for text in rendered]


def answer_all(model_path: str, dtype: str, method: str, prompts: list[list[int]], new_tokens: int,
               threads: int) -> dict:
    """The engine's greedy answers to ``prompts``, one request at a time, with each decode's duration."""
    from session.config import EngineConfig
    from session.engine import Engine, GenerationRequest
    from session.engine.events import EventStream, Failed, Finished, Started
    from session.types import SamplingParams

    engine = Engine(EngineConfig(model_path=model_path, dtype=dtype, quantization=method, speculative="off",
                                 max_device_adapters=0, max_new_tokens=new_tokens, threads=threads)).start()
    answers, speeds = [], []
    ran_in = str(engine.parts.runner.dtype).removeprefix("torch.")  # bfloat16 falls back to float32 on some CPUs
    try:
        for ids in prompts:
            stream = EventStream(deltas=False)
            engine.submit(GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=new_tokens),
                                            stream=stream, token_ids=ids))
            while not isinstance(event := stream.get(timeout=600), (Finished, Failed)):
                if isinstance(event, Started):
                    started = time.perf_counter()
            if isinstance(event, Failed):
                raise event.error
            answers.append(list(event.token_ids))
            if len(event.token_ids) >= MIN_TIMED_TOKENS:
                speeds.append((len(event.token_ids) - 1) / (time.perf_counter() - started))
    finally:
        engine.stop()
    return {"answers": answers, "tokens_per_s": median(speeds), "timed_answers": len(speeds), "dtype": ran_in}


def agreement(answers: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(answers identical to the reference's, share of its tokens before each first difference)."""
    identical = sum(ours == theirs for ours, theirs in zip(answers, reference))
    before = sum(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                 for ours, theirs in zip(answers, reference))
    return identical, before / sum(map(len, reference))


def scores(model_path: str, dtype: str, method: str, num_tokens: int, prompts: list[list[int]],
           reference: list[list[int]]) -> tuple[float, int, int, float]:
    """(perplexity, tokens scored, model bytes, teacher-forced agreement) of transformers' model: the
    perplexity on the fixed text; the agreement: fed each prompt and float32's answer, the share of
    that answer's tokens that are this model's own greedy choice after the same prefix (llama.cpp's
    "same top p" of ``llama-perplexity --kl-divergence``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from session.model.quantize import model_bytes, quantize_language_model

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    if method != "none":
        quantize_language_model(model, list(model.model.layers), method, torch.device("cpu"))
    text = Path(collections.__file__).read_text()[: 16 * num_tokens]  # more than enough characters
    ids = AutoTokenizer.from_pretrained(model_path)(text)["input_ids"][:num_tokens]
    same = 0
    with torch.inference_mode():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
        for prompt, answer in zip(prompts, reference):
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0]
            chosen = logits[len(prompt) - 1: len(prompt) - 1 + len(answer)].argmax(dim=-1)
            same += int((chosen == torch.tensor(answer)).sum())
    return float(torch.exp(loss.float())), len(ids), model_bytes(model), same / sum(map(len, reference))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for every engine (fixed, so that all are timed alike; 0 = auto)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="RESIDENT_DTYPE values, comma-separated")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not (Path(args.model_path) / "config.json").exists():
        from model_store.build_smollm2 import build

        args.model_path = str(build(Path(args.model_path).parent))
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model_path), args.prompts)
    dtypes = args.dtypes.split(",")
    runs = {(dtype, method): answer_all(args.model_path, dtype, method, prompts, args.new_tokens, args.threads)
            for dtype in dtypes for method in METHODS}
    reference = runs.get(("float32", "none")) or answer_all(args.model_path, "float32", "none", prompts,
                                                             args.new_tokens, args.threads)
    results = []
    for (dtype, method), run in runs.items():
        identical, share = agreement(run["answers"], reference["answers"])
        ppl, scored, nbytes, forced = scores(args.model_path, dtype, method, args.ppl_tokens, prompts,
                                             reference["answers"])
        results.append({"weights": run["dtype"] if method == "none" else f"{method}, {run['dtype']} activations",
                        "dtype": run["dtype"], "quantization": method, "model_bytes": nbytes,
                        "identical_answers": identical, "answers": len(prompts), "agreement": share,
                        "teacher_forced_agreement": forced,
                        "perplexity": ppl, "perplexity_tokens": scored, "decode_tokens_per_s": run["tokens_per_s"],
                        "timed_answers": run["timed_answers"]})
    print(f"SmolLM2-135M-Instruct on CPU, {args.threads} threads; {len(prompts)} chat prompts x "
          f"{args.new_tokens} new tokens (greedy), agreement with float32's; perplexity on the first {results[0]['perplexity_tokens']} tokens "
          f"of {collections.__file__}")
    print(format_table(["weights", "model MB", "identical answers", "tokens before 1st difference",
                        "same greedy token (teacher-forced)", "perplexity", "decode tok/s (1 session)"],
                       [[r["weights"], f"{r['model_bytes'] / 1e6:.1f}", f"{r['identical_answers']}/{r['answers']}",
                         f"{100 * r['agreement']:.1f}%", f"{100 * r['teacher_forced_agreement']:.1f}%",
                         f"{r['perplexity']:.3f}",
                         f"{r['decode_tokens_per_s']:.1f} ({r['timed_answers']} answers)"] for r in results]))
    write_json(args.out / "quantization.json", {"model": args.model_path, "new_tokens": args.new_tokens,
                                                "threads": args.threads, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
