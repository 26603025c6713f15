"""The executor: a step's model work. A turn's prefill (its prompt in, in chunks across steps when it
is long; the first token out), one decode row for each running sequence, a speculative step. It keeps no bookkeeping of its own: the scheduler
chose the sequences, the output processor records the tokens returned here.

Who calls this: the engine loop thread, inside ``Engine.step``. Each method either returns its
tokens or raises with the session left consistent (the engine rolls the turn back and fails the
request); ``decode`` returns, in place of a row's token, the error a row that could not be sampled
fails with alone.
"""

from __future__ import annotations

import logging
import time

from session.config import EngineConfig
from session.engine.admin import registry_or_404
from session.engine.prompt import ChatFormatter
from session.engine.requests import PrefillProgress, Sequence
from session.errors import BadRequest, ContextLengthExceeded, ResidentError
from session.model.backend import Chunk, DecodeRows, ModelBackend, Stepper
from session.model.lora import AdapterRegistry
from session.model.sampling import RowContext, ban_token, make_generator, process_logits, row_logprobs, sample_rows
from session.model.threads import ThreadTuner
from session.speculative.controller import SpeculationController, StepCosts, batch_should_speculate
from session.speculative.decoder import SpecRow, SpeculativeDecoder
from session.state.session import Tier
from session.state.sessions import Sessions
from session.types import redact

logger = logging.getLogger(__name__)

# per chunk: the first token, None (more chunks), or its error; per decode row: its token or its error
StepResults = tuple[list[int | Exception | None], list[int | ResidentError]]


class Executor:
    def __init__(self, *, runner: ModelBackend, stepper: Stepper | None, formatter: ChatFormatter, sessions: Sessions,
                 adapters: AdapterRegistry | None, speculator: SpeculativeDecoder | None, config: EngineConfig,
                 max_context: int, thread_tuner: ThreadTuner | None = None):
        self.runner = runner  # embeddings, images, model info
        self.stepper = runner if stepper is None else stepper  # prefill/decode: dynamic or static shapes
        self.formatter = formatter
        self.sessions = sessions
        self.adapters = adapters  # AdapterRegistry or None
        self.speculator = speculator  # SpeculativeDecoder or None
        self.config = config
        self.max_context = max_context
        self.thread_tuner = thread_tuner  # ThreadTuner (CPU, RESIDENT_THREADS=0) or None
        self.step_costs = StepCosts()  # decode-step costs by batch size, shared by the rows' controllers
        self.num_prefilled_tokens = 0
        self.num_cached_tokens = 0
        self.num_prefill_chunks = 0  # prefill passes run (a prompt in one step is one)
        # a speculative step's verify pass feeds the step's prefill chunks too (``step_speculative``)
        self.packs_verify = speculator is not None and self.stepper.packs_steps
        self.num_verifies_with_chunks = 0  # speculative steps whose verify pass fed prefill chunks

    # ------------------------------------------------------------------ prefill

    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> int | None:
        """Prefill up to ``max_tokens`` more of the turn's uncached tokens (all of them: None), alone in
        its step. The first call begins the turn (``begin``); the call that feeds its last token commits
        it and returns the first sampled token; the others return None. Raises with the session
        consistent: the engine rolls back."""
        progress = seq.progress or self.begin(seq)
        [result], _ = self.step([(seq, progress.left if max_tokens is None else max_tokens)], [])
        if isinstance(result, Exception):
            raise result
        return result

    def step(self, chunks: list[tuple[Sequence, int]], rows: list[Sequence]) -> StepResults:
        """One step's model work in ONE stepper call (``Stepper.step``: a packed pass where the model
        packs it): each begun turn's next chunk, of at most its share of the step's tokens, and one
        decode row for each sequence in ``rows``. Returns, per chunk, the turn's first token once it fed
        its last prompt token (the turn is then committed), None while chunks remain, or the error its
        request fails with; per row, its next token or its error (``sample_rows``). When it raises (the
        pass, or the draw of its tokens), every cache and generator is as before the step: the caller
        may run the parts again apart, and each gets what it would have got."""
        seqs = [seq for seq, _ in chunks]
        kvs = [s.session.kv for s in rows] + [s.session.kv for s in seqs]
        lengths, states = [kv.length for kv in kvs], generator_states(rows + seqs)
        if self.thread_tuner is not None:
            if chunks:
                self.thread_tuner.choose_for_prefill()
            else:
                self.thread_tuner.choose(len(rows))
        began = time.perf_counter()
        parts = [self._chunk(seq, max_tokens) for seq, max_tokens in chunks]
        decode = None
        if rows:
            mrope = {"position_offsets": [s.session.rope_delta for s in rows]} if self.runner.mrope else {}
            decode = DecodeRows([s.session.kv for s in rows], [s.next_token for s in rows],
                                adapter_slots=[s.adapter_slot for s in rows], **mrope)
        try:
            logits = self.stepper.step(parts, decode)
            if rows and not chunks and self.thread_tuner is not None:
                self.thread_tuner.observe(len(rows), time.perf_counter() - began)
            # the turns this chunk ends are drawn with their prompt in the transcript, not yet committed
            finishing = self._finishing(chunks, parts)
            drawn = rows + [seqs[i] for i in finishing]
            picked = list(range(len(rows))) + [len(rows) + i for i in finishing]
            transcripts = [s.session.token_ids for s in rows] + [
                seqs[i].session.token_ids + self.prompt_ids(seqs[i]) for i in finishing]
            tokens = self._sample(drawn, logits if len(picked) == logits.shape[0] else logits[picked],
                                  transcripts) if drawn else []
        except BaseException:
            for kv, length in zip(kvs, lengths):
                kv.crop(length)  # the stepper advances lengths after its pass, sampling comes later
            restore_generators(rows + seqs, states)
            raise
        if rows and not chunks:
            step_s = time.perf_counter() - began  # the cost speculation has to beat, at this batch size
            for seq in rows:
                if seq.controller is not None:
                    seq.controller.observe_plain(step_s)
        return self._advance(chunks, parts, dict(zip(finishing, tokens[len(rows):]))), tokens[:len(rows)]

    @staticmethod
    def _finishing(chunks: list[tuple[Sequence, int]], parts: list[Chunk]) -> list[int]:
        """The indexes of the chunks that feed their turn's last prompt token."""
        return [i for i, ((seq, _), part) in enumerate(zip(chunks, parts))
                if seq.progress is not None and part.embeds.shape[0] == seq.progress.left]

    def _chunk(self, seq: Sequence, max_tokens: int) -> Chunk:
        """The turn's next chunk: up to ``max_tokens`` of what its prefill still feeds."""
        progress = seq.progress
        if progress is None:
            raise RuntimeError("a prefill chunk of a turn not begun")
        end = progress.done + min(max_tokens, progress.left)
        positions = None if progress.positions is None else progress.positions[:, progress.done:end]
        return Chunk(seq.session.kv, progress.embeds[progress.done:end], seq.adapter_slot, positions)

    def _advance(self, chunks: list[tuple[Sequence, int]], parts: list[Chunk],
                 first_tokens: dict[int, int | Exception]) -> list[int | Exception | None]:
        """After the pass: each chunk's progress; the turns that fed their last token committed, each
        with its first token (``first_tokens``, by chunk index), or the error it fails with alone."""
        results: list[int | Exception | None] = [None] * len(chunks)
        for index, ((seq, _), part) in enumerate(zip(chunks, parts)):
            progress = seq.progress
            assert progress is not None  # _chunk checked
            progress.done += part.embeds.shape[0]
            self.num_prefill_chunks += 1
            if index not in first_tokens:
                continue
            token = first_tokens[index]
            if isinstance(token, Exception):  # the engine rolls the turn back
                results[index] = token
                continue
            try:
                self._commit(seq)
            except Exception as exc:  # its request fails alone (the engine rolls the turn back)
                results[index] = exc
            else:
                results[index] = token
        return results

    def _commit(self, seq: Sequence) -> None:
        """The turn fed its last prompt token: into the transcript, its blocks published, its draft synced."""
        session = seq.session
        seq.progress = None
        self.sessions.commit_turn(seq.turn, self.prompt_ids(seq))
        self.sessions.publish(session)  # its prompt's full blocks, for the next request that shares them
        self.num_prefilled_tokens += seq.prompt_tokens - seq.cached_tokens
        self.num_cached_tokens += seq.cached_tokens
        if self.speculator is not None and seq.request.speculative and seq.request.sampling.speculable:
            k = self.config.num_speculative_tokens
            seq.controller = SpeculationController(k_max=k, k=min(4, k), costs=self.step_costs)
            self.speculator.sync_draft(session.token_ids, session.draft_kv, self.sessions.salt(session))

    def begin(self, seq: Sequence) -> PrefillProgress:
        """Begin the turn's prefill: check its length, take its adapter, its images and its memory
        (``Sessions.prepare_turn``: a shared prefix, a restore or a recompute) and embed what it feeds."""
        request, session = seq.request, seq.session
        new_ids = self.prompt_ids(seq)
        seq.prompt_tokens = len(session.token_ids) + len(new_ids)
        self._check_length(seq)
        seq.generator = make_generator(request.sampling, self.config.seed, self.runner.device)
        seq.matcher = request.grammar.start() if request.grammar is not None else None
        digests = list(request.image_digests) or request.images.digests()
        if session.adapter is not None:  # resident for as long as the request runs
            seq.adapter_slot = registry_or_404(self.adapters, session.adapter).acquire(session.adapter)
        embeds, positions = self.sessions.prepare_turn(seq.turn, new_ids, digests,
                                                       seq.prompt_tokens + request.sampling.max_tokens)
        seq.progress = PrefillProgress(embeds=embeds, positions=positions)
        return seq.progress

    def prompt_ids(self, seq: Sequence) -> list[int]:
        """The turn's new ids (rendered once: the session cannot change while its request is in flight)."""
        if seq.prompt_ids is None:
            seq.prompt_ids = self._prompt(seq)
        return seq.prompt_ids

    def tokens_to_prefill(self, seq: Sequence) -> int:
        """What the turn's prefill still feeds: exact once begun; before, its new ids and the session's
        unfed tail, or its whole transcript when nothing is cached (a shared prefix may then cut it).
        The scheduler's estimate: never raises (a prompt that cannot render fails when it begins)."""
        if seq.progress is not None:
            return seq.progress.left
        try:
            new = len(self.prompt_ids(seq))
        except ResidentError:
            return 1
        session = seq.session
        cached = session.host_length if session.tier is Tier.HOST else session.kv.length  # a restore feeds nothing
        return max(1, len(session.token_ids) - cached + new)

    def can_admit(self, seqs: list[Sequence]) -> bool:
        """Could these turns, none begun, all take their KV room now (session/state/kv_manager.py)?
        A turn that cannot render counts nothing: it fails when it begins."""
        needs = []
        for seq in seqs:
            try:
                new_ids = self.prompt_ids(seq)
            except ResidentError:
                continue
            total = len(seq.session.token_ids) + len(new_ids) + seq.request.sampling.max_tokens
            needs.append(self.sessions.turn_need(seq.session, new_ids, min(total, self.max_context)))
        return self.sessions.kv.can_admit(needs)

    def is_resident(self, seq: Sequence) -> bool:
        """Is the request a follow-up over KV held on the device (the scheduler serves those first)?"""
        session = seq.session
        return not session.ephemeral and session.tier is Tier.DEVICE and session.kv.length > 0

    def _prompt(self, seq: Sequence) -> list[int]:
        """The turn's new ids, each image placeholder expanded to that image's own count."""
        request, session = seq.request, seq.session
        images = request.images
        if request.token_ids is not None:  # raw ids (tests, benchmarks): placeholders already expanded
            image_id = self.runner.info.image_token_id
            placeholders = 0 if image_id is None else request.token_ids.count(image_id)
            if placeholders != sum(images.num_tokens):
                raise BadRequest(f"the prompt has {placeholders} image placeholder tokens but its {len(images)} "
                                 f"images expand to {sum(images.num_tokens)}")
            return list(request.token_ids)
        first_turn = session.num_turns == 0
        piece = request.rendered.piece(first_turn, session.ended_with_eos) if request.rendered else None
        if piece is None:
            piece = self.formatter.opening(request.messages, images.num_tokens) if first_turn else \
                self.formatter.followup(request.messages, session.ended_with_eos, images.num_tokens)
        return piece.token_ids

    def _check_length(self, seq: Sequence) -> None:
        prompt_tokens, max_tokens, session = seq.prompt_tokens, seq.request.sampling.max_tokens, seq.session
        if prompt_tokens + max_tokens > self.max_context:
            raise ContextLengthExceeded(
                f"this turn needs {prompt_tokens} prompt tokens + max_tokens {max_tokens} = "
                f"{prompt_tokens + max_tokens}, over the context window of {self.max_context}"
                + (" (the session's history counts)" if session.num_turns else ""))
        cap = self.config.max_session_tokens
        if cap and not session.ephemeral and prompt_tokens + max_tokens > cap:
            raise ContextLengthExceeded(
                f"this session would hold {prompt_tokens + max_tokens} tokens (prompt {prompt_tokens} + max_tokens "
                f"{max_tokens}), over the per-session cap of {cap}; close it and open a new one")

    # ------------------------------------------------------------------ decode

    def speculating(self, rows: list[Sequence]) -> list[Sequence]:
        """The rows that take a speculative step this time: every row with a controller, or none
        (``batch_should_speculate``: the rows share the step's target pass). While any does, the whole
        step is one batched speculative step (``speculate``); none: a plain batched ``decode``."""
        chosen = [(s, s.controller) for s in rows if s.controller is not None]
        if not chosen or any(not s.request.sampling.speculable for s in rows):
            return []  # a row with penalties, bias, top-k or log-probabilities needs the plain step's sampler
        for _, controller in chosen:  # the costs it reads and records are this batch size's
            controller.batch_size = len(rows)
        if len(rows) > self.config.speculative_max_batch:
            return []
        return [s for s, _ in chosen] if batch_should_speculate([c for _, c in chosen]) else []

    def decode(self, rows: list[Sequence]) -> list[int | ResidentError]:
        """One batched decode step alone (``step`` without chunks): feeds each row's last token, returns
        each row's next token (or the error of a row that could not be sampled: it fails alone). When it
        raises, every row is as before the step, so the engine may run the same rows again and each
        gets the token it would have got (its retry after an OOM)."""
        return self.step([], rows)[1]

    def _sample(self, rows: list[Sequence], logits, transcripts: list[list[int]]) -> list[int | ResidentError]:
        """logits [B, V] -> each row's next token, or the error its request fails with (logged here).
        ``transcripts``: each row's tokens so far (penalties read them; a turn's first token: with its prompt).
        Each row's processors (penalties, bias, its grammar's mask) apply first; a row that asked for
        log-probabilities gets the model's; a row's grammar matcher then takes its token."""
        logits = ban_token(logits, self.runner.info.image_token_id)
        params = [s.request.sampling for s in rows]
        processed = process_logits(logits, [RowContext(p, s.generated, transcript, s.matcher)
                                             for p, s, transcript in zip(params, rows, transcripts)],
                                   self.runner.info.eos_token_ids, pin=logits.is_cuda)
        tokens = sample_rows(processed, params, [s.generator for s in rows])
        wanted = [p.logprobs for p in params]
        if any(k is not None for k in wanted):
            for seq, entry in zip(rows, row_logprobs(logits, tokens, wanted)):
                if entry is not None:
                    seq.logprobs.append(entry)
        for b, (seq, token) in enumerate(zip(rows, tokens)):
            if seq.matcher is not None and not isinstance(token, ResidentError) and not seq.matcher.consume_token(token):
                tokens[b] = token = ResidentError(f"the grammar refused the sampled token {token}: "
                                                  f"{seq.matcher.get_error()}")
            if isinstance(token, ResidentError):
                logger.error("request %s (session %s) failed, %d other(s) in its step went on: %s", seq.request_id,
                             redact(seq.session.session_id), len(rows) - 1, token.message, exc_info=token.__cause__)
        return tokens

    def speculate(self, rows: list[Sequence], speculating: list[Sequence]) -> list[list[int]]:
        """One speculative step for every row of the step, in one target pass: the rows in ``speculating``
        draft (or look up) up to their k tokens, the others (requests that turned speculation off) ride
        along as plain rows. Returns each row's accepted tokens; both caches of each row then hold its
        transcript extended by them, but its last token. On failure every row's caches are rewound and
        its generator is as before the step (the error propagates: the rows fail, or after an OOM the
        engine decodes them again without speculation)."""
        return self.step_speculative([], rows, speculating)[1]

    def step_speculative(self, chunks: list[tuple[Sequence, int]], rows: list[Sequence],
                         speculating: list[Sequence]) -> tuple[list[int | Exception | None], list[list[int]]]:
        """``speculate`` whose verify also feeds ``chunks`` (begun turns' next chunks, as ``step`` feeds
        them): the verify's rows and the chunks in ONE target pass (``Stepper.step``, where the stepper
        packs; ``packs_verify``). Returns per chunk what ``step`` returns, per row its accepted tokens.
        When it raises, every cache and generator is as before the step (the caller may run the chunks
        and the rows apart)."""
        chosen = {id(s) for s in speculating}
        seqs = [seq for seq, _ in chunks]
        lengths, states = [s.session.kv.length for s in seqs], generator_states(rows + seqs)
        spec_rows = [SpecRow(s.session.token_ids, s.session.kv, s.session.draft_kv,
                             s.controller.k if id(s) in chosen and s.controller is not None else 0,
                             max_new=s.request.sampling.max_tokens - len(s.generated), sampling=s.request.sampling,
                             generator=s.generator, adapter_slot=s.adapter_slot, matcher=s.matcher) for s in rows]
        parts = [self._chunk(seq, max_tokens) for seq, max_tokens in chunks]
        chunk_logits = []

        def verify(kvs, fed, adapter_slots):  # the target pass: the rows' fed tokens, then the chunks
            targets = DecodeRows.verify(kvs, fed, adapter_slots)
            logits = self.stepper.step(parts, targets)  # [rows' tokens + chunks, V]
            chunk_logits.append(logits[len(targets):])
            return targets.widen(logits[:len(targets)])

        if chunks and self.thread_tuner is not None:
            self.thread_tuner.choose_for_prefill()
        try:
            results = self._decoder().step_batch(spec_rows, self.runner.info.eos_token_ids, verify if chunks else None)
        except BaseException:
            for seq in rows:
                self.rewind(seq)
            for seq, length in zip(seqs, lengths):
                seq.session.kv.crop(length)
            restore_generators(rows + seqs, states)
            raise
        for seq, result in zip(rows, results):  # a verify that fed chunks also paid for them: not its cost
            if id(seq) in chosen and seq.controller is not None:
                seq.controller.observe(result.num_proposed, result.num_accepted, result.draft_s, result.verify_s,
                                       timed=not chunks)
        self.num_verifies_with_chunks += bool(chunks)
        first_tokens = self._draw_first(chunks, parts, chunk_logits[0]) if chunks else {}
        return self._advance(chunks, parts, first_tokens), [list(result.token_ids) for result in results]

    def _draw_first(self, chunks: list[tuple[Sequence, int]], parts: list[Chunk], logits) -> dict[int, int | Exception]:
        """The first token of each turn its chunk finishes (by chunk index), from the chunks' logits [C, V],
        drawn with its prompt in the transcript (not yet committed), or the error the turn fails with
        alone: the rows' speculative step already took its tokens."""
        finishing = self._finishing(chunks, parts)
        if not finishing:
            return {}
        seqs = [chunks[i][0] for i in finishing]
        transcripts = [s.session.token_ids + self.prompt_ids(s) for s in seqs]
        states = generator_states(seqs)
        try:
            return dict(zip(finishing, self._sample(seqs, logits[finishing], transcripts)))
        except Exception:  # drawn again one by one, so that only the turn whose draw raises fails
            restore_generators(seqs, states)
        drawn: dict[int, int | Exception] = {}
        for index, seq, transcript in zip(finishing, seqs, transcripts):
            try:
                drawn[index] = self._sample([seq], logits[index:index + 1], [transcript])[0]
            except Exception as exc:
                drawn[index] = exc
        return drawn

    def rewind(self, seq: Sequence) -> None:
        """Tokens of a speculative run after the one that ended the request were dropped: crop the caches."""
        self._decoder().rewind(seq.session.token_ids, seq.session.kv, seq.session.draft_kv)

    def _decoder(self) -> SpeculativeDecoder:
        if self.speculator is None:  # a controller is only made when there is a draft model
            raise RuntimeError("a speculative step without a speculative decoder")
        return self.speculator


def generator_states(rows: list[Sequence]) -> list:
    """Each row's sampling generator state (None: a greedy row has no generator), taken before a step."""
    return [None if s.generator is None else s.generator.get_state() for s in rows]


def restore_generators(rows: list[Sequence], states: list) -> None:
    """Undo what a failed step drew: each sampled row draws the same numbers when it runs again."""
    for seq, state in zip(rows, states):
        if state is not None and seq.generator is not None:
            seq.generator.set_state(state)
