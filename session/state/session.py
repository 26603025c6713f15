"""What a session holds: its transcript, its images (by content hash) and its KV cache."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from session.families.vision import Images
from session.model.kv_cache import KVCache


class Tier(str, enum.Enum):
    """Where a session's KV is (session/state/memory.py moves it): best first."""

    DEVICE = "device"  # on the accelerator, ready
    HOST = "host"  # a compact copy in host memory; restored by one copy
    DROPPED = "dropped"  # none; restored by recomputing the transcript


@dataclass
class SessionState:
    session_id: str
    kv: KVCache
    created_at: float
    expires_at: float
    tier: Tier
    ephemeral: bool = False  # a stateless request's session: freed when its request ends
    adapter: str | None = None  # the LoRA adapter it was opened with; its KV is never reused under another
    # Keys its shared KV blocks apart from other tenants' (the front's tenant, the request's cache_salt):
    # only a request with the same salt finds them in the prefix cache. "": shared with every unsalted one.
    cache_salt: str = ""
    tenant: str = ""  # who opened it (the front's X-Resident-Tenant): its sessions count against its share
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

    def release_tensors(self) -> None:
        """Give back every tensor it holds (device KV, draft KV, host copy); its transcript stays.
        Who calls this: the store when it closes the session, the memory manager when it drops one."""
        self.kv.release()
        if self.draft_kv is not None:
            self.draft_kv.release()
        self.host_kv = None
        self.host_length = 0

    @property
    def device_bytes(self) -> int:
        return self.kv.nbytes + (self.draft_kv.nbytes if self.draft_kv is not None else 0)

    @property
    def host_bytes(self) -> int:
        if self.host_kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.host_kv)


@dataclass
class TurnMark:
    """The session as it was before a turn began: what a rollback restores."""

    num_tokens: int
    num_images: int
    num_turns: int
    ended_with_eos: bool
    rope_delta: int


@dataclass(eq=False)
class Turn:
    """One request's hold on its session, from admission until it commits or rolls back.

    Written by ``Sessions`` only (prepare, commit, roll back); the engine's ``Sequence`` carries it.
    """

    session: SessionState
    images: Images  # the turn's new images, in order
    cached_tokens: int = 0  # transcript tokens already in the KV when its prefill began
    mark: TurnMark | None = None  # set when the turn's prefill committed; None while waiting
    images_acquired: tuple[str, ...] = ()  # embedding references this turn holds
    next_rope_delta: int = 0  # M-RoPE: the session's rope delta once this turn's prefill commits
    feeds_to: int = 0  # the KV's length once its prefill is done (0: not begun); it may take several steps
