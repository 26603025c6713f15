"""A step's model work: the scheduler's plan run on the executor, its device faults handled.

Who calls this: ``Engine.step`` (session/engine/loop.py), on the loop thread, once a step with the
scheduler's plan. The plan's prefill chunks and decode rows go to the executor as ONE step (one
forward pass where the model packs them: session/model/packed_step.py); a step that speculates runs
its chunks, then its speculative step. Sampled tokens go to the output processor; a request that
finishes or fails is ended through the engine's ``end`` and listed in ``ended`` (for
``scheduler.complete``).

Faults: a step of several parts whose pass fails is run again a pass per part (the failed pass left
every cache as before it), so a request whose part fails fails alone. A decode step that runs out of
device memory is run again in smaller batches within the same step, and a request that does not fit
alone fails with a 503 (session/engine/faults.py); a fatal CUDA error raises DeviceFailed, on which
``Engine.step`` fails every request and halts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from session.engine.events import Cancelled, Failed, Finished, Started
from session.engine.executor import Executor
from session.engine.faults import Fault, classify, device_failed, free_cached_memory, out_of_memory
from session.engine.outputs import OutputProcessor
from session.engine.requests import Sequence
from session.engine.scheduler import StepPlan
from session.errors import DeviceOutOfMemory, ResidentError
from session.types import redact

logger = logging.getLogger(__name__)


class PlanRunner:
    def __init__(self, *, executor: Executor, outputs: OutputProcessor, device,
                 end: Callable[[Sequence, Finished | Failed | Cancelled], None]):
        """``end(seq, event)``: the engine's one place a request ends (``Engine.end``)."""
        self.executor = executor
        self.outputs = outputs
        self.device = device  # whose cached memory is freed after an OOM
        self.end = end
        self.num_oom_retries = 0  # steps run again in smaller passes after an OOM (apart, halved)
        self.num_steps_run_apart = 0  # steps whose one pass failed, run again a pass per part

    def run(self, plan: StepPlan, ended: list[Sequence]) -> None:
        """The plan's prefill chunks and decode rows in one executor step (one forward pass where the
        model packs them); a step that speculates feeds its chunks in its verify pass where the model
        packs (``Executor.packs_verify``), else runs its chunks, then its speculative step. What ends
        is appended to ``ended``. Raises DeviceFailed on a fatal device error, other exceptions from
        outside the executor's calls as they are (``Engine.step`` then ends the plan's requests)."""
        chunks = [(seq, tokens) for seq, tokens in zip(plan.prefill, plan.chunks) if self._begin(seq, ended)]
        rows = list(plan.decode)
        speculating = self.executor.speculating(rows) if rows else []
        if speculating and chunks and self.executor.packs_verify:
            self._run_speculative_step(chunks, rows, speculating, ended)
        elif speculating:
            self._run_step(chunks, [], ended)
            self._run_decode(rows, ended, speculating=speculating)
        else:
            self._run_step(chunks, rows, ended)

    def _begin(self, seq: Sequence, ended: list[Sequence]) -> bool:
        """Begin the turn's prefill at its first chunk (``Executor.begin``); False: it failed and ended."""
        if seq.progress is not None:
            return True
        try:
            self.executor.begin(seq)
            return True
        except Exception as exc:
            error = self._step_error(exc, self._what(seq))
        self._fail(seq, error, ended)
        return False

    def _run_step(self, chunks: list[tuple[Sequence, int]], rows: list[Sequence], ended: list[Sequence]) -> None:
        """One executor step for the chunks and the rows. A step of several parts whose pass fails is
        run again with its parts apart (each chunk alone, the rows in one decode step; the pass left
        every cache as before it), so a request whose part fails fails alone, and after running out of
        device memory the smaller passes may fit."""
        if not chunks and not rows:
            return
        error = None
        try:
            chunk_results, tokens = self.executor.step(chunks, rows)
        except Exception as exc:
            if classify(exc) is Fault.FATAL:
                raise device_failed(exc) from exc
            error = exc
        if error is not None:  # out of the except block: the traceback no longer holds the pass's tensors
            if len(chunks) + bool(rows) > 1:
                self._run_apart(chunks, rows, error, ended)
            elif rows:
                self._run_decode(rows, ended, speculating=[], failed=error)
            else:
                self._fail(chunks[0][0], self._step_error(error, self._what(chunks[0][0])), ended)
            return
        self._finish_chunks(chunks, chunk_results, ended)
        self._emit_rows(rows, tokens, ended)

    def _run_speculative_step(self, chunks: list[tuple[Sequence, int]], rows: list[Sequence],
                              speculating: list[Sequence], ended: list[Sequence]) -> None:
        """The chunks fed in the rows' speculative verify pass (``Executor.step_speculative``). If it fails,
        its parts run again apart, as ``_run_step``'s do: each chunk alone, then the rows in a plain
        decode step (as after an OOM: the safe step, every row as before the failed one)."""
        error = None
        try:
            chunk_results, tokens = self.executor.step_speculative(chunks, rows, speculating)
        except Exception as exc:
            if classify(exc) is Fault.FATAL:
                raise device_failed(exc) from exc
            error = exc
        if error is not None:  # out of the except block: the traceback no longer holds the pass's tensors
            self._run_apart(chunks, rows, error, ended)
            return
        self._finish_chunks(chunks, chunk_results, ended)
        self._emit_rows(rows, tokens, ended)

    def _finish_chunks(self, chunks: list[tuple[Sequence, int]], results: list[int | Exception | None],
                       ended: list[Sequence]) -> None:
        """Each chunk's outcome: its turn fails alone, starts its answer (its last chunk), or goes on."""
        for (seq, _), result in zip(chunks, results):
            if isinstance(result, Exception):
                self._fail(seq, self._step_error(result, self._what(seq)), ended)
            elif result is not None:  # the turn's last chunk: its answer starts
                self._start(seq, result, ended)

    def _run_apart(self, chunks: list[tuple[Sequence, int]], rows: list[Sequence], error: Exception,
                   ended: list[Sequence]) -> None:
        self.num_steps_run_apart += 1
        if classify(error) is Fault.OUT_OF_MEMORY:
            self.num_oom_retries += 1
            free_cached_memory(self.device)
        elif not isinstance(error, ResidentError):
            logger.warning("a step of %d prefill chunks and %d decode rows failed (%s); running its parts "
                           "apart", len(chunks), len(rows), error)
        for chunk in chunks:
            self._run_step([chunk], [], ended)
        if rows:
            self._run_decode(rows, ended, speculating=[])

    def _start(self, seq: Sequence, token: int, ended: list[Sequence]) -> None:
        """The turn's prefill committed: ``Started``, then its first token."""
        session = seq.session
        self.outputs.start(seq)
        seq.request.stream.put(Started(
            session_id=None if session.ephemeral else session.session_id,
            expires_at=None if session.ephemeral else session.expires_at,
            prompt_tokens=seq.prompt_tokens, cached_tokens=seq.cached_tokens, adapter=session.adapter))
        self._emit(seq, [token], ended)

    def _fail(self, seq: Sequence, error: Exception, ended: list[Sequence]) -> None:
        if isinstance(error, DeviceOutOfMemory):
            free_cached_memory(self.device)
        ended.append(seq)
        self.end(seq, Failed(error))

    @staticmethod
    def _what(seq: Sequence) -> str:
        return f"prefill of request {seq.request_id} (session {redact(seq.session.session_id)})"

    def _run_decode(self, rows: list[Sequence], ended: list[Sequence], speculating: list[Sequence],
                    failed: Exception | None = None) -> None:
        """One batched step for every decoding row: speculative (one target pass verifies every row's
        proposals, plain rows ride along) when ``speculating`` has rows, else a plain decode (``failed``:
        the error a plain decode of these rows already raised). Out of device memory, the same rows run
        again in smaller batches (``_decode_smaller``)."""
        error = None
        tokens: list[list[int]] | list[int | ResidentError] = []
        if failed is not None:
            error = self._step_error(failed, f"decode step for {len(rows)} requests")
        else:
            try:
                if speculating:
                    tokens = list(self.executor.speculate(rows, speculating))
                else:  # a row that could not be sampled has its error in place of its token
                    tokens = self.executor.decode(rows)
            except Exception as exc:  # every row is as before the step (executor.decode, executor.speculate)
                error = self._step_error(exc, f"decode step for {len(rows)} requests")
        if isinstance(error, DeviceOutOfMemory):  # out of the except block: the failed pass's tensors are freed
            free_cached_memory(self.device)
            if len(rows) > 1 or speculating:
                self._decode_smaller(rows, ended)
                return
        if error is not None:
            for seq in rows:
                ended.append(seq)
                self.end(seq, Failed(error))
            return
        self._emit_rows(rows, tokens, ended)

    def _emit_rows(self, rows: list[Sequence], tokens, ended: list[Sequence]) -> None:
        """Each decode row's tokens (a list, or one token), or its error: it fails alone (rolled back)."""
        for seq, row_tokens in zip(rows, tokens):
            if isinstance(row_tokens, ResidentError):
                ended.append(seq)
                self.end(seq, Failed(out_of_memory(row_tokens) if classify(row_tokens) is Fault.OUT_OF_MEMORY
                                     else row_tokens))
            else:
                self._emit(seq, row_tokens if isinstance(row_tokens, list) else [row_tokens], ended)

    def _decode_smaller(self, rows: list[Sequence], ended: list[Sequence]) -> None:
        """A decode step ran out of device memory: run the same rows again within this step, without
        speculation (its passes need more memory), in two halves, each halved again while it runs out;
        a row that runs out alone fails with a 503. The failed step left every row as before it, so
        each row that fits gets exactly the tokens it would have got."""
        self.num_oom_retries += 1
        half = (len(rows) + 1) // 2  # one speculating row: run again alone, as a plain row
        for part in (rows[:half], rows[half:]):
            if part:
                self._run_decode(part, ended, speculating=[])

    def _step_error(self, exc: Exception, what: str) -> Exception:
        """What the requests of a failed executor call fail with: a 503 when it ran out of device
        memory, ``exc`` itself otherwise (logged, unless a ResidentError). A fatal device error raises
        DeviceFailed instead: ``Engine.step`` then fails every request and stops the engine."""
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
            finished = self.outputs.on_token(seq, token)
            if finished is not None:
                if index < len(tokens) - 1:  # a speculative run went past the end: forget the rest
                    self.executor.rewind(seq)
                ended.append(seq)
                self.end(seq, finished)
                return
