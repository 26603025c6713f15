"""What a session holds: its transcript, its images (by content hash) and its KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from session.model.kv_cache import KVCache

if TYPE_CHECKING:
    from session.state.memory import Tier


@dataclass
class SessionState:
    session_id: str
    kv: KVCache
    created_at: float
    expires_at: float
    tier: "Tier"
    ephemeral: bool = False  # a stateless request's session: freed when its request ends
    adapter: str | None = None  # the LoRA adapter it was opened with; its KV is never reused under another
    token_ids: list[int] = field(default_factory=list)  # the transcript; kv.length <= len(token_ids)
    image_digests: list[str] = field(default_factory=list)  # one per image occurrence, in order (EmbeddingCache keys)
    ended_with_eos: bool = False  # did the last answer end with EOS (template end-of-turn already present)
    busy: bool = False  # a request is in flight on it (set and cleared by the scheduler only)
    num_turns: int = 0
    last_used_at: float = 0.0
    host_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # HOST tier: compact K, V [L, KVH, host_length, hd]
    host_length: int = 0
    draft_kv: KVCache | None = None  # the draft model's cache (speculative decoding), counted in device_bytes
    recoverable: bool = True  # its journal entry is current (False after a failed journal write)
    rope_delta: int = 0  # M-RoPE (Qwen-VL): position of the next token minus its index (session/families/mrope.py)

    @property
    def device_bytes(self) -> int:
        return self.kv.nbytes + (self.draft_kv.nbytes if self.draft_kv is not None else 0)

    @property
    def host_bytes(self) -> int:
        if self.host_kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.host_kv)
