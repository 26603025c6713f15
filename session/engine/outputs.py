"""The output processor: sampled tokens in, text deltas, stop strings, usage and final events out.

Who calls this: the engine loop thread, once per sampled token of a sequence (``on_token``), in
order. Detokenisation is incremental (``Detokenizer``): each token decodes a short window of the
answer, never the whole answer again, so a 4,000-token answer costs 4,000 small decodes rather
than 4,000 growing ones. Text that could be the start of a stop string, or a partial UTF-8
character, is held back until it is known not to be.
"""

from __future__ import annotations

from typing import Protocol

from session.engine.detokenizer import Detokenizer, text_of
from session.engine.events import Finished, TextDelta
from session.engine.requests import Sequence
from session.state.session import SessionState
from session.types import Usage


class Transcript(Protocol):
    """Who writes a session's answer into its transcript: ``Sessions`` (the one writer of session state)."""

    def append_token(self, session: SessionState, token: int) -> None: ...

    def end_answer(self, session: SessionState, ended_with_eos: bool) -> None: ...


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], transcript: Transcript):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.transcript = transcript
        self.decode = text_of(tokenizer)
        self.decode_special = text_of(tokenizer, skip_special_tokens=False)
        self.num_generated_tokens = 0

    def start(self, seq: Sequence) -> None:
        """Called when the sequence's prefill committed, before its first token."""
        seq.detokenizer = Detokenizer(self.tokenizer,
                                      self.decode_special if seq.request.keep_special else self.decode)

    def on_token(self, seq: Sequence, token: int) -> Finished | None:
        """Record a sampled token in the sequence and its session's transcript; stream what became
        final; return the Finished event when the request is complete (the engine sends it)."""
        seq.generated.append(token)
        self.transcript.append_token(seq.session, token)
        self.num_generated_tokens += 1
        sampling, detok = seq.request.sampling, seq.detokenizer
        assert detok is not None, "start() gives a sequence its detokenizer before its first token"
        is_eos = token in self.eos_token_ids
        before = len(detok.text)
        if not is_eos:
            detok.add(token)
        text, finish_reason = detok.text, None
        stop_at = min((i for i in (text.find(stop, max(0, before - len(stop) + 1)) for stop in sampling.stop)
                       if i >= 0), default=None)
        if stop_at is not None:
            text, finish_reason = text[:stop_at], "stop"
        elif is_eos:
            finish_reason = "stop"
        elif len(seq.generated) >= sampling.max_tokens:
            finish_reason = "length"
        if finish_reason is not None and stop_at is None:
            text = detok.text + detok.flush()
        if finish_reason is None:
            hold = max((len(s) - 1 for s in sampling.stop), default=0)
            self._send(seq, text[: max(seq.num_text_sent, len(text) - hold)])
            return None
        self._send(seq, text)
        self.transcript.end_answer(seq.session, is_eos)
        usage = Usage(prompt_tokens=seq.prompt_tokens, completion_tokens=len(seq.generated),
                      cached_tokens=seq.cached_tokens)
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = tuple(entry for entry in seq.logprobs if entry.token_id not in self.eos_token_ids)
        return Finished(session_id=None if seq.session.ephemeral else seq.session.session_id, text=text,
                        token_ids=tuple(seq.generated), finish_reason=finish_reason, usage=usage, logprobs=logprobs)

    def _send(self, seq: Sequence, text: str) -> None:
        """Stream the text not yet sent, with the log-probabilities of the tokens that made it (EOS never)."""
        if len(text) > seq.num_text_sent:
            if seq.request.stream.deltas:  # else the consumer reads the whole text from Finished
                entries = tuple(entry for entry in seq.logprobs[seq.num_logprobs_sent:]
                                if entry.token_id not in self.eos_token_ids)
                seq.num_logprobs_sent = len(seq.logprobs)
                seq.request.stream.put(TextDelta(text[seq.num_text_sent:], entries))
            seq.num_text_sent = len(text)
