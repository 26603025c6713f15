"""The session engine: one loop thread that owns every session and batches across them.

Callers (the TorchServe handler, tests, benchmarks) submit requests from any thread; the
loop thread admits them, prefills one new request per iteration (only the tokens its
session has not cached), and runs one decode step for every running request together
(continuous batching: a request that arrives while others decode joins at the next step).
Requests on one session run one at a time, in arrival order. Idle sessions are reaped by
the loop itself, so memory is freed without a request arriving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from session.config import EngineConfig
from session.embeddings import EmbeddingCache
from session.errors import (
    AdapterMismatch, AdapterNotFound, BadRequest, CapacityExceeded, ConfigError, ContextLengthExceeded, ResidentError,
    SessionNotFound,
)
from session.events import AdminResult, Closed, EventStream, Failed, Finished, Started, TextDelta
from session.journal import Journal, JournalEntry
from session.memory import MemoryManager, Tier, kv_bytes
from session.model_runner import ModelRunner
from session.prompt import ChatFormatter
from session.protocol import Message, SamplingParams, Usage, new_session_id
from session.sampling import make_generator, sample_rows
from session.state import SessionState
from session.store import SessionStore

logger = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    """One turn. ``session_id`` names an existing session, or the id to give a new one."""

    messages: tuple[Message, ...]
    sampling: SamplingParams
    stream: EventStream
    session_id: str | None = None
    open_session: bool = False  # True: create session_id; False with session_id None: stateless
    pixel_values: torch.Tensor | None = None  # [num_images, 3, H, W], preprocessed by the caller
    image_digests: tuple[str, ...] = ()  # sha256 of each image's encoded bytes (computed from pixels if absent)
    image_bytes: tuple[bytes, ...] = ()  # the encoded images, for the journal (crash recovery)
    request_id: str = ""
    token_ids: list[int] | None = None  # raw prompt ids instead of messages (tests, benchmarks)
    adapter: str | None = None  # LoRA adapter name; None: the session's own (or the base model)
    speculative: bool = True  # False: never speculate for this request


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics. Counters are cumulative since start-up."""

    live_sessions: int
    sessions_by_tier: dict[str, int]  # tier -> sessions
    resident_bytes: dict[str, int]  # "device" (KV), "host" (KV copies), "embeddings" (host)
    device_budget_bytes: int  # 0: unlimited
    running_requests: int
    events: dict[str, int]  # event -> count
    tokens: dict[str, int]  # "generated", "prefilled", "cached" -> count
    speculation: dict[str, int]  # target_passes, proposed, accepted (speculative steps) -> count


@dataclass
class CloseRequest:
    session_id: str
    stream: EventStream
    request_id: str = ""


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
class Sequence:
    """A request the loop is working on (after admission, until finished)."""

    request: GenerationRequest
    session: SessionState
    generator: torch.Generator | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    num_text_sent: int = 0  # characters of the answer already streamed
    adapter_slot: int = 0  # LoRA bank slot while running (0: base model)
    controller: object | None = None  # SpeculationController while speculative decoding is allowed

    @property
    def next_token(self) -> int:
        return self.generated[-1]


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self.runner = runner or ModelRunner.from_config(config)
        # One intra-op thread on CPU unless told otherwise: measured on 2-core machines shared with the
        # frontend and clients, OpenMP threads that wait for a busy core made decoding up to 8x slower.
        if config.threads > 0 or self.runner.device.type == "cpu":
            torch.set_num_threads(config.threads or 1)
        info = self.runner.info
        self.max_context = min(config.max_context_tokens or info.max_positions, info.max_positions)
        # The object that runs prefill/decode: the dynamic runner, or its fixed-shape twin.
        self.stepper = self.runner
        if config.static_kv:
            from session.static_shapes import DEFAULT_BATCH_BUCKETS, StaticShapeRunner

            buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < config.max_batch_size) + (config.max_batch_size,)
            self.stepper = StaticShapeRunner(self.runner, self.max_context, batch_buckets=buckets,
                                             compile=config.compile)
        self.tokenizer, self.image_processor = _load_processing(config.model_path, self.runner.is_multimodal)
        self.formatter = ChatFormatter(
            self.tokenizer, image_token=getattr(self.tokenizer, "image_token", None) if info.image_token_id else None,
            image_token_id=info.image_token_id, num_image_tokens=info.num_image_tokens,
            eos_token_ids=info.eos_token_ids,
        )
        self.store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, clock=clock)
        self.embeddings = EmbeddingCache()
        self.memory = MemoryManager(device_budget_bytes=self._device_budget(), host_budget_bytes=config.host_budget_bytes,
                                    store=self.store)
        self.journal = Journal(config.journal_dir) if config.journal_dir else None
        self.adapters = self._adapter_registry()
        self.speculator = self._speculator()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._num_queued = 0  # submitted, not yet admitted; guarded by _queued_lock
        self._queued_lock = threading.Lock()
        self._waiting: deque[Sequence] = deque()  # admitted, waiting for prefill
        self._running: list[Sequence] = []  # decoding
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next_reap = 0.0
        self.num_decode_steps = 0
        self.num_generated_tokens = 0
        self.num_prefilled_tokens = 0
        self.num_cached_tokens = 0
        self.max_batch_seen = 0
        self.num_journal_restored = 0
        self.num_overloaded = 0  # requests answered 503 (queue full or no memory to free)
        if self.journal is not None:
            self._restore_journal()

    def _adapter_registry(self):
        config = self.config
        if config.max_device_adapters <= 0:
            return None
        from session.adapters import AdapterRegistry

        bank, shapes = self.runner.enable_lora(config.max_device_adapters, config.max_lora_rank)
        registry = AdapterRegistry(bank, shapes, max_device=config.max_device_adapters,
                                   max_host=config.max_host_adapters, max_rank=config.max_lora_rank)
        if config.adapters_dir:
            logger.info("adapters found in %s: %s", config.adapters_dir, registry.scan(config.adapters_dir))
        for name, entry in (self.journal.adapters() if self.journal is not None else {}).items():
            try:  # registered through the API before a restart
                if name not in registry:
                    registry.register(name, entry["src"], pinned=entry.get("pinned", False))
            except ResidentError as exc:
                logger.warning("adapter %s from the journal cannot be registered again: %s", name, exc.message)
        for name in filter(None, (n.strip() for n in config.pinned_adapters.split(","))):
            registry.get(name).pinned = True
            registry.acquire(name)
            registry.release(name)
        return registry

    def _speculator(self):
        """A SpeculativeDecoder per RESIDENT_SPECULATIVE, or None. A draft with another vocabulary is
        refused here, at start-up (ConfigError)."""
        config = self.config
        mode = config.speculative
        if mode == "auto":
            mode = "draft" if config.draft_model_path else "off"
        if mode == "off":
            return None
        from session.speculative import SpeculativeDecoder, check_compatible

        draft = None
        if mode == "draft":
            draft = ModelRunner(config.draft_model_path, device=config.device, dtype=config.dtype)
            from transformers import AutoTokenizer

            check_compatible(self.tokenizer, AutoTokenizer.from_pretrained(config.draft_model_path))
        logger.info("speculative decoding: %s, up to %d tokens per step", mode, config.num_speculative_tokens)
        return SpeculativeDecoder(self.runner, draft)

    def _device_budget(self) -> int:
        config = self.config
        if config.device_budget_fraction <= 0:
            return config.device_budget_bytes
        if self.runner.device.type != "cuda":
            raise ConfigError("RESIDENT_DEVICE_BUDGET_FRACTION needs a CUDA device; on CPU set "
                              "RESIDENT_DEVICE_BUDGET_BYTES")
        free, _ = torch.cuda.mem_get_info(self.runner.device)
        return int(free * config.device_budget_fraction)

    # ------------------------------------------------------------------ caller side (any thread)

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="resident-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest | CloseRequest) -> None:
        """Queue a request; its events arrive on ``request.stream``. Raises CapacityExceeded when full."""
        with self._queued_lock:
            if self._num_queued + len(self._waiting) >= self.config.max_queue:
                self.num_overloaded += 1
                raise CapacityExceeded(f"{self.config.max_queue} requests are already waiting", retry_after_s=1)
            self._num_queued += 1
        self._inbox.put(request)

    def warmup(self, timeout_s: float = 600.0) -> None:
        """Run one small stateless request through the loop (first-call costs: kernels, allocator).

        Called by the handler in ``initialize``, so the worker reports ready only when it is fast.
        """
        from PIL import Image

        pixel_values = None
        token_ids = [self.tokenizer.bos_token_id or 0] * 4
        if self.image_processor is not None:
            pixel_values = self.preprocess_images([Image.new("RGB", (32, 32))])
            token_ids += [self.runner.info.image_token_id] * self.runner.info.num_image_tokens
        stream = EventStream()
        self.submit(GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=2), stream=stream,
                                      token_ids=token_ids, pixel_values=pixel_values, request_id="warmup"))
        while not isinstance(event := stream.get(timeout=timeout_s), (Finished, Failed)):
            pass
        if isinstance(event, Failed):
            raise event.error

    def preprocess_images(self, images: list) -> torch.Tensor | None:
        """PIL images -> pixel_values [N, 3, H, W]. Runs in the caller's thread (CPU work, no model)."""
        if not images:
            return None
        if self.image_processor is None:
            raise BadRequest("this model is text-only; remove the image_url parts")
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def new_session_id(self) -> str:
        return new_session_id()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> EngineStats:
        """Read from any thread (metrics); values may be a step apart from each other."""
        sessions = self.store.all_sessions()
        by_tier = {tier.value: 0 for tier in Tier}
        for session in sessions:
            if not session.ephemeral:
                by_tier[session.tier.value] += 1
        memory, store, embeddings = self.memory, self.store, self.embeddings
        return EngineStats(
            live_sessions=sum(by_tier.values()), sessions_by_tier=by_tier,
            resident_bytes={"device": memory.device_bytes, "host": memory.host_bytes, "embeddings": embeddings.nbytes},
            device_budget_bytes=memory.device_budget_bytes, running_requests=len(self._running),
            events={"opened": store.num_opened, "closed": store.num_closed, "expired": store.num_expired,
                    "demoted_to_host": memory.num_to_host, "dropped": memory.num_dropped,
                    "restored_from_host": memory.num_restored_from_host, "recomputed": memory.num_recomputed,
                    "restored_from_journal": self.num_journal_restored, "embedding_hits": embeddings.num_hits,
                    "embedding_misses": embeddings.num_misses, "overloaded": self.num_overloaded},
            tokens={"generated": self.num_generated_tokens, "prefilled": self.num_prefilled_tokens,
                    "cached": self.num_cached_tokens},
            speculation=self._speculation_stats(),
        )

    def _speculation_stats(self) -> dict[str, int]:
        spec = self.speculator
        if spec is None:
            return {}
        return {"target_passes": spec.num_steps, "proposed": spec.num_proposed, "accepted": spec.num_accepted,
                "plain_steps": spec.num_plain_steps}

    # ------------------------------------------------------------------ loop thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:  # never let the loop die; the failing requests were already told
                logger.exception("engine loop iteration failed")

    def _iterate(self) -> None:
        idle = not self._running and not self._waiting
        self._drain_inbox(block=idle)
        if self.clock() >= self._next_reap:
            self._reap()
        if self._waiting:
            self._start(self._waiting.popleft())
        if self._running:
            self._decode_step()

    def _drain_inbox(self, block: bool) -> None:
        timeout = self.config.reaper_interval_s if block else None
        while True:
            try:
                item = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            with self._queued_lock:
                self._num_queued -= 1
            self._admit(item)

    def _admit(self, item: GenerationRequest | CloseRequest | AdapterRequest) -> None:
        try:
            if isinstance(item, CloseRequest):
                self._close(item)
            elif isinstance(item, AdapterRequest):
                item.stream.put(AdminResult(self._adapter_admin(item)))
            else:
                self._admit_generation(item)
        except ResidentError as exc:
            item.stream.put(Failed(exc))
        except Exception as exc:
            logger.exception("admitting request %s (session %s) failed", item.request_id, item.session_id)
            item.stream.put(Failed(exc))

    def _admit_generation(self, request: GenerationRequest) -> None:
        now = self.clock()
        if request.adapter is not None:
            self._adapter_registry_or_404(request.adapter).get(request.adapter)
        if request.open_session or request.session_id is None:
            kv = self.runner.new_kv_cache(block_tokens=self.config.kv_block_tokens, max_tokens=self.max_context,
                                          static=self.config.static_kv)
            session = self.store.open(SessionState(
                session_id=request.session_id or new_session_id(), kv=kv, created_at=now, last_used_at=now,
                expires_at=now + self.config.session_ttl_s, ephemeral=not request.open_session, tier=Tier.DEVICE,
                adapter=request.adapter,
            ))
            if self.speculator is not None:
                session.draft_kv = self.speculator.new_draft_kv(block_tokens=self.config.kv_block_tokens,
                                                                max_tokens=self.max_context)
        else:
            session = self.store.get(request.session_id)
            if request.adapter is not None and request.adapter != session.adapter:
                bound = f"adapter {session.adapter!r}" if session.adapter else "the base model"
                raise AdapterMismatch(f"session {session.session_id} was opened with {bound}; its cache cannot "
                                      f"serve adapter {request.adapter!r}: open a new session for it")
            if session.busy:
                session.pending.append(request)
                return
        session.busy = True
        self._waiting.append(Sequence(request=request, session=session))

    def _close(self, request: CloseRequest) -> None:
        session = self.store.get(request.session_id)
        if session.busy:
            session.pending.append(request)  # close after the running turn, in order
            return
        self._forget(session, "closed")
        request.stream.put(Closed(request.session_id))
        while session.pending:  # requests queued behind the close find the session gone
            later = session.pending.popleft()
            later.stream.put(Failed(SessionNotFound(f"session {request.session_id} was closed")))

    def _reap(self) -> None:
        for session_id in self.store.expired_ids():
            self._forget(self.store.get(session_id), "expired")
            logger.info("session %s expired", session_id)
        self._next_reap = self.clock() + self.config.reaper_interval_s

    def _adapter_registry_or_404(self, name: str):
        if self.adapters is None:
            raise AdapterNotFound(f"adapter {name!r}: adapters are disabled on this server "
                                  "(RESIDENT_MAX_DEVICE_ADAPTERS=0)")
        return self.adapters

    def _adapter_admin(self, request: AdapterRequest) -> dict:
        registry = self._adapter_registry_or_404(request.name or "")
        if request.action == "list":
            return {"adapters": registry.list()}
        if request.action == "register":
            info = registry.register(request.name, request.src, pinned=request.pinned)
            self._journal_adapters(added=(info.name, {"src": info.path, "pinned": info.pinned}))
            return {"registered": info.name, "src": info.path}
        if request.action == "unregister":
            in_use = sum(1 for s in self.store.all_sessions() if s.adapter == request.name)
            registry.unregister(request.name, in_use, dry_run=request.dry_run)
            if not request.dry_run:
                self._journal_adapters(removed=request.name)
            return {"unregistered": request.name, "dry_run": request.dry_run}
        raise BadRequest(f"unknown adapter action {request.action!r}; use register, unregister or list")

    def _journal_adapters(self, added: tuple[str, dict] | None = None, removed: str | None = None) -> None:
        if self.journal is None:
            return
        adapters = self.journal.adapters()
        if added is not None:
            adapters[added[0]] = added[1]
        adapters.pop(removed, None)
        self.journal.write_adapters(adapters)

    def _forget(self, session: SessionState, reason: str) -> None:
        """Close a session: free its KV, release its images, remove it from the journal."""
        self.store.close(session.session_id, reason=reason)
        for digest in session.image_digests:
            if self.embeddings.release(digest) and self.journal is not None:
                self.journal.remove_image(digest)
        if self.journal is not None and not session.ephemeral:
            self.journal.remove(session.session_id)

    # ------------------------------------------------------------------ journal

    def _restore_journal(self) -> None:
        """At start-up: every live journaled session comes back, without KV (DROPPED tier)."""
        now = self.clock()
        for entry in self.journal.entries():
            if entry.expires_at <= now or entry.session_id in self.store:
                self.journal.remove(entry.session_id)
                continue
            kv = self.runner.new_kv_cache(block_tokens=self.config.kv_block_tokens, max_tokens=self.max_context,
                                          static=self.config.static_kv)
            kv.release()
            session = self.store.open(SessionState(
                session_id=entry.session_id, kv=kv, created_at=entry.created_at, expires_at=entry.expires_at,
                last_used_at=now, tier=Tier.DROPPED, token_ids=list(entry.token_ids),
                image_digests=list(entry.image_digests), ended_with_eos=entry.ended_with_eos,
                num_turns=entry.num_turns, adapter=entry.adapter,
            ))
            for digest in session.image_digests:
                self.embeddings.acquire(digest)
            if self.speculator is not None:
                session.draft_kv = self.speculator.new_draft_kv(block_tokens=self.config.kv_block_tokens,
                                                                max_tokens=self.max_context)
            self.num_journal_restored += 1
        for path in self.journal.images_dir.iterdir():
            if path.name not in self.embeddings:
                path.unlink(missing_ok=True)
        if self.num_journal_restored:
            logger.info("restored %d sessions from the journal at %s", self.num_journal_restored,
                        self.journal.directory)

    def _journal_turn(self, session: SessionState) -> None:
        if self.journal is None or session.ephemeral:
            return
        self.journal.write(JournalEntry(
            session_id=session.session_id, token_ids=session.token_ids, image_digests=session.image_digests,
            ended_with_eos=session.ended_with_eos, num_turns=session.num_turns, created_at=session.created_at,
            expires_at=session.expires_at, adapter=session.adapter,
        ))

    # ------------------------------------------------------------------ prefill

    def _start(self, seq: Sequence) -> None:
        try:
            self._prefill(seq)
        except Exception as exc:
            if not isinstance(exc, ResidentError):
                logger.exception("prefill of request %s (session %s) failed", seq.request.request_id,
                                 seq.session.session_id)
            self._end(seq, Failed(exc))

    def _prefill(self, seq: Sequence) -> None:
        request, session = seq.request, seq.session
        if request.token_ids is not None:
            new_ids, num_images = list(request.token_ids), self._count_images(request.token_ids)
        elif session.num_turns == 0:
            piece = self.formatter.opening(request.messages)
            new_ids, num_images = piece.token_ids, piece.num_images
        else:
            piece = self.formatter.followup(request.messages, session.ended_with_eos)
            new_ids, num_images = piece.token_ids, piece.num_images
        given = 0 if request.pixel_values is None else request.pixel_values.shape[0]
        if num_images != given:
            raise BadRequest(f"the prompt has {num_images} image placeholders but {given} images were given")
        prompt_tokens = len(session.token_ids) + len(new_ids)
        max_tokens = request.sampling.max_tokens
        if prompt_tokens + max_tokens > self.max_context:
            raise ContextLengthExceeded(
                f"this turn needs {prompt_tokens} prompt tokens + max_tokens {max_tokens} = "
                f"{prompt_tokens + max_tokens}, over the context window of {self.max_context}"
                + (" (the session's history counts)" if session.num_turns else "")
            )
        cap = self.config.max_session_tokens
        if cap and not session.ephemeral and prompt_tokens + max_tokens > cap:
            raise ContextLengthExceeded(
                f"this session would hold {prompt_tokens + max_tokens} tokens (prompt {prompt_tokens} + max_tokens "
                f"{max_tokens}), over the per-session cap of {cap}; close it and open a new one"
            )
        generator = make_generator(request.sampling, self.config.seed, self.runner.device)
        digests = list(request.image_digests) or _pixel_digests(request.pixel_values)
        for digest in digests:
            self.embeddings.acquire(digest)
        try:
            if session.adapter is not None:  # resident for as long as the request runs
                seq.adapter_slot = self._adapter_registry_or_404(session.adapter).acquire(session.adapter)
            cached, embeds = self._prepare(session, new_ids, digests, request, prompt_tokens + max_tokens)
            logits = self.stepper.prefill(session.kv, embeds, adapter_slot=seq.adapter_slot)
        except BaseException:
            for digest in digests:  # this turn never happened: its images are not the session's
                self.embeddings.release(digest)
            raise
        self.memory.note_usage()
        # Commit only after the model ran: a failure above leaves the transcript as it was.
        session.token_ids.extend(new_ids)
        session.image_digests.extend(digests)
        session.num_turns += 1
        if self.journal is not None and not session.ephemeral:
            for digest, raw in zip(digests, request.image_bytes):
                self.journal.write_image(digest, raw)
        seq.prompt_tokens, seq.cached_tokens, seq.generator = prompt_tokens, cached, generator
        if self.speculator is not None and request.speculative:
            from session.speculative import SpeculationController

            k = self.config.num_speculative_tokens
            seq.controller = SpeculationController(k_max=k, k=min(4, k))
        if self.speculator is not None and session.draft_kv is not None and request.speculative:
            self.speculator.sync_draft(session.token_ids, session.draft_kv)
        self.num_prefilled_tokens += prompt_tokens - cached
        self.num_cached_tokens += cached
        request.stream.put(Started(
            session_id=None if session.ephemeral else session.session_id,
            expires_at=None if session.ephemeral else session.expires_at,
            prompt_tokens=prompt_tokens, cached_tokens=cached,
        ))
        token = sample_rows(logits[None], [request.sampling], [seq.generator])[0]
        if not self._on_token(seq, token):
            self._running.append(seq)

    def _prepare(self, session: SessionState, new_ids: list[int], new_digests: list[str],
                 request: GenerationRequest, total_tokens: int) -> tuple[int, torch.Tensor]:
        """Bring the session's KV to the device sized for ``total_tokens`` (restoring or recomputing it),
        and embed what it has not cached. Returns (cached token count, embeddings to prefill [T, D])."""
        kv = session.kv
        held = kv.nbytes if session.tier is Tier.DEVICE else 0
        need = kv_bytes(kv, total_tokens) - held
        draft_tokens = total_tokens - self._count_images(session.token_ids + new_ids) * self.runner.info.num_image_tokens
        if session.draft_kv is not None:  # the draft reads the text only (no image placeholders)
            need += kv_bytes(session.draft_kv, draft_tokens) - session.draft_kv.nbytes
        self.memory.reserve(session, need)
        if session.draft_kv is not None:
            session.draft_kv.ensure_capacity(draft_tokens)
        kv.ensure_capacity(total_tokens)
        if session.tier is Tier.HOST:
            self.memory.restore_from_host(session)
        elif session.tier is Tier.DROPPED:
            session.tier = Tier.DEVICE  # kv.length is 0: the whole transcript is recomputed below
            self.memory.num_recomputed += 1
        cached = kv.length
        # The transcript's unfed tail: normally the previous answer's last token; all of it after a drop.
        old_digests = session.image_digests if cached == 0 else []
        images = self._image_embeddings(old_digests, new_digests, request.pixel_values)
        return cached, self.runner.embed(session.token_ids[cached:] + new_ids, images)

    def _image_embeddings(self, old_digests: list[str], new_digests: list[str],
                          pixel_values: torch.Tensor | None) -> list[torch.Tensor]:
        """Embeddings for each image occurrence, encoding only those no session has encoded yet."""
        to_encode: dict[str, torch.Tensor] = {}  # digest -> pixels [3, H, W]
        for index, digest in enumerate(new_digests):
            if self.embeddings.get(digest).tensor is None:
                to_encode.setdefault(digest, pixel_values[index])
                self.embeddings.num_misses += 1
            else:
                self.embeddings.num_hits += 1
        for digest in old_digests:
            if self.embeddings.get(digest).tensor is None and digest not in to_encode:
                to_encode[digest] = self._pixels_from_journal(digest)
        if to_encode:
            encoded = self.runner.encode_images(torch.stack(list(to_encode.values())))
            for digest, tensor in zip(to_encode, encoded):
                self.embeddings.get(digest).tensor = tensor.to("cpu", copy=True)
        return [self.embeddings.get(d).tensor.to(self.runner.device) for d in old_digests + new_digests]

    def _pixels_from_journal(self, digest: str) -> torch.Tensor:
        if self.journal is None:
            raise RuntimeError(f"image {digest[:12]} has no embedding and no journal to recompute it from")
        from session.images import decode_bytes

        image = decode_bytes(self.journal.read_image(digest), max_pixels=self.config.max_image_pixels)
        return self.preprocess_images([image])[0]

    def _count_images(self, token_ids: list[int]) -> int:
        image_id, per_image = self.runner.info.image_token_id, self.runner.info.num_image_tokens
        return 0 if image_id is None else token_ids.count(image_id) // per_image

    # ------------------------------------------------------------------ decode

    def _decode_step(self) -> None:
        batch = self._running[: self.config.max_batch_size]
        if self.speculator is not None and len(self._running) <= self.config.speculative_max_batch:
            speculating = [s for s in batch if s.controller is not None and s.controller.should_speculate()]
            for seq in speculating:
                self._speculative_step(seq)
            batch = [s for s in batch if s not in speculating]
            if not batch:
                return
        began = time.perf_counter()
        try:
            logits = self.stepper.decode([s.session.kv for s in batch], [s.next_token for s in batch],
                                         adapter_slots=[s.adapter_slot for s in batch])
            tokens = sample_rows(logits, [s.request.sampling for s in batch], [s.generator for s in batch])
        except Exception as exc:
            # The caches are unchanged (lengths advance only after a full step): fail these requests,
            # keep their sessions.
            logger.exception("decode step failed for %d requests", len(batch))
            for seq in batch:
                self._running.remove(seq)
                self._end(seq, Failed(exc))
            return
        self.num_decode_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        if len(batch) == 1 and batch[0].controller is not None:  # the cost speculation has to beat
            batch[0].controller.observe_plain(time.perf_counter() - began)
        finished = [seq for seq, token in zip(batch, tokens) if self._on_token(seq, token)]
        for seq in finished:
            self._running.remove(seq)
        if len(self._running) > self.config.max_batch_size:
            # More running than one step takes: rotate so every request advances.
            self._running = self._running[len(batch):] + [s for s in batch if s not in finished]

    def _speculative_step(self, seq: Sequence) -> None:
        """Draft (or look up) up to k tokens and verify them in one target pass; stream what is accepted."""
        session, sampling = seq.session, seq.request.sampling
        try:
            result = self.speculator.step(
                session.token_ids, session.kv, session.draft_kv, seq.controller.k,
                max_new=sampling.max_tokens - len(seq.generated), eos_token_ids=self.runner.info.eos_token_ids,
                sampling=sampling, generator=seq.generator, adapter_slot=seq.adapter_slot)
        except Exception as exc:
            logger.exception("speculative step failed for request %s", seq.request.request_id)
            self.speculator.rewind(session.token_ids, session.kv, session.draft_kv)
            self._running.remove(seq)
            self._end(seq, Failed(exc))
            return
        seq.controller.observe(result.num_proposed, result.num_accepted, result.draft_s, result.verify_s)
        self.num_decode_steps += 1
        for index, token in enumerate(result.token_ids):
            if self._on_token(seq, token):
                if index < len(result.token_ids) - 1:  # a stop string ended it early: forget the rest
                    self.speculator.rewind(session.token_ids, session.kv, session.draft_kv)
                self._running.remove(seq)
                return

    def _on_token(self, seq: Sequence, token: int) -> bool:
        """Record a sampled token; stream text; return True when the request finished (and end it)."""
        seq.generated.append(token)
        seq.session.token_ids.append(token)
        self.num_generated_tokens += 1
        sampling = seq.request.sampling
        is_eos = token in self.runner.info.eos_token_ids
        text = self.tokenizer.decode(seq.generated[:-1] if is_eos else seq.generated, skip_special_tokens=True)
        finish_reason = None
        for stop in sampling.stop:
            index = text.find(stop)
            if index >= 0:
                text, finish_reason = text[:index], "stop"
        if is_eos:
            finish_reason = "stop"
        elif finish_reason is None and len(seq.generated) >= sampling.max_tokens:
            finish_reason = "length"
        if finish_reason is None:
            # Hold back a partial UTF-8 character and anything that could begin a stop string.
            hold = max((len(s) - 1 for s in sampling.stop), default=0)
            safe = len(text) - hold
            while safe > seq.num_text_sent and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > seq.num_text_sent:
                seq.request.stream.put(TextDelta(text[seq.num_text_sent:safe]))
                seq.num_text_sent = safe
            return False
        if len(text) > seq.num_text_sent:
            seq.request.stream.put(TextDelta(text[seq.num_text_sent:]))
        seq.session.ended_with_eos = is_eos
        usage = Usage(prompt_tokens=seq.prompt_tokens, completion_tokens=len(seq.generated),
                      cached_tokens=seq.cached_tokens)
        self._end(seq, Finished(session_id=None if seq.session.ephemeral else seq.session.session_id,
                                text=text, token_ids=tuple(seq.generated), finish_reason=finish_reason,
                                usage=usage))
        return True

    def _end(self, seq: Sequence, event: Finished | Failed) -> None:
        session = seq.session
        session.busy = False
        if seq.adapter_slot:
            self.adapters.release(session.adapter)
            seq.adapter_slot = 0
        if isinstance(event, Failed) and isinstance(event.error, CapacityExceeded):
            self.num_overloaded += 1
        if session.ephemeral:
            self._forget(session, "closed")
        else:
            self.store.touch(session)
            if isinstance(event, Finished):
                self._journal_turn(session)
        seq.request.stream.put(event)
        if session.pending:
            self._admit(session.pending.popleft())


def _pixel_digests(pixel_values: torch.Tensor | None) -> list[str]:
    """Content keys for images given only as pixels (tests, benchmarks): hash the pixel bytes."""
    import hashlib

    if pixel_values is None:
        return []
    return ["px-" + hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest() for p in pixel_values.cpu()]


def _load_processing(model_path: str, multimodal: bool):
    """The tokenizer and (for LLaVA) the image processor shipped with the checkpoint."""
    from transformers import AutoProcessor, AutoTokenizer

    if multimodal:
        processor = AutoProcessor.from_pretrained(model_path)
        return processor.tokenizer, processor.image_processor
    return AutoTokenizer.from_pretrained(model_path), None
