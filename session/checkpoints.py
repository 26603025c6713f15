"""Where a model path's checkpoint is: a Hugging Face folder (config.json beside its weights) or a GGUF
file (llama.cpp's, as people download them: one file holding the config, the tokenizer with its chat
template, and the weights, often quantized).

RESIDENT_MODEL_PATH (and RESIDENT_DRAFT_MODEL_PATH) may name a folder with config.json, a ``.gguf`` file,
or a folder holding exactly one ``.gguf`` file and no config.json. transformers reads the last two with
``from_pretrained(folder, gguf_file=name)`` (its GGUF reader, the ``gguf`` package);
session/model/gguf.py keeps their quantized linears packed where our kernels take the format.

Who calls this: session/config.py (validation), the model runner, the engine assembly (tokenizer) and
the launchers' checkpoint check (session/families/support.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from session.errors import ConfigError

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class Checkpoint:
    folder: str  # what ``from_pretrained`` takes as its first argument
    gguf_file: str | None = None  # the GGUF file's name inside ``folder``, or None for a Hugging Face folder

    @property
    def kwargs(self) -> dict[str, str]:
        """The keyword arguments ``from_pretrained`` (config, tokenizer, model) needs besides ``folder``."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.folder) / self.gguf_file if self.gguf_file else None


def locate(path: str | Path) -> Checkpoint | None:
    """The checkpoint ``path`` names, or None where it names none. A folder with several ``.gguf``
    files and no config.json is ambiguous: ConfigError naming them (name the file instead)."""
    where = Path(path)
    if where.is_file():
        return Checkpoint(str(where.parent), where.name) if where.suffix == GGUF_SUFFIX else None
    if (where / "config.json").exists():
        return Checkpoint(str(where))
    files = sorted(where.glob(f"*{GGUF_SUFFIX}")) if where.is_dir() else []
    if len(files) > 1:
        raise ConfigError(f"{where} holds several GGUF files ({', '.join(f.name for f in files)}): "
                          "name the one to serve")
    return Checkpoint(str(where), files[0].name) if files else None


def require(path: str | Path) -> Checkpoint:
    """The checkpoint ``path`` names; ConfigError where it names none."""
    checkpoint = locate(path)
    if checkpoint is None:
        raise ConfigError(f"no Hugging Face checkpoint or GGUF file at {str(path)!r}")
    return checkpoint


@contextmanager
def reading_once() -> Iterator[None]:
    """While a model loads, each GGUF file is parsed once and each gguf ``TensorNameMap`` built once.

    transformers parses the file again for the config and for the weights, and session/model/gguf.py
    once more for its blocks (``GGUFReader``: about 3.6 s each for SmolLM2, most of it its 49k-token
    vocabulary); its ``get_gguf_hf_weights_map`` builds a name map for every module it recurses into (397
    for SmolLM2, about 5 s each time it runs), all the same map. Both are read-only once built, so the
    gguf package's two names are cached for the block and restored after it. Start-up is single-threaded.
    Without the gguf package, a no-op."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    # A cached function in the class's place, for the block: what mypy calls assigning to a type.
    cached_reader, cached_name_map = functools.cache(reader), functools.cache(name_map)
    gguf.GGUFReader, gguf.get_tensor_name_map = cached_reader, cached_name_map  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]
