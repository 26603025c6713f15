"""What crosses into the engine (requests) and what the engine tracks for each admitted one (Sequence).

Callers build a request dataclass and hand it to ``Engine.submit``; the engine's loop thread turns a
GenerationRequest into a ``Sequence`` when it admits it. A Sequence ends exactly once (``end``): with
Finished, Failed or Cancelled (docs/ENGINE.md, "the invariant").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from session.engine.events import EventStream
from session.engine.prompt import RenderedTurn
from session.families.vision import NO_IMAGES, Images
from session.model.grammar import Grammar
from session.speculative.controller import SpeculationController
from session.state.session import SessionState, Turn
from session.types import Message, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from session.engine.detokenizer import Detokenizer


@dataclass
class GenerationRequest:
    """One turn. ``session_id`` names an existing session, or the id to give a new one."""

    messages: tuple[Message, ...]
    sampling: SamplingParams
    stream: EventStream
    session_id: str | None = None
    open_session: bool = False  # True: create session_id; False with session_id None: stateless
    images: Images = NO_IMAGES  # preprocessed by the caller (``Engine.preprocess_images``), in prompt order
    image_digests: tuple[str, ...] = ()  # sha256 of each image's encoded bytes (computed from pixels if absent)
    image_bytes: tuple[bytes, ...] = ()  # the encoded images, for the journal (crash recovery)
    request_id: str = ""  # also the key ``Engine.cancel`` takes
    token_ids: list[int] | None = None  # raw prompt ids instead of messages (tests, benchmarks)
    adapter: str | None = None  # LoRA adapter name; None: the session's own (or the base model)
    base_model: bool = False  # the caller named the base model: a session opened with an adapter refuses it
    speculative: bool = True  # False: never speculate for this request
    rendered: RenderedTurn | None = None  # the prompt, rendered by the caller (``Engine.render_turn``); None: here
    grammar: Grammar | None = None  # sampling.constraint compiled by the caller (``Engine.compile_grammar``)
    keep_special: bool = False  # the answer's text keeps special tokens (a tool-call parser reads their text)
    cache_salt: str = ""  # a new session's SessionState.cache_salt (a follow-up keeps its session's)
    tenant: str = ""  # a new session's SessionState.tenant (the front's X-Resident-Tenant)


@dataclass
class CloseRequest:
    """Close a session. A request in flight on it is cancelled first (rolled back), then the close runs."""

    session_id: str
    stream: EventStream
    request_id: str = ""


@dataclass
class CancelRequest:
    """Cancel the generation submitted with ``target_request_id`` (answered with Cancelled on its own
    stream, and with AdminResult({"cancelled": bool}) on this one)."""

    target_request_id: str
    stream: EventStream
    request_id: str = ""
    session_id: str | None = None


@dataclass
class AdapterRequest:
    """Register, unregister or list adapters (admin); answered with an AdminResult event."""

    action: str  # register | unregister | list
    stream: EventStream
    name: str | None = None
    src: str | None = None
    pinned: bool = False
    dry_run: bool = False  # unregister: only check that it would succeed
    request_id: str = ""
    session_id: str | None = None


@dataclass
class SessionAdminRequest:
    """List sessions, or move one (draining a backend); answered with AdminResult. A move is two-phase:
    ``export`` hands the session over and marks it as moving (kept here; its requests wait), then
    ``forget`` (the import elsewhere succeeded) drops it here or ``resume`` (it failed) serves it here
    again; ``import`` opens an exported one. An export waits behind the session's request in flight,
    like a close, and behind a move of it already under way."""

    action: str  # list | export | forget | resume | import
    stream: EventStream
    session_id: str | None = None
    exported: dict | None = None  # import: what an export returned
    request_id: str = ""


# What ``Engine.submit`` queues for the loop thread (``Admission.admit`` takes each in turn).
EngineRequest = GenerationRequest | CloseRequest | CancelRequest | AdapterRequest | SessionAdminRequest


@dataclass(eq=False)
class PrefillProgress:
    """A turn's prefill under way, in chunks across steps (the token-budget step): what it feeds and
    how far it got. Set by the executor when the turn begins; gone once it commits or rolls back."""

    embeds: torch.Tensor  # [T, D]: the turn's uncached tokens (past any shared prefix)
    positions: torch.Tensor | None  # M-RoPE's [3, T], else None
    done: int = 0  # of T, already in the KV

    @property
    def left(self) -> int:
        return self.embeds.shape[0] - self.done


@dataclass(eq=False)
class Sequence:
    """A generation request from admission until its one final event."""

    request: GenerationRequest
    session: SessionState
    generator: torch.Generator | None = None
    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    detokenizer: Detokenizer | None = None
    num_text_sent: int = 0  # characters of the answer already streamed
    adapter_slot: int = 0  # LoRA bank slot while running (0: base model)
    controller: SpeculationController | None = None  # while speculative decoding is allowed
    done: bool = False  # its final event was sent
    arrival: int = 0  # admission order (the scheduler's)
    passed_over: int = 0  # steps in which later arrivals prefilled and this one waited (its starvation bound)
    prompt_ids: list[int] | None = None  # the turn's new ids, once the executor rendered them
    progress: PrefillProgress | None = None  # its prefill under way (begun, not yet committed)
    matcher: LLMatcher | None = None  # its grammar's matcher (request.grammar), advanced by each sampled token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when sampling.logprobs is set
    num_logprobs_sent: int = 0  # how many of ``logprobs`` went out with a TextDelta
    turn: Turn = field(init=False)  # its hold on the session (written by Sessions)

    def __post_init__(self) -> None:
        self.turn = Turn(session=self.session, images=self.request.images)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def next_token(self) -> int:
        return self.generated[-1]

    @property
    def prefilled(self) -> bool:
        return self.turn.mark is not None

    @property
    def cached_tokens(self) -> int:
        return self.turn.cached_tokens
