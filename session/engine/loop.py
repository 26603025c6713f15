"""The session engine: one loop thread that owns every session, tying the parts of docs/ENGINE.md.

Callers (the TorchServe handler, tests, benchmarks) prepare a request on their own thread
(``Preparation``, session/engine/preparation.py), ``submit`` it from any thread and read its events
from the request's stream. The loop thread repeats ``step``:

    admit what arrived (cancels, closes, admin, new turns)  ->  reap expired sessions
    ->  plan = scheduler.schedule()  ->  executor: prefill / decode / speculate (``PlanRunner``)
    ->  output processor: tokens -> text, stop strings, final events  ->  scheduler.complete(plan)

The invariant (checked after every step with RESIDENT_CHECK_INVARIANTS): every admitted request
gets exactly one final event (Finished, Failed or Cancelled) whatever fails; on the device a
session's KV holds its transcript but at most the last sampled token; a session is busy exactly
while a request on it is in flight. A failed or cancelled turn is rolled back, so the session is as
it was before it and a retry answers the same.

Device faults: a step's out-of-memory is handled in the step (session/engine/plan_runner.py); a
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
from session.engine.assembly import assemble
from session.engine.events import Cancelled, EventStream, Failed, Finished
from session.engine.faults import Fault, classify, device_failed, exit_worker
from session.engine.plan_runner import PlanRunner
from session.engine.preparation import Preparation
from session.engine.requests import CancelRequest, EngineRequest, GenerationRequest, Sequence
from session.engine.scheduler import StepPlan
from session.engine.stats import EngineStats, snapshot
from session.errors import (
    CapacityExceeded,
    DeviceFailed,
    DeviceOutOfMemory,
    ResidentError,
    ServiceStopping,
    SessionNotFound,
)
from session.families.vision import NO_IMAGES
from session.model.runner import ModelRunner
from session.model.threads import ComputeThread
from session.types import SamplingParams

logger = logging.getLogger(__name__)


class Engine(Preparation):
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 clock: Callable[[], float] = time.time,
                 on_fatal: Callable[[BaseException], None] = exit_worker):
        """``on_fatal(error)`` is called once, on the loop thread, after a fatal device error (the CUDA
        error) has failed every request; the default ends the process (tests pass a recorder)."""
        self.clock = clock
        self.on_fatal = on_fatal
        self.fatal_error: DeviceFailed | None = None  # set once the device is lost: the engine runs nothing more
        self._compute = ComputeThread("resident-engine")  # loads the model here, runs the loop later
        try:
            parts = self._compute.call(lambda: assemble(config, runner, clock))
        except BaseException:
            self._compute.close(timeout=1.0)
            raise
        super().__init__(config, parts)  # config, parts (typed: tests and benchmarks read them)
        self._steps = PlanRunner(executor=parts.executor, outputs=parts.outputs, device=parts.runner.device,
                                 end=self.end)
        self._inbox: queue.SimpleQueue[EngineRequest | None] = queue.SimpleQueue()
        self._num_submitted = 0  # submitted, not yet taken from the inbox; guarded by _submit_lock
        self._num_waiting = 0  # admitted, not yet prefilled (published by the loop thread)
        self._submit_lock = threading.Lock()
        self._stop = threading.Event()
        self._next_reap = 0.0
        self.heartbeat = time.monotonic()  # the loop's last iteration
        self._heartbeat_written = 0.0
        self.num_overloaded = 0  # requests failed 503 in the loop (no memory to free); loop thread only
        self.num_oom_failures = 0  # requests failed 503 because they ran out of device memory alone
        self.num_queue_full = 0  # submissions refused 503 (queue full); under _submit_lock
        self.num_cancelled = 0
        self.num_abandoned_prefills = 0  # requests that ended between two chunks of their prefill (rolled back)
        self.num_failed = 0
        self.num_invariant_violations = 0
        self._stats: EngineStats  # published before __init__ returns (_publish_stats)
        self.admission = Admission(
            scheduler=parts.scheduler, sessions=parts.sessions, adapters=parts.adapters,
            vocab_size=parts.runner.info.vocab_size, session_ttl_s=config.session_ttl_s, clock=clock, end=self.end,
            on_barrier=self._publish_stats)
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

    def submit(self, request: EngineRequest) -> None:
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

    @property
    def num_oom_retries(self) -> int:
        """Steps run again in smaller passes after an OOM (``PlanRunner``); loop thread only."""
        return self._steps.num_oom_retries

    @property
    def num_steps_run_apart(self) -> int:
        """Steps whose one pass failed, run again a pass per part (``PlanRunner``); loop thread only."""
        return self._steps.num_steps_run_apart

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
                self._halt(self.fatal_error)
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
            self._steps.run(plan, ended)
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
            self._halt(self.fatal_error)

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
        if seq.adapter_slot and self.parts.adapters is not None and session.adapter is not None:
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

    def _halt(self, error: DeviceFailed) -> None:
        """The device is lost (``fatal_error``): refuse new requests, fail every request with a 500,
        stop the loop and the heartbeat, and hand the CUDA error to ``on_fatal`` (once). Loop thread."""
        logger.critical("the device failed, failing every request and stopping the engine: %s", error.__cause__,
                        exc_info=error.__cause__)
        with self._submit_lock:  # submit() and precheck() refuse from here on (ServiceStopping)
            self._stop.set()
        self._fail_everything(error)
        self._publish_stats()
        self.on_fatal(error.__cause__ or error)

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
