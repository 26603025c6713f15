"""Train the speculative-decoding pair: a small Llama target and a smaller Llama draft.

Random weights never agree (0% acceptance measured), so speculative decoding needs a pair that
learned the same text. Both models use the demo tokenizer (``build_tokenizer``, the vocabulary of
the demo LLaVA models) and learn from the Python standard library's own sources, present on every
machine. The target is trained on next-token prediction; the draft is distilled from the target
(its loss is the KL divergence to the target's next-token distribution, on corpus windows and on the
target's own greedy continuations), which raises agreement — what acceptance measures — beyond
training it on the corpus alone.

Deterministic: fixed seed, fixed file list, fixed step counts, one fixed thread count (float
reductions depend on it). float32 training on CPU; weights saved in float16 (a few MB, committed
under model_store/pair/{target,draft}) in Hugging Face format with the demo chat template.

Usage: python -m model_store.train_pair [--out model_store/pair] [--draft-only]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from model_store.build_models import build_tokenizer

PAIR_DIR = Path(__file__).resolve().parent / "pair"
VOCAB_SIZE = 2048  # the demo LLaVA models' vocabulary (llava-tiny), so the target can become one's LM

# Training text: standard-library modules written in plain Python, sorted by name for a fixed order.
TRAIN_FILES = (
    "argparse.py", "ast.py", "calendar.py", "collections/__init__.py", "configparser.py", "contextlib.py",
    "dataclasses.py", "datetime.py", "difflib.py", "enum.py", "functools.py", "heapq.py", "inspect.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py", "optparse.py", "os.py",
    "pathlib.py", "pickle.py", "queue.py", "random.py", "shlex.py", "shutil.py", "statistics.py", "string.py",
    "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py", "traceback.py", "typing.py",
    "zipfile.py",
)
# Held out: prompts for tests and benchmarks come from text the models never saw.
EVAL_FILES = ("fractions.py", "plistlib.py", "sched.py", "socketserver.py", "tokenize.py", "uuid.py")


@dataclass(frozen=True)
class LlamaSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 2048  # rotary: no parameters; LLaVA-spec needs image tokens + text


# Target: 8 layers so that a decode step costs clearly more than the draft's single layer (on CPU a small
# model's step is dominated by per-layer work, not by matmul FLOPs: measured 2.9 ms vs 0.4 ms). Narrow
# (128) because training compute is the budget: in ~8 CPU-minutes this 2M-parameter model reached 4.2
# held-out cross-entropy; a 4M one (192 wide, 8 x 512-token batches) stalled at 5.5 and wrote "self.self".
TARGET = LlamaSpec(hidden=128, layers=8, heads=4, kv_heads=2, intermediate=384)
DRAFT = LlamaSpec(hidden=128, layers=1, heads=4, kv_heads=2, intermediate=384)


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch: int = 2  # small batches, many steps: at this budget the number of updates limits the loss
    seq_len: int = 256  # a whole llava-spec turn (64 image tokens + prompt + 128-token answer) fits
    lr: float = 2e-3  # 3e-3 and 6e-3 trained worse in trials
    warmup: int = 30
    weight_decay: float = 0.01


# ~0.15 s per target step, ~0.07 s per draft step (a target forward + the draft's) on one core: ~8 minutes.
TARGET_TRAIN = TrainSpec(steps=2400)
DRAFT_TRAIN = TrainSpec(steps=1500)
NUM_TEACHER_SEQUENCES = 256  # the target's greedy continuations the draft also learns from (~15 s to write)


def stdlib_path(name: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / name


def corpus_ids(tokenizer, names: tuple[str, ...]) -> torch.Tensor:
    """One token stream: each present file's text, separated by EOS. -> [N] int64."""
    ids: list[int] = []
    for name in names:
        path = stdlib_path(name)
        if path.exists():
            ids += tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def eval_prompts(tokenizer, num_prompts: int, num_tokens: int = 48) -> list[list[int]]:
    """Prompts from held-out files: ``num_tokens`` tokens starting at each of ``num_prompts`` def/class lines."""
    starts: list[str] = []
    for name in EVAL_FILES:
        lines = stdlib_path(name).read_text(encoding="utf-8").splitlines(keepends=True)
        starts += ["".join(lines[i:i + 12]) for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
    step = max(1, len(starts) // num_prompts)
    chosen = starts[::step][:num_prompts]
    return [tokenizer(text, add_special_tokens=False).input_ids[:num_tokens] for text in chosen]


def make_model(spec: LlamaSpec, tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def windows(ids: torch.Tensor, train: TrainSpec, generator: torch.Generator) -> torch.Tensor:
    """A batch of random windows: [batch, seq_len + 1] (inputs and the shifted targets)."""
    starts = torch.randint(0, len(ids) - train.seq_len - 1, (train.batch,), generator=generator)
    return torch.stack([ids[s:s + train.seq_len + 1] for s in starts.tolist()])


def lr_at(step: int, train: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    progress = (step - train.warmup) / max(1, train.steps - train.warmup)
    return train.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def teacher_sequences(teacher, ids: torch.Tensor, num: int, train: TrainSpec, seed: int,
                      prompt_len: int = 32) -> torch.Tensor:
    """The teacher's own greedy continuations of random training-text prompts -> [num, seq_len + 1].

    What a draft is asked to predict when serving greedy requests is the target's greedy text, which
    differs from the corpus (it settles into loops, favours its most likely phrasings). Distilling on
    it too ("on-policy" data) raised greedy acceptance in trials (see the pair's resident_build.json).
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - prompt_len, (num,), generator=generator)
    prompts = torch.stack([ids[s:s + prompt_len] for s in starts.tolist()])  # [num, prompt_len]
    return torch.cat([
        teacher.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk), do_sample=False,
                         max_new_tokens=train.seq_len + 1 - prompt_len, eos_token_id=None,
                         pad_token_id=teacher.config.pad_token_id)
        for chunk in prompts.split(64)
    ])


def adamw(model, train: TrainSpec) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases), as both trainers use it."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=train.lr, betas=(0.9, 0.95))


def fit(model, train: TrainSpec, seed: int, step_loss, label: str = "") -> list[float]:
    """The training loop of both pairs: AdamW (``adamw``) on the warm-up/cosine schedule (``lr_at``),
    gradients clipped to norm 1. ``step_loss(generator)`` draws its batch with ``generator`` and
    returns (the loss to minimise, {name: value} to print); each step's first value is returned."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = adamw(model, train)
    model.train()
    recorded = []
    began = time.perf_counter()
    for step in range(train.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, train)
        loss, shown = step_loss(generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recorded.append(next(iter(shown.values())))
        if step % 200 == 0 or step == train.steps - 1:
            values = " ".join(f"{name} {value:.3f}" for name, value in shown.items())
            print(f"{label} step {step:4d} {values} ({time.perf_counter() - began:.0f} s)".lstrip(), flush=True)
    model.eval()
    return recorded


def train(model, ids: torch.Tensor, train: TrainSpec, seed: int, teacher=None, sequences=None,
          label: str = "") -> list[float]:
    """Next-token cross-entropy, or (with ``teacher``) KL(teacher || model) on the same windows; with
    ``sequences`` [N, seq_len + 1], half of each batch is drawn from them instead of the corpus."""

    def step_loss(generator):
        batch = windows(ids, train, generator)
        if sequences is not None:
            rows = torch.randint(0, len(sequences), (train.batch // 2,), generator=generator)
            batch[train.batch // 2:] = sequences[rows]
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, S] each
        logits = model(input_ids=inputs).logits  # [B, S, V]
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        else:
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits, dim=-1)
            loss = F.kl_div(F.log_softmax(logits, dim=-1), teacher_logp, log_target=True, reduction="batchmean")
            loss = loss / inputs.shape[1]  # batchmean divides by B only: per-token KL
        return loss, {"loss": loss.item()}

    return fit(model, train, seed, step_loss, label)


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross-entropy on the held-out files (non-overlapping windows)."""
    num = (len(ids) - 1) // seq_len
    inputs = ids[: num * seq_len].view(num, seq_len)
    targets = ids[1: num * seq_len + 1].view(num, seq_len)
    total = sum(F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten(), reduction="sum").item()
                for x, y in zip(inputs.split(8), targets.split(8)))
    return total / targets.numel()


def save(model, tokenizer, out: Path, meta: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(torch.float16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "resident_build.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


def describe(model, spec: LlamaSpec, train_spec: TrainSpec, losses: list[float], heldout: torch.Tensor,
             **fields) -> dict:
    """What resident_build.json records about one trained model."""
    return {**fields, "model": asdict(spec), "train": asdict(train_spec),
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_train_loss": round(sum(losses[-10:]) / 10, 4),
            "heldout_cross_entropy": round(heldout_loss(model, heldout, train_spec.seq_len), 4),
            "python": sys.version.split()[0], "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PAIR_DIR)
    parser.add_argument("--seed", type=int, default=1234)
    # One thread: on a shared 2-core machine two threads ran 3-7x slower (oversubscribed), and the float
    # reductions (so the exact weights) depend on the thread count.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the weights depend on it)")
    parser.add_argument("--target-steps", type=int, default=TARGET_TRAIN.steps)
    parser.add_argument("--draft-steps", type=int, default=DRAFT_TRAIN.steps)
    parser.add_argument("--draft-only", action="store_true", help="keep <out>/target, train only the draft")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    common = {"seed": args.seed, "threads": args.threads, "train_files": TRAIN_FILES, "eval_files": EVAL_FILES}
    if args.draft_only:
        tokenizer = AutoTokenizer.from_pretrained(args.out / "target")
    else:
        tokenizer = build_tokenizer(VOCAB_SIZE)
    ids = corpus_ids(tokenizer, TRAIN_FILES)
    heldout = corpus_ids(tokenizer, EVAL_FILES)
    print(f"corpus: {len(ids)} training tokens, {len(heldout)} held-out tokens", flush=True)

    if not args.draft_only:
        target_train = TrainSpec(steps=args.target_steps)
        target = make_model(TARGET, tokenizer, args.seed)
        losses = train(target, ids, target_train, args.seed, label="target")
        meta = describe(target, TARGET, target_train, losses, heldout, **common, objective="next-token cross-entropy",
                        train_s=round(time.perf_counter() - began, 1))
        save(target, tokenizer, args.out / "target", meta)
        print(f"target: {meta['parameters'] / 1e6:.2f}M parameters, held-out cross-entropy "
              f"{meta['heldout_cross_entropy']}, {meta['train_s']} s", flush=True)

    draft_began = time.perf_counter()
    # The teacher is the target as served: its float16 weights, run in float32.
    teacher = LlamaForCausalLM.from_pretrained(args.out / "target", dtype=torch.float32).eval()
    draft_train = TrainSpec(steps=args.draft_steps)
    sequences = teacher_sequences(teacher, ids, NUM_TEACHER_SEQUENCES, draft_train, args.seed + 2)
    draft = make_model(DRAFT, tokenizer, args.seed + 1)
    losses = train(draft, ids, draft_train, args.seed + 1, teacher=teacher, sequences=sequences, label="draft")
    meta = describe(draft, DRAFT, draft_train, losses, heldout, **common,
                    objective="KL to the target on corpus windows and on the target's greedy continuations",
                    teacher_sequences=NUM_TEACHER_SEQUENCES, train_s=round(time.perf_counter() - draft_began, 1))
    save(draft, tokenizer, args.out / "draft", meta)
    print(f"draft: {meta['parameters'] / 1e6:.2f}M parameters, held-out cross-entropy "
          f"{meta['heldout_cross_entropy']}, {meta['train_s']} s", flush=True)
    print(f"trained in {time.perf_counter() - began:.0f} s; saved under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
