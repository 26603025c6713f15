"""Speculative vs plain decoding in the engine, beside transformers' assisted generation, on two pairs.

Pairs (``--pairs``): ``pair`` (model_store/pair: an 8-layer target and a separately distilled 1-layer
draft) and ``deep-pair`` (model_store/deep_pair: a 24-layer target whose draft is its own first 3
layers with its embeddings, final norm and head; see model_store/train_deep_pair.py).

Methods, greedy, the same prompts, interleaved round by round (load changes on a shared machine hit
all alike):
  plain          our engine, speculation off (batched plain decode steps);
  speculative k<=K  our engine with the draft: adaptive k up to K (``--k-max``, one engine each),
                 every running request speculating in one batched step (one target pass verifies all);
  hf generate    transformers ``generate`` on the target alone (reference for the next one);
  hf assisted    transformers ``generate(..., assistant_model=draft)``, its default schedule.
At ``--sessions`` N > 1 our engine decodes the N requests concurrently; transformers' assisted
generation takes one sequence at a time, so its N requests run one after another.

Reported per pair, session count and method: median wall time of a round (all N requests, prompt
prefill included), generated tokens/s, speedup vs our plain (the median over rounds of the two
methods' times in the same round, with the range), and how many answers equal our plain answer
token for token. The draft's share of a target step is measured first (``ModelRunner.decode``).
Run:  python -m benchmarks.speculative_sessions [--pairs pair deep-pair] [--sessions 1 8] [--rounds 8] [--dtype bfloat16]
Writes <out>/speculative_sessions.json (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, median, write_json
from model_store import train_deep_pair
from model_store.train_pair import PAIR_DIR, eval_prompts
from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream, Failed, Finished
from session.types import SamplingParams

HF_METHODS = ("hf generate", "hf assisted")


def pair_dirs(name: str) -> tuple[Path, Path]:
    if name == "pair":
        return PAIR_DIR / "target", PAIR_DIR / "draft"
    return train_deep_pair.ensure()


class PairBench:
    """One pair loaded several ways; ``run(method, prompts)`` -> (seconds, answers)."""

    def __init__(self, name: str, new_tokens: int, max_batch: int, k_maxes: list[int], threads: int,
                 dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        target, draft = pair_dirs(name)
        self.new_tokens = new_tokens
        common = dict(model_path=str(target), device="cpu", dtype=dtype, max_batch_size=max_batch,
                      max_new_tokens=new_tokens, threads=threads)  # fixed: both engines at the same count
        self.engines = {"plain": Engine(EngineConfig(**common, speculative="off")).start()}
        for k_max in k_maxes:
            self.engines[f"speculative k<={k_max}"] = Engine(EngineConfig(
                **common, speculative="draft", draft_model_path=str(draft), num_speculative_tokens=k_max)).start()
        self.methods = tuple(self.engines) + HF_METHODS
        self.hf_target = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
        self.hf_draft = AutoModelForCausalLM.from_pretrained(draft, dtype=getattr(torch, dtype)).eval()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()

    def run(self, method: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        began = time.perf_counter()
        if method in self.engines:
            answers = self._engine(self.engines[method], prompts)
        else:
            answers = [self._hf(prompt, assisted=method == "hf assisted") for prompt in prompts]
        return time.perf_counter() - began, answers

    def _engine(self, engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
        requests = [GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=self.new_tokens),
                                      stream=EventStream(deltas=False), token_ids=prompt) for prompt in prompts]
        for request in requests:  # all submitted before any is read: they decode together
            engine.submit(request)
        answers = []
        for request in requests:
            while not isinstance(event := request.stream.get(timeout=600), (Finished, Failed)):
                pass
            if isinstance(event, Failed):
                raise event.error
            answers.append(list(event.token_ids))
        return answers

    @torch.inference_mode()
    def _hf(self, prompt: list[int], assisted: bool) -> list[int]:
        ids = torch.tensor([prompt])
        extra = {"assistant_model": self.hf_draft} if assisted else {}
        out = self.hf_target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.new_tokens,
                                      pad_token_id=self.hf_target.config.pad_token_id, **extra)
        return out[0, len(prompt):].tolist()


def measure(bench: PairBench, prompts: list[list[int]], sessions: int, rounds: int) -> list[dict]:
    """``rounds`` rounds; each runs every method on the round's ``sessions`` prompts, in turn (the order
    reversed every other round, so a drift in load hits all alike). The speedup is the median over
    rounds of plain's time over the method's in the same round: a load spike during one run moves
    one round's ratio, not the result."""
    methods = bench.methods
    for method in bench.engines:  # warm-up (first-call costs, the plain step at each batch size), not counted
        bench.run(method, prompts[:sessions])
    seconds = {m: [] for m in methods}
    tokens = {m: 0 for m in methods}
    identical = {m: 0 for m in methods}
    before = {m: _acceptance_counts(e) for m, e in bench.engines.items()}
    for r in range(rounds):
        chosen = [prompts[(r * sessions + i) % len(prompts)] for i in range(sessions)]
        answers = {}
        for method in methods if r % 2 == 0 else reversed(methods):
            took, answers[method] = bench.run(method, chosen)
            seconds[method].append(took)
            tokens[method] += sum(map(len, answers[method]))
        for method in methods:
            identical[method] += sum(a == e for a, e in zip(answers[method], answers["plain"]))
    rows = []
    for m in methods:
        ratios = sorted(p / t for p, t in zip(seconds["plain"], seconds[m]))
        acceptance = None
        if m in bench.engines and bench.engines[m].parts.speculator is not None:
            (p0, a0), (p1, a1) = before[m], _acceptance_counts(bench.engines[m])
            acceptance = (a1 - a0) / (p1 - p0) if p1 > p0 else None
        rows.append({"method": m, "sessions": sessions, "seconds_per_round": median(seconds[m]),
                     "tokens_per_s": tokens[m] / sum(seconds[m]), "speedup_vs_plain": median(ratios),
                     "speedup_range": (ratios[0], ratios[-1]), "identical_to_plain": f"{identical[m]}/{rounds * sessions}",
                     "acceptance": acceptance})
    return rows


def _acceptance_counts(engine: Engine) -> tuple[int, int]:
    spec = engine.parts.speculator
    return (0, 0) if spec is None else (spec.num_proposed, spec.num_accepted)


def draft_step_ratio(name: str, dtype: str = "float32") -> float:
    """A draft decode step over a target decode step (ModelRunner, one row, 40 cached tokens), min of 5."""
    from session.model.runner import ModelRunner

    def step_s(runner: ModelRunner) -> float:
        kv = runner.new_kv_cache(block_tokens=256, max_tokens=512)
        runner.prefill(kv, runner.embed(list(range(3, 43)), []))
        best = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(50):
                runner.decode([kv], [7])
                kv.crop(40)
            best = min(best, (time.perf_counter() - began) / 50)
        return best

    target, draft = (ModelRunner(str(p), device="cpu", dtype=dtype) for p in pair_dirs(name))
    return step_s(draft) / step_s(target)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["pair", "deep-pair"], choices=["pair", "deep-pair"])
    parser.add_argument("--sessions", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts, taken in turn by the rounds")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k-max", nargs="+", type=int, default=[4],
                        help="one speculative engine per value (RESIDENT_NUM_SPECULATIVE_TOKENS; 4 is its default)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: these small models gain nothing from more")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both engines' and transformers' (bfloat16: our CPU kernels, RESIDENT_CPU_KERNELS)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(PAIR_DIR / "target")
    prompts = [[tokenizer.bos_token_id] + ids for ids in eval_prompts(tokenizer, args.prompts, 32)]
    results = {}
    for name in args.pairs:
        ratio = draft_step_ratio(name, args.dtype)
        bench = PairBench(name, args.new_tokens, max(args.sessions), args.k_max, args.threads, args.dtype)
        try:
            rows = [row for sessions in args.sessions for row in measure(bench, prompts, sessions, args.rounds)]
        finally:
            bench.close()
        results[name] = {"draft_step_over_target_step": ratio, "rows": rows}
        print(f"\n{name}: draft step = {ratio:.3f} x target step; {args.new_tokens} new tokens per request, "
              f"greedy, {args.rounds} rounds, {args.threads} thread(s), {args.dtype}")
        print(format_table(
            ["sessions", "method", "s / round", "tok/s", "speedup", "(min-max)", "identical", "acceptance"],
            [[r["sessions"], r["method"], r["seconds_per_round"], r["tokens_per_s"], r["speedup_vs_plain"],
              "%.2f-%.2f" % r["speedup_range"], r["identical_to_plain"],
              "-" if r["acceptance"] is None else r["acceptance"]] for r in rows]))
    path = write_json(args.out / "speculative_sessions.json", {
        "config": {**vars(args), "out": str(args.out), "cpu_count": os.cpu_count(),
                   "load_average": os.getloadavg(), "torch": torch.__version__},
        "results": results,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
