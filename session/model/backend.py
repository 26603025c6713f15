"""The seam between the engine and the model: what the engine may ask of a model backend.

``ModelBackend`` is everything the engine's assembly, executor and sessions call on the runner;
``Stepper`` is the part that runs a turn's prefill and a batched decode step, which a fixed-shape
twin (``StaticShapeRunner``) can take over. ``ModelRunner``, ``StaticShapeRunner`` (as a Stepper)
and the tests' ``FakeRunner`` satisfy them; tests/unit/model/test_backend.py checks each
implementation's signatures against these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from session.families.registry import Family
from session.model.kv_cache import KVCache, KVPool


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...]
    image_token_id: int | None  # None for text-only models
    num_image_tokens: int  # placeholder tokens every image expands to; 0 where it varies (session/families/vision.py)


@dataclass(frozen=True)
class Chunk:
    """One sequence's prefill chunk in a step: ``embeds`` [T, hidden] fed after its ``kv.length`` cached
    tokens; ``positions``: M-RoPE's [3, T] (None: ``kv.length ..``)."""

    kv: KVCache
    embeds: torch.Tensor
    adapter_slot: int = 0
    positions: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeRows:
    """A step's decode rows: token_ids[b] fed at position kvs[b].length (+ position_offsets[b], an M-RoPE
    session's rope delta)."""

    kvs: list[KVCache]
    token_ids: list[int]
    adapter_slots: list[int] | None = None
    position_offsets: list[int] | None = None

    def __len__(self) -> int:
        return len(self.kvs)


class Stepper(Protocol):
    """A step's forward work: its prefill chunks and decode rows (``step``), or a turn's prefill and a
    batched decode step alone. Who calls this: the engine's executor, on the loop thread."""

    def step(self, chunks: Sequence[Chunk], rows: DecodeRows | None) -> torch.Tensor:
        """Every decode row and every chunk of one engine step -> logits [rows + chunks, V]: each decode
        row's, then each chunk's last position's. One forward pass where the stepper packs them
        (``ModelRunner``: session/model/packed_step.py), else a pass each (``separate_passes``). On an
        exception some caches may have advanced: the caller crops them back."""
        ...

    def prefill(self, kv: KVCache, embeds: torch.Tensor, all_logits: bool = False, adapter_slot: int = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``embeds`` [T, hidden] after the ``kv.length`` cached tokens -> the last position's logits [V]
        (every position's [T, V] with ``all_logits``); ``positions``: M-RoPE's [3, T]."""
        ...

    def decode(self, kvs: list[KVCache], token_ids: list[int], adapter_slots: list[int] | None = None,
               position_offsets: list[int] | None = None) -> torch.Tensor:
        """token_ids[b] fed at position kvs[b].length (+ position_offsets[b]) -> logits [B, V]."""
        ...


class ModelBackend(Stepper, Protocol):
    """The model as the engine sees it. ``info`` describes it; the rest are the calls the engine's
    assembly (caches, decode path, LoRA), sessions (images, embeddings) and speculative decoding
    (``extend``) make."""

    device: torch.device
    info: ModelInfo
    family: Family  # its registry entry (session/families/registry.py)
    is_multimodal: bool
    mrope: bool  # 3-D positions (Qwen2-VL): prefill takes positions, decode offsets
    merge_size: int  # M-RoPE: image grid cells merged per token side (1 elsewhere)
    decode_attention: str  # the decode path ``configure_decode`` chose: "per_row", "cpu_kernel" or "batched"

    def new_kv_cache(self, *, block_tokens: int, max_tokens: int, static: bool = False) -> KVCache:
        ...

    def kv_pool(self, block_tokens: int) -> KVPool:
        ...

    def configure_decode(self, attention: str, batch_buckets: tuple[int, ...] = (), verify_tokens: int = 0,
                         verify_buckets: tuple[int, ...] = ()) -> None:
        ...

    def capture_decode_graphs(self, block_tokens: int, max_tokens: int) -> int:
        ...

    def enable_lora(self, num_slots: int, max_rank: int):
        ...

    def encode_images(self, pixels: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]] | None = None,
                      grids: Sequence[tuple[int, int, int]] | None = None) -> list[torch.Tensor]:
        ...

    def embed(self, token_ids: list[int], image_embeds: list[torch.Tensor]) -> torch.Tensor:
        ...

    def extend(self, kvs: list[KVCache], token_rows: list[list[int]],
               adapter_slots: list[int] | None = None) -> torch.Tensor:
        ...


def separate_passes(stepper: Stepper, chunks: Sequence[Chunk], rows: DecodeRows | None) -> torch.Tensor:
    """``Stepper.step`` as one pass per part: the decode rows' step, then each chunk's prefill."""
    logits = []
    if rows is not None and len(rows):
        logits.append(stepper.decode(rows.kvs, rows.token_ids, adapter_slots=rows.adapter_slots,
                                     position_offsets=rows.position_offsets))
    for chunk in chunks:
        logits.append(stepper.prefill(chunk.kv, chunk.embeds, adapter_slot=chunk.adapter_slot,
                                      positions=chunk.positions)[None])
    return torch.cat(logits)
