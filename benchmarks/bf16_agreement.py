"""bfloat16 agreement: our engine in bfloat16 against transformers' own bfloat16 ``generate``.

Greedy, N prompts x T new tokens on a text checkpoint. In bfloat16 two correct implementations
differ in rounding (the order of additions), so once one token differs the rest of that answer is
conditioned on different text: reported are the share of answers identical to the end, the share of
tokens before each answer's first difference, and float32 (which must be exact) for contrast.

Run: python -m benchmarks.bf16_agreement [--model-path models/text-llama] [--prompts 20] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import REPO, format_table, write_json

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "for i in range(10):",
    "The quick brown fox", "Return the sum of", "# Copyright (c) 2024", "try:\n    import json",
    "with open(path) as f:", "if __name__ == '__main__':", "assert isinstance(x, int)", "raise ValueError(",
    "while True:\n    line =", "lambda x: x *", "from collections import", "print(f'{name}:", "yield from",
    "async def fetch(url):", "@dataclass\nclass Point:", "return sorted(items, key=",
]


def agreement(model_path: str, dtype: str, num_prompts: int, new_tokens: int, kv_dtype: str = "auto") -> dict:
    from transformers import AutoModelForCausalLM

    from session.config import EngineConfig
    from session.engine import Engine, GenerationRequest
    from session.engine.events import EventStream, Finished
    from session.types import SamplingParams

    engine = Engine(EngineConfig(model_path=model_path, dtype=dtype, kv_dtype=kv_dtype, speculative="off",
                                 max_device_adapters=0, max_new_tokens=new_tokens)).start()
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    tokenizer = engine.parts.tokenizer
    same_answers = prefix_tokens = total = 0
    try:
        for prompt in (PROMPTS * 2)[:num_prompts]:
            ids = tokenizer(prompt)["input_ids"]
            stream = EventStream(deltas=False)
            engine.submit(GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=new_tokens),
                                            stream=stream, token_ids=ids))
            while not isinstance(event := stream.get(timeout=600), Finished):
                assert not hasattr(event, "error"), event
            ours = list(event.token_ids)
            with torch.no_grad():
                out = reference.generate(torch.tensor([ids]), max_new_tokens=len(ours), do_sample=False,
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            theirs = out[0, len(ids):].tolist()
            first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
            same_answers += ours == theirs
            prefix_tokens += first_difference
            total += len(ours)
    finally:
        engine.stop()
    return {"dtype": dtype, "answers": num_prompts, "identical_answers": same_answers,
            "tokens": total, "tokens_before_first_difference": prefix_tokens,
            "agreement": prefix_tokens / total if total else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(REPO / "models" / "text-llama"))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not (Path(args.model_path) / "config.json").exists():
        from model_store.build_text_models import ensure

        ensure([Path(args.model_path).name.removeprefix("text-")], out=Path(args.model_path).parent)
    results = [agreement(args.model_path, dtype, args.prompts, args.new_tokens) for dtype in ("float32", "bfloat16")]
    # bfloat16 weights with float32 keys, values and attention (RESIDENT_KV_DTYPE=float32): faster on CPU,
    # more precise than transformers' bfloat16 attention, so it agrees with it less
    results.append(agreement(args.model_path, "bfloat16", args.prompts, args.new_tokens, kv_dtype="float32")
                   | {"dtype": "bfloat16, float32 KV"})
    print(format_table(["dtype", "answers", "identical answers", "tokens", "tokens before first difference",
                        "agreement"],
                       [[r["dtype"], r["answers"], r["identical_answers"], r["tokens"],
                         r["tokens_before_first_difference"], f"{100 * r['agreement']:.1f}%"] for r in results]))
    write_json(args.out / "bf16_agreement.json", {"model": args.model_path, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
