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

Device faults (session/engine/faults.py): a decode step that runs out of device memory is run again
in smaller batches within the same step, and a request that does not fit alone fails with a 503; a
fatal CUDA error fails every request, stops the heartbeat and hands the error to ``on_fatal``, which
by default ends the worker process so that it is restarted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from session.config import EngineConfig
from session.engine.admin import registry_or_404
from session.engine.admission import Admission
from session.engine.assembly import assemble, preprocess_images
from session.engine.events import Cancelled, EventStream, Failed, Finished, Started
from session.engine.faults import Fault, classify, device_failed, exit_worker, free_cached_memory, out_of_memory
from session.engine.prompt import PromptPiece, RenderedTurn
from session.engine.requests import CancelRequest, GenerationRequest, Sequence
from session.engine.scheduler import StepPlan
from session.engine.stats import EngineStats, snapshot
from session.errors import (
    AdapterNotFound,
    BadRequest,
    CapacityExceeded,
    DeviceFailed,
    DeviceOutOfMemory,
    ResidentError,
    ServiceStopping,
    SessionNotFound,
)
from session.families.vision import NO_IMAGES, Images
from session.model.grammar import Grammar, GrammarCompiler
from session.model.runner import ModelRunner
from session.model.threads import ComputeThread, one_thread_here
from session.types import Constraint, SamplingParams, new_session_id, redact

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 clock: Callable[[], float] = time.time,
                 on_fatal: Callable[[BaseException], None] = exit_worker):
        """``on_fatal(error)`` is called once, on the loop thread, after a fatal device error (the CUDA
        error) has failed every request; the default ends the process (tests pass a recorder)."""
        self.config = config
        self.clock = clock
        self.on_fatal = on_fatal
        self.fatal_error: DeviceFailed | None = None  # set once the device is lost: the engine runs nothing more
        self._compute = ComputeThread("resident-engine")  # loads the model here, runs the loop later
        try:
            parts = self._compute.call(lambda: assemble(config, runner, clock))
        except BaseException:
            self._compute.close(timeout=1.0)
            raise
        self.parts = parts  # typed (engine.parts.store, ...): tests and benchmarks read them
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._num_submitted = 0  # submitted, not yet taken from the inbox; guarded by _submit_lock
        self._num_waiting = 0  # admitted, not yet prefilled (published by the loop thread)
        self._submit_lock = threading.Lock()
        self._stop = threading.Event()
        self._next_reap = 0.0
        self.heartbeat = time.monotonic()  # the loop's last iteration
        self._heartbeat_written = 0.0
        self.num_overloaded = 0  # requests failed 503 in the loop (no memory to free); loop thread only
        self.num_oom_retries = 0  # decode batches run again in smaller ones after an OOM; loop thread only
        self.num_oom_failures = 0  # requests failed 503 because they ran out of device memory alone
        self.num_queue_full = 0  # submissions refused 503 (queue full); under _submit_lock
        self.num_cancelled = 0
        self.num_abandoned_prefills = 0  # requests that ended between two chunks of their prefill (rolled back)
        self.num_failed = 0
        self.num_invariant_violations = 0
        self._stats: EngineStats | None = None
        self._grammars: GrammarCompiler | None = None  # built on first use (compile_grammar)
        self._grammar_lock = threading.Lock()
        self.admission = Admission(
            scheduler=parts.scheduler, sessions=parts.sessions, adapters=parts.adapters,
            session_ttl_s=config.session_ttl_s, clock=clock, end=self.end, on_barrier=self._publish_stats)
        if self.parts.journal is not None:
            self._compute.call(lambda: self.parts.sessions.restore_journal(self.clock()))
        self._publish_stats()

    # ------------------------------------------------------------------ caller side (any thread)

    def start(self) -> Engine:
        self._compute.post(self._loop)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; every request still in flight or queued gets Failed(ServiceStopping)."""
        self._stop.set()
        self._inbox.put(None)
        self._compute.close(timeout)

    def submit(self, request) -> None:
        """Queue a request; its events arrive on ``request.stream``. Raises CapacityExceeded when full."""
        with self._submit_lock:
            if self._stop.is_set():
                raise ServiceStopping()
            if isinstance(request, GenerationRequest) and \
                    self._num_submitted + self._num_waiting >= self.config.max_queue:
                self.num_queue_full += 1
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

        images = NO_IMAGES
        token_ids = [self.parts.tokenizer.bos_token_id or 0] * 4
        if self.parts.vision is not None:
            images = self.preprocess_images([Image.new("RGB", (32, 32))])
            token_ids += [self.parts.runner.info.image_token_id] * images.num_tokens[0]
        stream = EventStream()
        self.submit(GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=2), stream=stream,
                                      token_ids=token_ids, images=images, request_id="warmup"))
        while not isinstance(event := stream.get(timeout=timeout_s), (Finished, Failed, Cancelled)):
            pass
        if isinstance(event, Failed):
            raise event.error

    def precheck(self, *, session_id: str | None, open_session: bool, adapter: str | None, waiting: int = 0) -> None:
        """Refuse early, from the caller's thread, what the loop would refuse anyway, before the caller
        spends work on the request (decoding its images): a full queue, an unknown adapter, a session
        this worker does not hold. Reads without locks, so it may let through what the loop then
        refuses (the loop's checks stay the authority); it never refuses what the loop would take.
        ``waiting``: the caller's requests not yet submitted (waiting to decode images): they count
        in the queue."""
        if self._stop.is_set():
            raise ServiceStopping()
        if self._num_submitted + self._num_waiting + waiting >= self.config.max_queue:
            raise CapacityExceeded(f"{self.config.max_queue} requests are already waiting", retry_after_s=1)
        if adapter is not None:
            registry_or_404(self.parts.adapters, adapter).get(adapter)
        if session_id is not None and not open_session:
            session = self.parts.store.peek(session_id)
            if session is None or session.ephemeral:
                raise SessionNotFound(f"session {session_id} is unknown on this worker (closed, expired or never "
                                      "opened here); open a new one with NEW_SESSION")

    def knows_adapter(self, name: str) -> bool:
        """Whether ``name`` is a registered adapter (a request's "model" may name one). Any thread."""
        registry = self.parts.adapters
        if registry is None:
            return False
        try:
            registry.get(name)
        except AdapterNotFound:
            return False
        return True

    def render_turn(self, messages, images: Images, first_turn: bool, tools: list[dict] | None = None) -> RenderedTurn:
        """A turn's prompt, rendered and tokenized on the caller's thread (``RenderedTurn``); ``tools``
        go to the chat template of an opening (``ChatFormatter.render_turn``)."""
        return self.parts.formatter.render_turn(messages, images.num_tokens, first_turn, tools)

    def render_prompt(self, prompt: str | tuple[int, ...]) -> RenderedTurn:
        """A /v1/completions prompt as an opening: text tokenized as it is (BOS added, no chat template),
        or token ids checked against the vocabulary. Runs on the caller's thread."""
        if isinstance(prompt, str):
            ids = self.parts.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
            vocab_size = self.parts.runner.info.vocab_size
            if max(ids) >= vocab_size:
                raise BadRequest(f"prompt token id {max(ids)} is not in the vocabulary (ids are below {vocab_size})")
        image_id = self.parts.runner.info.image_token_id
        if image_id is not None and image_id in ids:
            raise BadRequest("a completions prompt carries no images: it must not hold the image token")
        return RenderedTurn(opening=PromptPiece(token_ids=ids, num_images=0))

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (special tokens kept: a prompt echoed as it was given). Any thread."""
        return self.parts.tokenizer.decode(token_ids)

    def image_size_check(self):
        """The model's check of an image's (height, width), run on its header before the pixels are
        decoded (``ImagePreprocessor.check_size``); None for a text-only model."""
        vision = self.parts.vision
        return None if vision is None else vision.check_size

    def preprocess_images(self, images: list) -> Images:
        """PIL images -> Images (pixels, original sizes, token counts). Runs in the caller's thread
        (CPU work, no model), on that thread alone: a parallel operator here would give the caller an
        OpenMP team beside the engine's, which slows every decode step after it (``one_thread_here``)."""
        with one_thread_here():
            return preprocess_images(self.parts.vision, images)

    def new_session_id(self) -> str:
        return new_session_id(self.config.session_id_tag)

    def compile_grammar(self, constraint: Constraint) -> Grammar:
        """A request's constraint compiled (or found cached) on the caller's thread, never the loop's:
        ``GenerationRequest.grammar``. The compiler (a scan of the vocabulary) is built on first use."""
        return self._grammar_compiler().compile(constraint)

    def special_token_ids(self, texts: tuple[str, ...]) -> dict[str, int]:
        """Which of ``texts`` are single special tokens of the vocabulary, by id (tool-call markers
        in a grammar). Any thread; builds the grammar compiler on first use."""
        return self._grammar_compiler().special_token_ids(texts, self.parts.tokenizer)

    @property
    def chat_template(self) -> str | None:
        return self.parts.tokenizer.chat_template

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammars is None:
                info = self.parts.runner.info
                self._grammars = GrammarCompiler(self.parts.tokenizer, info.vocab_size, info.eos_token_ids,
                                                 max_cached=self.config.max_cached_grammars)
            return self._grammars

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (log-probabilities name tokens by it). Any thread."""
        return [self.parts.tokenizer.decode([token_id]) for token_id in token_ids]

    @property
    def max_batch_seen(self) -> int:
        return self.parts.scheduler.max_batch_seen

    @max_batch_seen.setter
    def max_batch_seen(self, value: int) -> None:
        self.parts.scheduler.max_batch_seen = value

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
            except Exception as exc:  # never let the loop die; step() already ended the requests it touched
                if classify(exc) is not Fault.FATAL:
                    logger.exception("engine loop iteration failed")
                    continue
                self.fatal_error = device_failed(exc)  # outside the executor's calls (admission, the reaper)
                self._halt()
        self._fail_everything(ServiceStopping())

    def step(self) -> None:
        """One iteration: admit, reap, then schedule -> run -> process one step."""
        if self.fatal_error is not None:  # the device is lost: nothing more runs on it
            return
        scheduler = self.parts.scheduler
        self._admit_arrivals(block=not scheduler.active)
        if self.clock() >= self._next_reap:
            self.parts.sessions.reap()
            self.admission.end_overdue_moves()
            self._next_reap = self.clock() + self.config.reaper_interval_s
        plan = scheduler.schedule()
        ended: list[Sequence] = []
        try:
            for seq, tokens in zip(plan.prefill, plan.chunks):
                self._run_prefill(seq, tokens, ended)
            if plan.decode:
                self._run_decode(plan.decode, ended)
        except DeviceFailed as exc:  # from the guarded calls: set before the step closes, so no heartbeat
            self.fatal_error = exc
        except BaseException as exc:  # a fault outside the guarded calls: end what the plan holds
            for seq in plan.prefill + plan.decode:
                self.end(seq, Failed(exc))
                ended.append(seq)
            raise
        finally:
            scheduler.complete(plan, ended)
            self._after_step(plan)
        if self.fatal_error is not None:
            self._halt()

    def _run_prefill(self, seq: Sequence, max_tokens: int, ended: list[Sequence]) -> None:
        """One chunk of the turn's prefill (the scheduler's share of the step's token budget); the
        last chunk starts the answer with its first token."""
        error = None
        try:
            token = self.parts.executor.prefill(seq, max_tokens)
        except Exception as exc:
            error = self._step_error(exc, f"prefill of request {seq.request_id} (session "
                                          f"{redact(seq.session.session_id)})")
        if error is not None:  # out of the except block: the traceback no longer holds the pass's tensors
            if isinstance(error, DeviceOutOfMemory):
                free_cached_memory(self.parts.runner.device)
            ended.append(seq)
            self.end(seq, Failed(error))
            return
        if token is None:  # more chunks to come, in the next steps
            return
        session = seq.session
        self.parts.outputs.start(seq)
        seq.request.stream.put(Started(
            session_id=None if session.ephemeral else session.session_id,
            expires_at=None if session.ephemeral else session.expires_at,
            prompt_tokens=seq.prompt_tokens, cached_tokens=seq.cached_tokens))
        self._emit(seq, [token], ended)

    def _run_decode(self, rows: list[Sequence], ended: list[Sequence], speculate: bool = True) -> None:
        """One batched step for every decoding row: speculative (one target pass verifies every row's
        proposals, plain rows ride along) when any row's controller wants it, else a plain decode.
        Out of device memory, the same rows run again in smaller batches (``_decode_smaller``)."""
        speculating = self.parts.executor.speculating(rows) if speculate else []
        error = None
        try:
            if speculating:
                tokens = self.parts.executor.speculate(rows, speculating)
            else:  # a row that could not be sampled has its error in place of its token
                tokens = [t if isinstance(t, ResidentError) else [t] for t in self.parts.executor.decode(rows)]
        except Exception as exc:  # every row is as before the step (executor.decode, executor.speculate)
            error = self._step_error(exc, f"decode step for {len(rows)} requests")
        if isinstance(error, DeviceOutOfMemory):  # out of the except block: the failed pass's tensors are freed
            free_cached_memory(self.parts.runner.device)
            if len(rows) > 1 or speculating:
                self._decode_smaller(rows, ended)
                return
        if error is not None:
            for seq in rows:
                ended.append(seq)
                self.end(seq, Failed(error))
            return
        for seq, row_tokens in zip(rows, tokens):
            if isinstance(row_tokens, ResidentError):  # it fails alone (rolled back); the others go on
                ended.append(seq)
                self.end(seq, Failed(out_of_memory(row_tokens) if classify(row_tokens) is Fault.OUT_OF_MEMORY
                                     else row_tokens))
            else:
                self._emit(seq, row_tokens, ended)

    def _decode_smaller(self, rows: list[Sequence], ended: list[Sequence]) -> None:
        """A decode step ran out of device memory: run the same rows again within this step, without
        speculation (its passes need more memory), in two halves, each halved again while it runs out;
        a row that runs out alone fails with a 503. The failed step left every row as before it, so
        each row that fits gets exactly the tokens it would have got."""
        self.num_oom_retries += 1
        half = (len(rows) + 1) // 2  # one speculating row: run again alone, as a plain row
        for part in (rows[:half], rows[half:]):
            if part:
                self._run_decode(part, ended, speculate=False)

    def _step_error(self, exc: Exception, what: str) -> Exception:
        """What the requests of a failed executor call fail with: a 503 when it ran out of device
        memory, ``exc`` itself otherwise (logged, unless a ResidentError). A fatal device error raises
        DeviceFailed instead: ``step`` then fails every request and stops the engine."""
        fault = classify(exc)
        if fault is Fault.FATAL:
            raise device_failed(exc) from exc
        if fault is Fault.OUT_OF_MEMORY:
            return out_of_memory(exc)
        if not isinstance(exc, ResidentError):
            logger.error("%s failed", what, exc_info=exc)
        return exc

    def _emit(self, seq: Sequence, tokens: list[int], ended: list[Sequence]) -> None:
        """Hand sampled tokens to the output processor; end the request when one finishes it."""
        for index, token in enumerate(tokens):
            finished = self.parts.outputs.on_token(seq, token)
            if finished is not None:
                if index < len(tokens) - 1:  # a speculative run went past the end: forget the rest
                    self.parts.executor.rewind(seq)
                ended.append(seq)
                self.end(seq, finished)
                return

    def end(self, seq: Sequence, event: Finished | Failed | Cancelled) -> None:
        """The one place a request ends: roll back a turn that did not finish, release what it held,
        send its final event, and admit what waited behind it on the session. Idempotent."""
        if seq.done:
            return
        seq.done = True
        session = seq.session
        if seq.progress is not None:  # its prefill had begun and not finished
            self.num_abandoned_prefills += seq.progress.done > 0
            seq.progress = None
        if not isinstance(event, Finished):
            self.parts.sessions.rollback_turn(seq.turn)
            self.num_cancelled += isinstance(event, Cancelled)
            self.num_failed += isinstance(event, Failed)
            self.num_overloaded += isinstance(event, Failed) and isinstance(event.error, CapacityExceeded)
            self.num_oom_failures += isinstance(event, Failed) and isinstance(event.error, DeviceOutOfMemory)
        if seq.adapter_slot:
            self.parts.adapters.release(session.adapter)
            seq.adapter_slot = 0
        if self.parts.sessions.is_live(session):
            if isinstance(event, Finished):
                self.parts.sessions.publish(session)  # the answer's blocks too, before any forget
            if session.ephemeral or (session.num_turns == 0 and seq.request.open_session):
                self.parts.sessions.forget(session, "closed")  # nobody can continue it
            else:
                self.parts.store.touch(session)
                if isinstance(event, Finished):
                    request = seq.request
                    self.parts.sessions.journal_turn(session, dict(zip(request.image_digests, request.image_bytes)))
        seq.request.stream.put(event)
        self.admission.admit_next(self.parts.scheduler.release(seq), session.session_id)

    def _after_step(self, plan: StepPlan) -> None:
        self._num_waiting = self.parts.scheduler.num_waiting()
        if self.config.check_invariants:
            problems = self.parts.scheduler.check() + self.parts.sessions.check(self.parts.scheduler.active)
            for problem in problems:
                logger.error("engine invariant violated: %s", problem)
            self.num_invariant_violations += len(problems)
        if self.fatal_error is None:  # a lost device must look dead to the watchdog
            self._beat()
        if not self.parts.scheduler.active or time.monotonic() - self._stats_at >= 0.02:
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
            self.admission.admit(item)

    def _halt(self) -> None:
        """The device is lost (``fatal_error``): refuse new requests, fail every request with a 500,
        stop the loop and the heartbeat, and hand the CUDA error to ``on_fatal`` (once). Loop thread."""
        error = self.fatal_error
        logger.critical("the device failed, failing every request and stopping the engine: %s", error.__cause__,
                        exc_info=error.__cause__)
        with self._submit_lock:  # submit() and precheck() refuse from here on (ServiceStopping)
            self._stop.set()
        self._fail_everything(error)
        self._publish_stats()
        self.on_fatal(error.__cause__)

    def _fail_everything(self, error: ResidentError) -> None:
        """At stop (or when the device is lost): every request in flight, queued or not yet admitted
        gets its final event."""
        # First, so that ending the active ones admits none.
        for item in self.parts.scheduler.take_all_queued() + self.admission.take_all_held():
            item.stream.put(Failed(error))
        for seq in list(self.parts.scheduler.sequences()):
            self.end(seq, Failed(error))
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.stream.put(Failed(error))
