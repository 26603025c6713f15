"""A deep target and an early-exit draft made of its first layers: a realistic speculative pair.

Real self-speculative drafts (LayerSkip, early-exit drafts, EAGLE's shared head) run a few of the
target's own layers and then the target's final norm and head. So the draft here is not a second
model: it is the target's first ``DRAFT_LAYERS`` layers with the target's embeddings, final norm and
head, and a draft step costs the small share of a target step those layers are (measured on CPU,
one thread: 0.11x for 3 of 24 layers in float32, 0.18x in bfloat16, where our C++ step leaves a
fixed per-step cost that 24 small layers do not dwarf; the first, 12-layer pair with a 2-layer
draft measured 0.32x in bfloat16 once the layers got fast, above the 0.2x a realistic pair has).

The first layers of a model trained only at its last layer predict badly through the head, so the
target is trained with an early-exit term (LayerSkip-style): next-token cross-entropy at the last
layer, plus the KL divergence from the (detached) last-layer distribution to the distribution read
through the same norm and head after layer ``DRAFT_LAYERS``. The exit learns to agree with the final
layer, which is what greedy acceptance measures. Same corpus, tokenizer and held-out files as
``train_pair`` (the Python standard library's sources).

Deterministic: fixed seed, files, step count and thread count. The target is committed in float16
under model_store/deep_pair/target; ``ensure()`` cuts the draft from it into models/deep-pair-draft
(seconds, no training), so the draft is by construction the target's own first layers.

Usage: python -m model_store.train_deep_pair [--out model_store/deep_pair]   (trains the target)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from model_store.build_models import build_tokenizer
from model_store.train_pair import (
    EVAL_FILES,
    TRAIN_FILES,
    VOCAB_SIZE,
    LlamaSpec,
    TrainSpec,
    corpus_ids,
    fit,
    heldout_loss,
    make_model,
    save,
    windows,
)

REPO = Path(__file__).resolve().parent.parent
DEEP_PAIR_DIR = Path(__file__).resolve().parent / "deep_pair"
DRAFT_DIR = REPO / "models" / "deep-pair-draft"

# 24 layers (the 8-layer pair's target is shallower; its draft is a separately trained model). Same
# width as that pair: the training budget is ~14 CPU-minutes and ~10.5 MB of committed weights.
TARGET = LlamaSpec(hidden=128, layers=24, heads=4, kv_heads=2, intermediate=384)
DRAFT_LAYERS = 3
EXIT_WEIGHT = 1.0  # the early-exit KL term's weight beside the final cross-entropy
TARGET_TRAIN = TrainSpec(steps=2000)


def exit_logits(model, hidden_states) -> torch.Tensor:
    """What the draft computes: the hidden state after DRAFT_LAYERS layers through the final norm and head.
    hidden_states[i] is the input of layer i (hidden_states[0] the embeddings)."""
    return model.lm_head(model.model.norm(hidden_states[DRAFT_LAYERS]))


def train_early_exit(model, ids: torch.Tensor, train: TrainSpec, seed: int) -> list[float]:
    """Cross-entropy at the last layer + EXIT_WEIGHT * KL(final || exit), per token."""

    def step_loss(generator):
        batch = windows(ids, train, generator)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, S] each
        out = model(input_ids=inputs, output_hidden_states=True)
        final = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        final_logp = F.log_softmax(out.logits.detach(), dim=-1)  # [B, S, V]: the exit follows, never leads
        exit_logp = F.log_softmax(exit_logits(model, out.hidden_states), dim=-1)
        agree = F.kl_div(exit_logp.flatten(0, 1), final_logp.flatten(0, 1), log_target=True, reduction="batchmean")
        return final + EXIT_WEIGHT * agree, {"final CE": final.item(), "exit KL": agree.item()}

    return fit(model, train, seed, step_loss)


def cut_draft(target_dir: Path, out: Path) -> Path:
    """Write the draft: the target's first DRAFT_LAYERS layers, its embeddings, final norm and head."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float16)
    config.num_hidden_layers = DRAFT_LAYERS
    draft = LlamaForCausalLM(config).to(torch.float16)
    kept = {name: tensor for name, tensor in target.state_dict().items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < DRAFT_LAYERS}
    draft.load_state_dict(kept, strict=True)
    meta = {"draft_of": f"{target_dir.parent.name}/{target_dir.name}", "layers": DRAFT_LAYERS,
            "target_sha256": weights_digest(target_dir),
            "shares": "the target's embeddings, first layers, final norm and head (copied)"}
    save(draft, AutoTokenizer.from_pretrained(target_dir), out, meta)
    return out


def weights_digest(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def ensure(target_dir: Path = DEEP_PAIR_DIR / "target", draft_dir: Path = DRAFT_DIR) -> tuple[Path, Path]:
    """(target, draft) directories; the draft is cut from the committed target on first use, and cut
    again when the target's weights or DRAFT_LAYERS changed."""
    stamp = draft_dir / "resident_build.json"
    meta = json.loads(stamp.read_text()) if stamp.exists() else {}
    if meta.get("layers") != DRAFT_LAYERS or meta.get("target_sha256") != weights_digest(target_dir):
        cut_draft(target_dir, draft_dir)
    return target_dir, draft_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEEP_PAIR_DIR)
    parser.add_argument("--seed", type=int, default=4321)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the weights depend on it)")
    parser.add_argument("--steps", type=int, default=TARGET_TRAIN.steps)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    tokenizer = build_tokenizer(VOCAB_SIZE)
    ids, heldout = corpus_ids(tokenizer, TRAIN_FILES), corpus_ids(tokenizer, EVAL_FILES)
    train_spec = TrainSpec(steps=args.steps)
    model = make_model(TARGET, tokenizer, args.seed)
    losses = train_early_exit(model, ids, train_spec, args.seed)
    meta = {"seed": args.seed, "threads": args.threads, "train_files": TRAIN_FILES, "eval_files": EVAL_FILES,
            "objective": f"next-token cross-entropy + {EXIT_WEIGHT} x KL(final || exit after layer {DRAFT_LAYERS})",
            "model": asdict(TARGET), "train": asdict(train_spec), "draft_layers": DRAFT_LAYERS,
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_train_loss": round(sum(losses[-10:]) / 10, 4),
            "heldout_cross_entropy": round(heldout_loss(model, heldout, train_spec.seq_len), 4),
            "train_s": round(time.perf_counter() - began, 1), "python": sys.version.split()[0],
            "torch": torch.__version__}
    save(model, tokenizer, args.out / "target", meta)
    print(f"target: {meta['parameters'] / 1e6:.2f}M parameters, held-out cross-entropy "
          f"{meta['heldout_cross_entropy']}, {meta['train_s']} s; saved under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
