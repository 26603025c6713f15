"""The session engine: one loop thread that owns every session, tying the parts of docs/ENGINE.md.

Callers (the TorchServe handler, tests, benchmarks) ``submit`` requests from any thread and read
their events from the request's stream. The loop thread repeats ``step``:

    admit what arrived (cancels, closes, admin, new turns)  ->  reap expired sessions
    ->  plan = scheduler.schedule()  ->  executor: prefill / decode / speculate
    ->  output processor: tokens -> text, stop strings, final events  ->  scheduler.complete(plan)

The invariant (checked after every step with RESIDENT_CHECK_INVARIANTS): every admitted request
gets exactly one final event (Finished, Failed or Cancelled) whatever fails; on the device a
session's KV holds its transcript but at most the last sampled token; a session is busy exactly
while a request on it is in flight. A failed or cancelled turn is rolled back, so the session is as
it was before it and a retry answers the same.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable

import torch

from session import admin
from session.config import EngineConfig
from session.embeddings import EmbeddingCache
from session.errors import (
    AdapterMismatch, BadRequest, CapacityExceeded, ConfigError, ResidentError, ServiceStopping,
    SessionNotFound,
)
from session.events import AdminResult, Cancelled, Closed, EventStream, Failed, Finished, Started
from session.executor import Executor
from session.journal import Journal
from session.memory import MemoryManager
from session.model_runner import ModelRunner
from session.outputs import OutputProcessor
from session.prompt import ChatFormatter
from session.protocol import SamplingParams, new_session_id
from session.scheduler import Scheduler, StepPlan
from session.sequence import (  # noqa: F401  (re-exported: callers build requests from here)
    AdapterRequest, CancelRequest, CloseRequest, GenerationRequest, Sequence, SessionAdminRequest,
)
from session.sessions import Sessions
from session.stats import EngineStats, snapshot
from session.store import SessionStore

logger = logging.getLogger(__name__)


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
        self.stepper = self._stepper()
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
        self.journal = Journal(config.journal_dir, config.journal_max_bytes) if config.journal_dir else None
        self.adapters = admin.build_adapter_registry(config, self.runner, self.journal)
        self.speculator = self._speculator()
        self.sessions = Sessions(
            store=self.store, memory=self.memory, embeddings=self.embeddings, journal=self.journal, runner=self.runner,
            pixels_from_bytes=self._pixels_from_bytes, new_kv=self._new_kv, new_draft_kv=self._new_draft_kv,
            draft_text_tokens=self._draft_text_tokens)
        self.scheduler = Scheduler(max_batch_size=config.max_batch_size)
        self.executor = Executor(runner=self.runner, stepper=self.stepper, formatter=self.formatter,
                                 sessions=self.sessions, adapters=self.adapters, speculator=self.speculator,
                                 config=config, max_context=self.max_context, pixel_digests=_pixel_digests)
        self.outputs = OutputProcessor(self.tokenizer, info.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._num_submitted = 0  # submitted, not yet taken from the inbox; guarded by _submit_lock
        self._num_waiting = 0  # admitted, not yet prefilled (published by the loop thread)
        self._submit_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next_reap = 0.0
        self.heartbeat = time.monotonic()  # the loop's last iteration (read by /ping-style liveness checks)
        self._heartbeat_written = 0.0
        self.num_overloaded = 0  # requests answered 503 (queue full or no memory to free)
        self.num_cancelled = 0
        self.num_failed = 0
        self.num_invariant_violations = 0
        self._stats: EngineStats | None = None
        if self.journal is not None:
            self.sessions.restore_journal(self.clock())
        self._publish_stats()

    def _stepper(self):
        """The object that runs prefill/decode: the dynamic runner, or its fixed-shape twin."""
        if not self.config.static_kv:
            return self.runner
        from session.static_shapes import DEFAULT_BATCH_BUCKETS, StaticShapeRunner

        size = self.config.max_batch_size
        buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < size) + (size,)
        return StaticShapeRunner(self.runner, self.max_context, batch_buckets=buckets, compile=self.config.compile)

    def _speculator(self):
        """A SpeculativeDecoder per RESIDENT_SPECULATIVE, or None. A draft with another vocabulary is
        refused here, at start-up (ConfigError)."""
        config = self.config
        mode = config.speculative if config.speculative != "auto" else ("draft" if config.draft_model_path else "off")
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

    def _new_kv(self):
        return self.runner.new_kv_cache(block_tokens=self.config.kv_block_tokens, max_tokens=self.max_context,
                                        static=self.config.static_kv)

    def _new_draft_kv(self):
        if self.speculator is None:
            return None
        return self.speculator.new_draft_kv(block_tokens=self.config.kv_block_tokens, max_tokens=self.max_context)

    def _draft_text_tokens(self, token_ids: list[int]) -> int:
        """Tokens the (text-only) draft holds for a transcript: the image placeholders are left out."""
        return len(token_ids) - self.executor.count_images(token_ids) * self.runner.info.num_image_tokens

    def _pixels_from_bytes(self, raw: bytes) -> torch.Tensor:
        from session.images import decode_bytes

        return self.preprocess_images([decode_bytes(raw, max_pixels=self.config.max_image_pixels)])[0]

    # ------------------------------------------------------------------ caller side (any thread)

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="resident-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; every request still in flight or queued gets Failed(ServiceStopping)."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request) -> None:
        """Queue a request; its events arrive on ``request.stream``. Raises CapacityExceeded when full."""
        with self._submit_lock:
            if self._stop.is_set():
                raise ServiceStopping()
            if isinstance(request, GenerationRequest) and \
                    self._num_submitted + self._num_waiting >= self.config.max_queue:
                self.num_overloaded += 1
                raise CapacityExceeded(f"{self.config.max_queue} requests are already waiting", retry_after_s=1)
            self._num_submitted += 1
        self._inbox.put(request)

    def cancel(self, request_id: str) -> EventStream:
        """Cancel a generation by its request id (from any thread); the answer arrives on the returned
        stream as AdminResult({"cancelled": bool})."""
        stream = EventStream()
        try:
            self.submit(CancelRequest(target_request_id=request_id, stream=stream))
        except ServiceStopping as exc:  # everything in flight is being failed anyway
            stream.put(Failed(exc))
        return stream

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
        while not isinstance(event := stream.get(timeout=timeout_s), (Finished, Failed, Cancelled)):
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
        return new_session_id(self.config.session_id_tag)

    @property
    def max_batch_seen(self) -> int:
        return self.scheduler.max_batch_seen

    @max_batch_seen.setter
    def max_batch_seen(self, value: int) -> None:
        self.scheduler.max_batch_seen = value

    def stats(self) -> EngineStats:
        """The snapshot the loop thread published last (at most 20 ms behind while busy). Any thread."""
        return self._stats

    def fresh_stats(self, timeout_s: float = 60.0) -> EngineStats:
        """A snapshot taken after everything submitted before this call was admitted (tests)."""
        self.cancel("").get(timeout=timeout_s)  # a no-op through the inbox: the loop publishes, then answers
        return self._stats

    # ------------------------------------------------------------------ loop thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # never let the loop die; step() already ended the requests it touched
                logger.exception("engine loop iteration failed")
        self._fail_everything(ServiceStopping())

    def step(self) -> None:
        """One iteration: admit, reap, then schedule -> run -> process one step."""
        scheduler = self.scheduler
        self._admit_arrivals(block=not scheduler.active)
        if self.clock() >= self._next_reap:
            self.sessions.reap()
            self._next_reap = self.clock() + self.config.reaper_interval_s
        plan = scheduler.schedule()
        ended: list[Sequence] = []
        try:
            for seq in plan.prefill:
                self._run_prefill(seq, ended)
            if plan.decode:
                self._run_decode(plan.decode, ended)
        except BaseException as exc:  # a fault outside the guarded calls: end what the plan holds
            for seq in plan.prefill + plan.decode:
                self._end(seq, Failed(exc))
                ended.append(seq)
            raise
        finally:
            scheduler.complete(plan, ended)
            self._after_step(plan)

    def _run_prefill(self, seq: Sequence, ended: list[Sequence]) -> None:
        try:
            token = self.executor.prefill(seq)
        except Exception as exc:
            if not isinstance(exc, ResidentError):
                logger.exception("prefill of request %s (session %s) failed", seq.request_id, seq.session.session_id)
            ended.append(seq)
            self._end(seq, Failed(exc))
            return
        session = seq.session
        self.outputs.start(seq)
        seq.request.stream.put(Started(
            session_id=None if session.ephemeral else session.session_id,
            expires_at=None if session.ephemeral else session.expires_at,
            prompt_tokens=seq.prompt_tokens, cached_tokens=seq.cached_tokens))
        self._emit(seq, [token], ended)

    def _run_decode(self, rows: list[Sequence], ended: list[Sequence]) -> None:
        speculating = self.executor.speculating(rows)
        for seq in speculating:
            try:
                tokens = self.executor.speculate(seq)
            except Exception as exc:
                logger.exception("speculative step failed for request %s", seq.request_id)
                ended.append(seq)
                self._end(seq, Failed(exc))
                continue
            self._emit(seq, tokens, ended)
        plain = [s for s in rows if s not in speculating]
        if not plain:
            return
        try:
            tokens = self.executor.decode(plain)
        except Exception as exc:  # the caches are unchanged (lengths advance after a full step)
            logger.exception("decode step failed for %d requests", len(plain))
            for seq in plain:
                ended.append(seq)
                self._end(seq, Failed(exc))
            return
        for seq, token in zip(plain, tokens):
            self._emit(seq, [token], ended)

    def _emit(self, seq: Sequence, tokens: list[int], ended: list[Sequence]) -> None:
        """Hand sampled tokens to the output processor; end the request when one finishes it."""
        for index, token in enumerate(tokens):
            finished = self.outputs.on_token(seq, token)
            if finished is not None:
                if index < len(tokens) - 1:  # a speculative run went past the end: forget the rest
                    self.executor.rewind(seq)
                ended.append(seq)
                self._end(seq, finished)
                return

    def _end(self, seq: Sequence, event: Finished | Failed | Cancelled) -> None:
        """The one place a request ends: roll back a turn that did not finish, release what it held,
        send its final event, and admit what waited behind it on the session. Idempotent."""
        if seq.done:
            return
        seq.done = True
        session = seq.session
        if not isinstance(event, Finished):
            self.sessions.rollback_turn(seq)
            self.num_cancelled += isinstance(event, Cancelled)
            self.num_failed += isinstance(event, Failed)
            self.num_overloaded += isinstance(event, Failed) and isinstance(event.error, CapacityExceeded)
        if seq.adapter_slot:
            self.adapters.release(session.adapter)
            seq.adapter_slot = 0
        if self.store.peek(session.session_id) is session:
            if session.ephemeral or (session.num_turns == 0 and seq.request.open_session):
                self.sessions.forget(session, "closed")  # nobody can continue it
            else:
                self.store.touch(session)
                if isinstance(event, Finished):
                    request = seq.request
                    self.sessions.journal_turn(session, dict(zip(request.image_digests, request.image_bytes)))
        seq.request.stream.put(event)
        self._admit_next(self.scheduler.release(seq), session.session_id)

    def _after_step(self, plan: StepPlan) -> None:
        self._num_waiting = self.scheduler.num_waiting()
        if self.config.check_invariants:
            problems = self.scheduler.check() + self.sessions.check()
            for problem in problems:
                logger.error("engine invariant violated: %s", problem)
            self.num_invariant_violations += len(problems)
        self._beat()
        if not self.scheduler.active or time.monotonic() - self._stats_at >= 0.02:
            self._publish_stats()

    def _beat(self) -> None:
        """The heartbeat: proof the loop turns, read out of band (a file's mtime) by the watchdog."""
        now = time.monotonic()
        self.heartbeat = now
        path = self.config.heartbeat_file
        if path and now - self._heartbeat_written >= 0.5:
            try:
                with open(path, "a"):
                    os.utime(path)
                self._heartbeat_written = now
            except OSError as exc:
                logger.warning("cannot touch the heartbeat file %s: %s", path, exc)

    def _publish_stats(self) -> None:
        self._stats_at = time.monotonic()
        self._stats = snapshot(self)

    # ------------------------------------------------------------------ admission (loop thread)

    def _admit_arrivals(self, block: bool) -> None:
        timeout = min(self.config.reaper_interval_s, 1.0) if block else None
        while True:
            try:
                item = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            with self._submit_lock:
                self._num_submitted -= 1
            self._admit(item)

    def _admit(self, item) -> bool:
        """Admit one request; True when it now waits or runs (a generation in flight)."""
        try:
            if isinstance(item, GenerationRequest):
                return self._admit_generation(item)
            if isinstance(item, CancelRequest):
                if not item.target_request_id:  # fresh_stats' barrier
                    self._publish_stats()
                item.stream.put(AdminResult({"cancelled": self._cancel(item.target_request_id, "cancelled")}))
            elif isinstance(item, CloseRequest):
                self._close(item)
            elif isinstance(item, SessionAdminRequest):
                if item.action == "export" and self.scheduler.is_busy(item.session_id or ""):
                    self.scheduler.enqueue(item.session_id, item)  # after the request in flight
                else:
                    item.stream.put(AdminResult(admin.session_admin(item, self.sessions, self.clock())))
            elif isinstance(item, AdapterRequest):
                item.stream.put(AdminResult(admin.adapter_admin(item, self.adapters, self.sessions)))
            else:
                raise TypeError(f"cannot admit {type(item).__name__}")
        except Exception as exc:
            if not isinstance(exc, ResidentError):
                logger.exception("admitting request %s (session %s) failed", getattr(item, "request_id", ""),
                                 getattr(item, "session_id", None))
            item.stream.put(Failed(exc))
        return False

    def _admit_next(self, item, session_id: str) -> None:
        """Admit the requests queued on a session until one of them is in flight again."""
        while item is not None and not self._admit(item):
            item = self.scheduler.next_pending(session_id)

    def _admit_generation(self, request: GenerationRequest) -> bool:
        if request.adapter is not None:
            admin.registry_or_404(self.adapters, request.adapter).get(request.adapter)
        if request.request_id and self.scheduler.find(request.request_id) is not None:
            raise BadRequest(f"request id {request.request_id!r} is already in flight")
        if request.open_session or request.session_id is None:
            session = self.sessions.open(request.session_id or new_session_id(), now=self.clock(),
                                         ttl_s=self.config.session_ttl_s, ephemeral=not request.open_session,
                                         adapter=request.adapter)
        else:
            session = self.sessions.get(request.session_id)
            if request.adapter is not None and request.adapter != session.adapter:
                bound = f"adapter {session.adapter!r}" if session.adapter else "the base model"
                raise AdapterMismatch(f"session {session.session_id} was opened with {bound}; its cache cannot "
                                      f"serve adapter {request.adapter!r}: open a new session for it")
            if self.scheduler.is_busy(session.session_id):
                self.scheduler.enqueue(session.session_id, request)
                return True
        self.scheduler.add(Sequence(request=request, session=session))
        return True

    def _cancel(self, request_id: str, reason: str) -> bool:
        """Between steps: end the named request (in flight or queued) with Cancelled."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self._end(seq, Cancelled(reason))
            return True
        queued = self.scheduler.take_pending(request_id)
        if queued is not None and isinstance(queued, GenerationRequest):
            self.num_cancelled += 1
            queued.stream.put(Cancelled(reason))
            return True
        if queued is not None:  # a close or export: it goes on
            self.scheduler.enqueue(queued.session_id, queued)
        return False

    def _close(self, request: CloseRequest) -> None:
        """Close a session; a request in flight on it is cancelled (rolled back) first, and the ones
        queued behind it find the session gone."""
        session = self.sessions.get(request.session_id)
        queued = list(self.scheduler.pending.pop(session.session_id, ()))
        active = self.scheduler.active.get(session.session_id)
        if active is not None:
            self._end(active, Cancelled(f"session {session.session_id} was closed while this request ran"))
        if self.store.peek(session.session_id) is session:  # (a cancelled opening turn forgot it already)
            self.sessions.forget(session, "closed")
        request.stream.put(Closed(request.session_id))
        for later in queued:
            later.stream.put(Failed(SessionNotFound(f"session {request.session_id} was closed")))

    def _fail_everything(self, error: ResidentError) -> None:
        """At stop: every request in flight, queued or not yet admitted gets its final event."""
        for seq in list(self.scheduler.sequences()):
            self._end(seq, Failed(error))
        for item in self.scheduler.pending_items():
            item.stream.put(Failed(error))
        self.scheduler.pending.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.stream.put(Failed(error))


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
