"""What a session holds: its transcript, its images' embeddings and its KV cache."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from session.kv_cache import KVCache


@dataclass
class SessionState:
    session_id: str
    kv: KVCache
    created_at: float
    expires_at: float
    ephemeral: bool = False  # a stateless request's session: freed when its request ends
    token_ids: list[int] = field(default_factory=list)  # the transcript; kv.length <= len(token_ids)
    image_embeds: list[torch.Tensor] = field(default_factory=list)  # [num_image_tokens, hidden] each, in order
    image_digests: list[str] = field(default_factory=list)
    ended_with_eos: bool = False  # did the last answer end with EOS (template end-of-turn already present)
    busy: bool = False  # a request is running on this session
    pending: deque = field(default_factory=deque)  # requests waiting for the running one, in arrival order
    num_turns: int = 0

    @property
    def resident_bytes(self) -> int:
        return self.kv.nbytes + sum(e.numel() * e.element_size() for e in self.image_embeds)

    def release(self) -> None:
        self.kv.release()
        self.image_embeds.clear()
