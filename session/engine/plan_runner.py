"""A step's model work: the scheduler's plan run on the executor, its device faults handled.

Who calls this: ``Engine.step`` (session/engine/loop.py), on the loop thread, once a step with the
scheduler's plan. Each prefill chunk and the batched decode run on the executor; sampled tokens go
to the output processor; a request that finishes or fails is ended through the engine's ``end`` and
listed in ``ended`` (for ``scheduler.complete``).

Device faults (session/engine/faults.py): a decode step that runs out of device memory is run again
in smaller batches within the same step, and a request that does not fit alone fails with a 503; a
fatal CUDA error raises DeviceFailed, on which ``Engine.step`` fails every request and halts.
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
        self.num_oom_retries = 0  # decode batches run again in smaller ones after an OOM

    def run(self, plan: StepPlan, ended: list[Sequence]) -> None:
        """The plan's prefill chunks, then its decode rows; what ends is appended to ``ended``.
        Raises DeviceFailed on a fatal device error, other exceptions from outside the executor's
        calls as they are (``Engine.step`` then ends the plan's requests)."""
        for seq, tokens in zip(plan.prefill, plan.chunks):
            self._run_prefill(seq, tokens, ended)
        if plan.decode:
            self._run_decode(plan.decode, ended)

    def _run_prefill(self, seq: Sequence, max_tokens: int, ended: list[Sequence]) -> None:
        """One chunk of the turn's prefill (the scheduler's share of the step's token budget); the
        last chunk starts the answer with its first token."""
        error = None
        try:
            token = self.executor.prefill(seq, max_tokens)
        except Exception as exc:
            error = self._step_error(exc, f"prefill of request {seq.request_id} (session "
                                          f"{redact(seq.session.session_id)})")
        if error is not None:  # out of the except block: the traceback no longer holds the pass's tensors
            if isinstance(error, DeviceOutOfMemory):
                free_cached_memory(self.device)
            ended.append(seq)
            self.end(seq, Failed(error))
            return
        if token is None:  # more chunks to come, in the next steps
            return
        session = seq.session
        self.outputs.start(seq)
        seq.request.stream.put(Started(
            session_id=None if session.ephemeral else session.session_id,
            expires_at=None if session.ephemeral else session.expires_at,
            prompt_tokens=seq.prompt_tokens, cached_tokens=seq.cached_tokens))
        self._emit(seq, [token], ended)

    def _run_decode(self, rows: list[Sequence], ended: list[Sequence], speculate: bool = True) -> None:
        """One batched step for every decoding row: speculative (one target pass verifies every row's
        proposals, plain rows ride along) when any row's controller wants it, else a plain decode.
        Out of device memory, the same rows run again in smaller batches (``_decode_smaller``)."""
        speculating = self.executor.speculating(rows) if speculate else []
        error = None
        tokens: list[list[int] | ResidentError] = []
        try:
            if speculating:
                tokens = list(self.executor.speculate(rows, speculating))
            else:  # a row that could not be sampled has its error in place of its token
                tokens = [t if isinstance(t, ResidentError) else [t] for t in self.executor.decode(rows)]
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
