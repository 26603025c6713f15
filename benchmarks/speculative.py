"""Speculative vs plain decoding on the trained pair (and on a LLaVA session): greedy, same prompts.

Methods, each on every prompt (interleaved, so load changes on a shared machine hit all alike):
  plain            one target decode step per token (the engine today);
  draft k=K        the trained draft proposes K tokens per step, the target verifies them in one pass;
  draft adaptive   SpeculationController picks k in [1, k_max] and falls back to plain steps;
  prompt lookup    n-gram proposals from the transcript (no draft model), adaptive k.
Each run prefills the prompt (target, and the draft's text), then decodes to ``--new-tokens`` new tokens
(the first comes from the prefill). Every method's tokens are compared with plain's (must be identical).

Reported per method: decode latency for the new tokens (median over prompts), decode tokens/s,
acceptance (accepted / proposed), tokens per target pass, speedup of decode time vs plain.

Run:  python -m benchmarks.speculative [--prompts 10] [--new-tokens 128] [--no-llava]
Writes <out>/speculative.json (default out: benchmarks/results). Drives ModelRunner and the decoder
directly, in one process (no server): it measures decoding, not HTTP.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import spec_drivers
from benchmarks.common import format_table, median, write_json
from model_store.train_pair import PAIR_DIR, eval_prompts
from session.model.runner import ModelRunner
from session.speculative.controller import SpeculationController
from session.speculative.decoder import SpeculativeDecoder


@dataclass
class MethodStats:
    name: str
    decode_s: list[float] = field(default_factory=list)  # per prompt
    prefill_s: list[float] = field(default_factory=list)
    num_tokens: int = 0  # decoded tokens (after the prefill's first one), all prompts
    num_target_passes: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_identical: int = 0  # prompts whose output equals plain's

    def row(self, plain: MethodStats) -> dict:
        decode = sum(self.decode_s)
        return {
            "method": self.name,
            "latency_s": median([p + d for p, d in zip(self.prefill_s, self.decode_s)]),
            "decode_s": median(self.decode_s),
            "tokens_per_s": self.num_tokens / decode,
            "acceptance": self.num_accepted / self.num_proposed if self.num_proposed else None,
            "tokens_per_target_pass": self.num_tokens / self.num_target_passes,
            "speedup": sum(plain.decode_s) / decode,
            "identical": f"{self.num_identical}/{len(self.decode_s)}",
        }


class Workload:
    """One target (+ draft) and its prompts; runs each method on a prompt and records its stats."""

    def __init__(self, target: ModelRunner, draft: ModelRunner, prompts: list[tuple[list[int], list]],
                 new_tokens: int, k: int, k_max: int):
        self.target, self.draft, self.prompts = target, draft, prompts
        self.new_tokens, self.k, self.k_max = new_tokens, k, k_max
        self.eos = target.info.eos_token_ids
        self.methods = {
            "plain": None,
            f"draft k={k}": SpeculativeDecoder(target, draft),
            "draft adaptive": SpeculativeDecoder(target, draft),
            "prompt lookup": SpeculativeDecoder(target, None),
        }
        self.stats = {name: MethodStats(name) for name in self.methods}

    def kv(self, runner: ModelRunner):
        return runner.new_kv_cache(block_tokens=256, max_tokens=runner.info.max_positions)

    def run(self, name: str, prompt: list[int], image_embeds: list) -> list[int]:
        decoder, stats = self.methods[name], self.stats[name]
        target_kv = self.kv(self.target)
        began = time.perf_counter()
        ids = prompt + [int(self.target.prefill(target_kv, self.target.embed(prompt, image_embeds)).argmax())]
        draft_kv = None
        if decoder is not None:
            draft_kv = decoder.new_draft_kv(block_tokens=256, max_tokens=self.draft.info.max_positions)
            decoder.sync_draft(ids, draft_kv)  # the draft's prompt prefill belongs to the turn's prefill
        prefilled = time.perf_counter()
        num_new = self.new_tokens - 1
        if decoder is None:
            for _ in range(num_new):
                ids.append(int(self.target.decode([target_kv], [ids[-1]])[0].argmax()))
            passes, proposed, accepted = num_new, 0, 0
        else:
            before = (decoder.num_steps + decoder.num_plain_steps, decoder.num_proposed, decoder.num_accepted)
            if name == f"draft k={self.k}":
                goal = len(ids) + num_new
                while len(ids) < goal:
                    ids += spec_drivers.step(decoder, ids, target_kv, draft_kv, self.k, max_new=goal - len(ids)).token_ids
            else:
                spec_drivers.decode_greedy(decoder, ids, target_kv, draft_kv, num_new, SpeculationController(k_max=self.k_max))
            after = (decoder.num_steps + decoder.num_plain_steps, decoder.num_proposed, decoder.num_accepted)
            passes, proposed, accepted = (a - b for a, b in zip(after, before))
        done = time.perf_counter()
        stats.prefill_s.append(prefilled - began)
        stats.decode_s.append(done - prefilled)
        stats.num_tokens += num_new
        stats.num_target_passes += passes
        stats.num_proposed += proposed
        stats.num_accepted += accepted
        return ids

    def measure(self) -> list[dict]:
        self.run("plain", *self.prompts[0])  # warm-up (first-call costs), not counted
        for name in self.methods:
            if name != "plain":
                self.run(name, *self.prompts[0])
        self.stats = {name: MethodStats(name) for name in self.methods}
        for prompt, image_embeds in self.prompts:
            expected = self.run("plain", prompt, image_embeds)
            self.stats["plain"].num_identical += 1
            for name in list(self.methods)[1:]:
                self.stats[name].num_identical += self.run(name, prompt, image_embeds) == expected
        plain = self.stats["plain"]
        return [stats.row(plain) for stats in self.stats.values()]


def text_workload(args, draft: ModelRunner) -> Workload:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.pair / "target")
    target = ModelRunner(str(args.pair / "target"), device="cpu", dtype="float32")
    prompts = [([tokenizer.bos_token_id] + ids, []) for ids in eval_prompts(tokenizer, args.prompts, 32)]
    return Workload(target, draft, prompts, args.new_tokens, args.k, args.k_max)


def llava_workload(args, draft: ModelRunner) -> Workload:
    """llava-spec (the trained target behind a random vision tower) with the text-only draft."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from model_store.build_spec_llava import build_spec_llava

    path = build_spec_llava()
    processor = AutoProcessor.from_pretrained(path)
    target = ModelRunner(str(path), device="cpu", dtype="float32")
    prompts = []
    for index, ids in enumerate(eval_prompts(processor.tokenizer, args.prompts, 24)):
        pixels = (np.random.RandomState(index).rand(336, 336, 3) * 255).astype(np.uint8)  # resized by the processor
        image = Image.fromarray(pixels)
        question = processor.tokenizer.decode(ids)
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            add_generation_prompt=True)
        inputs = processor(text=text, images=image, return_tensors="pt")
        prompts.append((inputs.input_ids[0].tolist(), target.encode_images(inputs.pixel_values)))
    return Workload(target, draft, prompts, args.new_tokens, args.k, args.k_max)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, default=PAIR_DIR, help="directory with target/ and draft/")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="proposals per step for the fixed-k method")
    parser.add_argument("--k-max", type=int, default=8, help="upper bound for the adaptive methods")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: small models gain nothing from more, and on a busy "
                             "machine each parallel region may wait for a descheduled thread")
    parser.add_argument("--no-llava", action="store_true", help="skip the LLaVA session workload")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    draft = ModelRunner(str(args.pair / "draft"), device="cpu", dtype="float32")
    results = {}
    workloads = [("trained pair", text_workload)] + ([] if args.no_llava else [("llava-spec", llava_workload)])
    for label, build in workloads:
        rows = build(args, draft).measure()
        results[label] = rows
        print(f"\n{label}: {args.prompts} prompts, {args.new_tokens} new tokens each, greedy, "
              f"{args.threads} thread(s)")
        print(format_table(
            ["method", "latency s", "decode s", "tok/s", "acceptance", "tok/pass", "speedup", "identical"],
            [[r["method"], r["latency_s"], r["decode_s"], r["tokens_per_s"],
              "-" if r["acceptance"] is None else r["acceptance"], r["tokens_per_target_pass"],
              r["speedup"], r["identical"]] for r in rows]))
    path = write_json(args.out / "speculative.json", {
        "config": {**vars(args), "out": str(args.out), "pair": str(args.pair), "cpu_count": os.cpu_count(),
                   "load_average": os.getloadavg(), "torch": torch.__version__},
        "results": results,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
