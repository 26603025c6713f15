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

    @property
    def grouped_query(self) -> bool:
        """Do query heads share KV heads (grouped-query attention: SDPA's ``enable_gqa``)?"""
        return self.num_heads != self.num_kv_heads


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
    """A step's decode rows: token_ids[b] fed at position kvs[b].length (+ ahead[b]; + position_offsets[b],
    an M-RoPE session's rope delta). ``ahead``: a speculative verify's rows (``verify``), a sequence's
    several tokens at consecutive positions, each row attending up to its own as its decode step would;
    None: one row per sequence."""

    kvs: list[KVCache]
    token_ids: list[int]
    adapter_slots: list[int] | None = None
    position_offsets: list[int] | None = None
    ahead: list[int] | None = None

    def __len__(self) -> int:
        return len(self.kvs)

    @classmethod
    def verify(cls, kvs: list[KVCache], token_rows: list[list[int]],
               adapter_slots: list[int] | None = None) -> DecodeRows:
        """kvs[b] feeding token_rows[b] (a verify's last token and proposals), a row per token, each
        sequence's rows together and in order. No rope deltas: M-RoPE models do not speculate (the
        engine's assembly refuses them)."""
        if not all(token_rows):
            raise ValueError("every verified sequence feeds at least its last token")
        owners = [b for b, row in enumerate(token_rows) for _ in row]
        return cls([kvs[b] for b in owners], [token for row in token_rows for token in row],
                   None if adapter_slots is None else [adapter_slots[b] for b in owners],
                   ahead=[t for row in token_rows for t in range(len(row))])

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """``verify``'s rows' logits [N, V] -> [B, T, V] as ``extend`` returns them (T the longest row;
        a shorter row's padding positions zeros)."""
        ahead = self.ahead or [0] * len(self)
        owners = [0] * len(ahead)
        for b in range(1, len(ahead)):  # a row ahead 0 starts the next sequence's rows
            owners[b] = owners[b - 1] + (ahead[b] == 0)
        wide = logits.new_zeros(owners[-1] + 1, max(ahead) + 1, logits.shape[-1])
        wide[owners, ahead] = logits
        return wide


class Stepper(Protocol):
    """A step's forward work: its prefill chunks and decode rows (``step``), or a turn's prefill and a
    batched decode step alone. Who calls this: the engine's executor, on the loop thread."""

    @property
    def packs_steps(self) -> bool:
        """Does ``step`` run a step's parts in one pass (a speculative verify's rows may then join its chunks)?"""
        ...

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
        logits.append(_decode_levels(stepper, rows) if rows.ahead else stepper.decode(
            rows.kvs, rows.token_ids, adapter_slots=rows.adapter_slots, position_offsets=rows.position_offsets))
    for chunk in chunks:
        logits.append(stepper.prefill(chunk.kv, chunk.embeds, adapter_slot=chunk.adapter_slot,
                                      positions=chunk.positions)[None])
    return torch.cat(logits)


def _decode_levels(stepper: Stepper, rows: DecodeRows) -> torch.Tensor:
    """A verify's rows (``DecodeRows.ahead``) as decode steps, one per level: every sequence's row ahead 0,
    then ahead 1, ..., each row the logits of its own decode step -> [N, V] in the rows' order."""
    ahead = rows.ahead or [0] * len(rows)
    out: list[torch.Tensor | None] = [None] * len(rows)
    for level in range(max(ahead) + 1):
        picked = [b for b, a in enumerate(ahead) if a == level]
        slots, offsets = rows.adapter_slots, rows.position_offsets
        step = stepper.decode([rows.kvs[b] for b in picked], [rows.token_ids[b] for b in picked],
                              adapter_slots=None if slots is None else [slots[b] for b in picked],
                              position_offsets=None if offsets is None else [offsets[b] for b in picked])
        for i, b in enumerate(picked):
            out[b] = step[i]
    return torch.stack([row for row in out if row is not None])
