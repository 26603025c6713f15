"""Offline demo checkpoints of the text-only families: llama, mistral (sliding window), qwen2, qwen3.

Tiny, deterministic from a seed, in the hub's on-disk layout (config.json, model.safetensors,
generation_config.json, tokenizer.json with its chat template), loaded by the same
``from_pretrained`` path as a real checkpoint:

- ``text-llama``: the byte-level BPE of the demo LLaVA and its "USER: ... ASSISTANT:" template;
- ``text-mistral``: Mistral-7B's own SentencePiece tokenizer (shipped in the ``mistral-common`` wheel
  as ``tokenizer.model.v1``), converted to a fast tokenizer and checked piece for piece against
  sentencepiece; the ``[INST] ... [/INST]`` template; every layer a sliding window of 16 keys, so
  tests cross the window within a few turns;
- ``text-qwen2``, ``text-qwen3``: the BPE with ChatML tokens (``<|im_start|>``, ``<|im_end|>``) and the
  ChatML template; qwen3 has per-head q/k norms.

Run: python -m model_store.build_text_models [--only mistral] [--out models]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral's v1 instruct format; BOS comes from the tokenizer, not the template.
MISTRAL_TEMPLATE = (
    "{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string else message['content'] "
    "| selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + text + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ text + '</s>' }}{% endif %}{% endfor %}"
)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, MAX_POSITIONS = 64, 3, 4, 2, 128, 1024
MISTRAL_WINDOW = 16


def mistral_tokenizer():
    """Mistral's SentencePiece model from the mistral-common wheel, as a fast tokenizer (legacy
    normalizer: a "▁" before each text segment, byte fallback), BOS added by the post-processor."""
    import importlib

    import mistral_common
    import sentencepiece as spm
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    convert = importlib.import_module("transformers.convert_slow_tokenizer")  # the module, not its function
    path = str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")

    class Source:  # what transformers' LlamaConverter reads from a slow tokenizer
        vocab_file, legacy, add_prefix_space = path, True, True

        def __init__(self):
            self.sp = spm.SentencePieceProcessor(model_file=path)

        def convert_ids_to_tokens(self, index):
            return self.sp.id_to_piece(index)

    class Extractor:  # vocab and merges from sentencepiece itself
        def __init__(self, model_file):
            self.sp = spm.SentencePieceProcessor(model_file=model_file)

        def extract(self, vocab_scores=None):
            vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.GetPieceSize())}
            return vocab, convert.generate_merges(vocab, vocab_scores)

    class Converter(convert.LlamaConverter):
        SpmExtractor = Extractor

    backend = Converter(Source()).converted()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


def bpe_tokenizer(chatml: bool):
    from model_store.build_models import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(2048)
    if chatml:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.chat_template = CHATML_TEMPLATE
    else:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(family: str, tokenizer):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=MAX_POSITIONS, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=MISTRAL_WINDOW, head_dim=HIDDEN // HEADS)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    return Qwen3Config(**common, head_dim=HIDDEN // HEADS)


def build(family: str, out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    tokenizer = mistral_tokenizer() if family == "mistral" else bpe_tokenizer(chatml=family.startswith("qwen"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(family, tokenizer), dtype=torch.float32)
    with torch.no_grad():  # larger logits than the default init: greedy decoding is not a tie-break game
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    path = out / f"text-{family}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_bench_twin(out: Path) -> Path:
    """``models/text-bench``: the language model of ``models/llava-bench`` (its weights, tokenizer and chat
    template) as a plain Llama checkpoint, so decode benchmarks compare a plain Llama chat model of the
    same size (118 MB of float32 weights per token) with vLLM and with the VLM."""
    from transformers import AutoTokenizer, LlamaForCausalLM, LlavaForConditionalGeneration

    source = out / "llava-bench"
    llava = LlavaForConditionalGeneration.from_pretrained(source, dtype=torch.float32)
    model = LlamaForCausalLM(llava.config.text_config)
    model.model.load_state_dict(llava.model.language_model.state_dict())
    model.lm_head.load_state_dict(llava.lm_head.state_dict())
    model.generation_config = llava.generation_config
    path = out / "text-bench"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def ensure(families=FAMILIES, out: Path = Path(__file__).resolve().parent.parent / "models") -> dict[str, Path]:
    """Build what is missing; returns family -> checkpoint directory. Used by tests and make targets."""
    paths = {}
    for family in families:
        path = out / f"text-{family}"
        if not (path / "config.json").exists():
            build(family, out)
        paths[family] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=FAMILIES)
    parser.add_argument("--out", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    for family in args.only or FAMILIES:
        print(f"built {build(family, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
