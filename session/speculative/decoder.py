"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

Plain decoding costs one target forward pass per token. Here a proposer (a small draft model,
or prompt lookup in the session's own transcript) guesses the next k tokens; the target scores
``[last] + proposals`` in ONE pass and keeps the longest prefix it agrees with, plus one token of
its own. Every step therefore yields between 1 and k+1 tokens for one target pass.

Exactness. Greedy: a proposal is kept only where it equals the target's argmax, and the token
after the kept prefix is the target's argmax, so the output is token for token what the target
alone produces. Sampling: the rejection rule of Leviathan et al. / Chen et al. (2023) makes each
emitted token distributed exactly as the target's (after the same temperature / top-p warping).

Who calls this: the engine's loop thread (one ``SpeculativeDecoder`` per engine, shared by all
sessions). The caller owns every cache: the session holds the target's KV cache and the draft's
KV cache (counted in its bytes), so a follow-up turn prefills only its new tokens in both models.
Between steps the target's cache holds every transcript token but the last (fed next); the draft's
holds a prefix of the text and is caught up by its next pass (see ``SpeculativeDecoder``).

Pure functions (``greedy_accept``, ``sampling_accept``, ``propose_ngram``, ``batch_should_speculate``;
``warp_probs`` lives in session.model.sampling) hold the maths; ``SpeculationController`` decides k and when
speculation does not pay; the decoder glues them to the model runners. The decoder steps a batch of
sequences at once: batched draft passes, then ONE target pass (``ModelRunner.extend``) verifies
every row's proposals at its own cache length.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from session.errors import ConfigError
from session.model.kv_cache import KVCache
from session.model.sampling import warp_probs
from session.types import SamplingParams

if TYPE_CHECKING:  # annotations only: the pure functions need no model code
    from session.model.runner import ModelRunner

# ---------------------------------------------------------------- accept / reject


def greedy_accept(draft_tokens: list[int], target_logits: torch.Tensor) -> list[int]:
    """The tokens a greedy step emits: the agreed prefix of the proposals, then the target's own token.

    target_logits: [k+1, V]; row i scores the position after ``draft_tokens[:i]`` (row 0 follows the
    last transcript token, row k is the bonus position after all k proposals).
    Returns 1 .. k+1 tokens: draft_tokens[:m] + [argmax row m], m = the first disagreement (or k).
    """
    return agreed_prefix(draft_tokens, target_logits.argmax(dim=-1).tolist())  # [k+1], one host sync


def agreed_prefix(draft_tokens: list[int], target_tokens: list[int]) -> list[int]:
    """greedy_accept on the target's argmax tokens [k+1] (a batch computes them in one host sync)."""
    num_accepted = 0
    while num_accepted < len(draft_tokens) and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return draft_tokens[:num_accepted] + [target_tokens[num_accepted]]


def sampling_accept(draft_tokens: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None) -> list[int]:
    """Speculative sampling: emitted tokens are distributed exactly as the target's (p), not the draft's (q).

    draft_probs: [k, V], q_i — the distribution draft_tokens[i] was drawn from (one-hot for prompt lookup).
    target_probs: [k+1, V], p_i — the target's distribution at the same positions, plus the bonus one.

    For proposal x_i ~ q_i:
        accept with probability min(1, p_i(x) / q_i(x))            (test: u * q_i(x) < p_i(x), u ~ U[0,1))
        on rejection emit y ~ norm(max(0, p_i - q_i)) and stop.
    Why it is exact: P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
                               = min(q(x), p(x)) + (1 - sum_z min(q(z), p(z))) * max(0, p(x)-q(x)) / Z
    and Z = sum_z max(0, p(z)-q(z)) = 1 - sum_z min(q(z), p(z)), so P(emit x) = min(q,p) + max(0, p-q) = p(x).
    If all k are accepted, the bonus token is drawn from p_k. Returns 1 .. k+1 tokens.
    """
    k = len(draft_tokens)
    if k:
        proposed = torch.tensor(draft_tokens, device=target_probs.device)  # [k]
        rows = torch.arange(k, device=target_probs.device)
        p = target_probs[rows, proposed]  # [k], p_i(x_i)
        q = draft_probs[rows, proposed]  # [k], q_i(x_i)
        u = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
        accepted = (u * q < p).tolist()
        for i, ok in enumerate(accepted):
            if not ok:
                residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)  # [V]
                return draft_tokens[:i] + [_draw(residual, target_probs[i], generator)]
    return draft_tokens + [_draw(target_probs[k], target_probs[k], generator)]


def _draw(weights: torch.Tensor, fallback: torch.Tensor, generator: torch.Generator | None) -> int:
    # weights: [V], unnormalised. A residual can round to all zeros when p and q are equal up to float
    # error (a rejection then has probability ~0); the target's own distribution is the right answer there.
    if float(weights.sum()) <= 0.0:
        weights = fallback
    return int(torch.multinomial(weights, 1, generator=generator)[0])


# ---------------------------------------------------------------- proposers


def propose_ngram(context_ids: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the latest earlier occurrence of the context's tail.

    Tries the longest tail first (max_ngram tokens, down to min_ngram): a longer match predicts better.
    The occurrence must end before the last token, so at least one token follows it. Returns [] when
    nothing matches (the step then degenerates to a plain one: the target scores the last token alone).
    """
    num_ids = len(context_ids)
    if k <= 0:
        return []
    for n in range(min(max_ngram, num_ids - 1), min_ngram - 1, -1):
        tail = context_ids[num_ids - n:]
        last = tail[-1]
        # candidate occurrences end at position `end` (exclusive), latest first; end <= num_ids - 1
        for end in range(num_ids - 1, n - 1, -1):
            if context_ids[end - 1] == last and context_ids[end - n:end] == tail:
                return context_ids[end:end + k]
    return []


# ---------------------------------------------------------------- adaptive k


class StepCosts:
    """Measured decode-step costs by batch size, shared by every sequence of an engine.

    Costs belong to the batch, not to a sequence: a request that joins a batch size already measured
    needs no plain step of its own. Each cost is the least of its last ``window`` steps' observations:
    on a busy machine interference only ever adds time, and one slow step (measured: a verify pass at
    3x its usual time) must not switch speculation off. Every row of a batched step reports that
    step's costs, so batch size B keeps window * B observations (the same ``window`` steps).
    """

    def __init__(self, window: int = 8):
        self.window = window
        self._plain: dict[int, deque] = {}  # batch size -> recent plain target decode steps
        self._draft: dict[int, deque] = {}  # batch size -> recent costs of one proposal (draft pass, or lookup)
        self._verify_extra: dict[int, deque] = {}  # batch size -> the verify pass's extra cost per proposed token

    def plain_step_s(self, batch_size: int) -> float | None:
        return min(self._plain.get(batch_size, ()), default=None)

    def draft_step_s(self, batch_size: int) -> float | None:
        return min(self._draft.get(batch_size, ()), default=None)

    def verify_extra_s(self, batch_size: int) -> float:
        return min(self._verify_extra.get(batch_size, ()), default=0.0)

    def observe_plain(self, step_s: float, batch_size: int) -> None:
        self._recent(self._plain, batch_size).append(step_s)

    def observe_speculative(self, num_proposed: int, draft_s: float, verify_s: float, batch_size: int) -> None:
        self._recent(self._draft, batch_size).append(draft_s / num_proposed)
        plain = self.plain_step_s(batch_size)
        if plain is not None:
            self._recent(self._verify_extra, batch_size).append(max(0.0, verify_s - plain) / num_proposed)

    def _recent(self, table: dict[int, deque], batch_size: int) -> deque:
        return table.setdefault(batch_size, deque(maxlen=self.window * batch_size))


@dataclass
class SpeculationController:
    """Chooses k (proposals per step) from measured acceptance and costs; says when to decode plainly.

    Model (i.i.d. acceptance with rate a; draft step costs r and the verify pass 1 + k*rho plain target
    steps): a step with k proposals yields E(k) = 1 + a + ... + a^k tokens for 1 + k*(r + rho) plain-step
    costs, so the expected speedup is S(k) = E(k) / (1 + k*(r + rho)). k = argmax S over [1, k_max];
    speculate only while S(k) >= min_speedup, and after some plain steps try once more (acceptance
    depends on the text: a follow-up that quotes the conversation may suddenly pay). A failed try at
    k=1 costs r + rho of a plain step, so a cheap draft tries again soon: after (r + rho) / probe_cost
    plain steps, at most ``probe_interval`` (measured: a 0.25-cost draft fell back 2-3 times per
    128-token answer, each time in a short stretch of text it mispredicted). A try that still does not
    pay doubles the wait before the next (``probe_backoff``, up to ``max_probe_backoff``): where a
    pair does not pay at all (the deep pair in bfloat16 on CPU, where the verify pass costs 1.9 plain
    steps), tries every 9-16 steps cost ~8% of plain speed.

    Acceptance is estimated from geometric trials: a step that accepted m of k proposals saw m
    successes and (m < k) failures; the proposals after the first rejection were never tested.
    One controller per sequence (or per session): acceptance depends on the text being written. The
    costs (``StepCosts``) are the batch's: the engine's rows share one table, and ``batch_size`` says
    which batch size this row steps at now (the executor sets it before each decision). A batch
    decides together (``batch_should_speculate``): its rows share one target pass.
    """

    k_max: int = 8
    k: int = 4  # proposals for the next speculative step
    smoothing: float = 0.25  # EMA weight of the newest acceptance observation
    min_speedup: float = 1.05  # expected gain below which plain decoding is used
    probe_interval: int = 16  # the most plain steps between two tries of speculation
    probe_cost: float = 0.05  # the share of plain decoding time that failed tries may cost
    prior_acceptance: float = 0.6
    costs: StepCosts = field(default_factory=StepCosts)
    batch_size: int = 1  # rows in the steps this sequence takes now
    num_successes: float = field(init=False)  # EMA of accepted proposals per step
    num_trials: float = field(init=False)  # EMA of tested proposals per step
    num_plain_since_probe: int = 0
    probe_backoff: int = 1  # multiplies the plain steps between probes; doubles after each failed probe
    max_probe_backoff: int = 32
    min_delivered_steps: int = 3  # this sequence's speculative steps at a batch size before they are weighed
    # batch size -> (EMA of this row's tokens per second in speculative steps, steps observed)
    delivered: dict[int, tuple[float, int]] = field(default_factory=dict)

    def __post_init__(self):
        if not 1 <= self.k <= self.k_max:
            raise ConfigError(f"speculative k must be in [1, k_max={self.k_max}], got {self.k}")
        self.num_successes, self.num_trials = self.prior_acceptance, 1.0

    @property
    def plain_step_s(self) -> float | None:
        return self.costs.plain_step_s(self.batch_size)

    @property
    def draft_step_s(self) -> float | None:
        return self.costs.draft_step_s(self.batch_size)

    @property
    def verify_extra_s(self) -> float:
        return self.costs.verify_extra_s(self.batch_size)

    @property
    def acceptance(self) -> float:
        """Estimated probability that one proposal is accepted."""
        return self.num_successes / self.num_trials if self.num_trials > 0 else 0.0

    def expected_tokens(self, k: int) -> float:
        """E(k) = sum_{i=0..k} a^i: tokens per target pass with k proposals (the +1 is the target's own)."""
        return sum(self.acceptance ** i for i in range(k + 1))

    def realized_speedup(self) -> float | None:
        """What this sequence's recent speculative steps at its batch size delivered, as a speedup over
        plain steps there (its tokens per second x the plain step's seconds); None until it took
        ``min_delivered_steps`` of them.

        The model of ``expected_speedup`` (acceptance, and costs linear in k) was optimistic at larger
        batches: at 8 sessions on one CPU thread it predicted 1.2-1.3x where the steps delivered
        0.84-0.98x (benchmarks/speculative_sessions.py, the deep pair). What this row's own steps
        delivered follows its text (acceptance) and the batch's real costs, so it has the last word;
        it is kept per batch size and per sequence, so one request's hard text does not stop another's.
        """
        rate, steps = self.delivered.get(self.batch_size, (0.0, 0))
        if steps < self.min_delivered_steps or not self.plain_step_s:
            return None
        return rate * self.plain_step_s

    def speedup(self) -> float:
        """The speedup the next step is judged by: what was delivered where known, else the model's."""
        realized = self.realized_speedup()
        return realized if realized is not None else self.expected_speedup(self.k)

    def expected_speedup(self, k: int) -> float:
        if not self.plain_step_s or self.draft_step_s is None:
            return float("inf")  # nothing measured yet: be optimistic, measurements will correct it
        marginal = (self.draft_step_s + self.verify_extra_s) / self.plain_step_s  # r + rho
        return self.expected_tokens(k) / (1.0 + k * marginal)

    def best_k(self) -> int:
        return max(range(1, self.k_max + 1), key=lambda k: (self.expected_speedup(k), -k))

    def should_speculate(self) -> bool:
        """Called before each step. False: decode plainly this step (and report it with observe_plain)."""
        if self.plain_step_s is None:
            return False  # calibrate: one plain step measures the cost speculation must beat
        if self.speedup() >= self.min_speedup:
            return True
        return self.probe_due()

    def probe_due(self) -> bool:
        """Enough plain steps since speculation last ran that it is worth another try."""
        if not self.plain_step_s or self.draft_step_s is None:
            return True
        marginal = (self.draft_step_s + self.verify_extra_s) / self.plain_step_s  # a failed try's cost
        gap = min(self.probe_interval, math.ceil(marginal / self.probe_cost)) * self.probe_backoff
        return self.num_plain_since_probe >= gap

    def observe(self, num_proposed: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        """Called after a speculative step with what it proposed, accepted and cost (the batch's costs)."""
        # a try against the odds: a speculative step after plain ones, taken while speculation did not pay
        probe = self.num_plain_since_probe > 0 and self.plain_step_s is not None and self.speedup() < self.min_speedup
        self.num_plain_since_probe = 0
        if num_proposed == 0:  # prompt lookup found nothing: it was a plain step in disguise
            self.observe_plain(verify_s)
            return
        w = self.smoothing
        rate, steps = self.delivered.get(self.batch_size, (0.0, 0))
        step_rate = (num_accepted + 1) / max(draft_s + verify_s, 1e-9)  # this row's tokens per second
        self.delivered[self.batch_size] = (step_rate if steps == 0 else rate + w * (step_rate - rate), steps + 1)
        tested = num_accepted + (num_accepted < num_proposed)
        self.num_successes += w * (num_accepted - self.num_successes)
        self.num_trials += w * (tested - self.num_trials)
        self.costs.observe_speculative(num_proposed, draft_s, verify_s, self.batch_size)
        self.k = self.best_k()
        if probe:  # a failed try waits twice as long for the next (bounded); one that pays resets the wait
            paid = self.speedup() >= self.min_speedup
            self.probe_backoff = 1 if paid else min(2 * self.probe_backoff, self.max_probe_backoff)

    def observe_plain(self, step_s: float) -> None:
        """Called after a plain decode step (of ``batch_size`` rows) with its duration."""
        self.costs.observe_plain(step_s, self.batch_size)
        self.num_plain_since_probe += 1


def batch_should_speculate(controllers: list[SpeculationController]) -> bool:
    """Whether a batched step speculates (for every row with a controller) or decodes plainly.

    The rows share the step's passes, so they decide together: speculate when their mean speedup
    (``SpeculationController.speedup``: delivered where known, else expected) reaches min_speedup, or
    when a probe is due for any of them. Without a plain step measured at this batch size the step is
    plain: it measures the cost speculation has to beat.
    """
    if not controllers or any(c.plain_step_s is None for c in controllers):
        return False
    if any(c.probe_due() for c in controllers):
        return True
    mean = sum(c.speedup() for c in controllers) / len(controllers)
    return mean >= controllers[0].min_speedup


# ---------------------------------------------------------------- compatibility


def check_compatible(target_tokenizer, draft_tokenizer) -> None:
    """Refuse (at start-up) a draft whose token ids mean something else than the target's.

    Proposals are token ids: a draft with another vocabulary proposes ids the target reads as other
    text, so acceptance collapses (and sampling's p/q comparison is meaningless).
    """
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(t for t in target_vocab.keys() | draft_vocab.keys()
                           if target_vocab.get(t) != draft_vocab.get(t))
        example = differing[0]
        raise ConfigError(
            f"the draft model's vocabulary differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} "
            f"tokens, {len(differing)} differ; e.g. {example!r} is id {target_vocab.get(example)} in the target "
            f"and {draft_vocab.get(example)} in the draft). Speculative decoding needs a draft trained with the "
            "target's tokenizer: point the draft model path at such a checkpoint, or unset it to use prompt lookup"
        )
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(target_tokenizer, name) != getattr(draft_tokenizer, name):
            raise ConfigError(f"the draft tokenizer's {name} ({getattr(draft_tokenizer, name)}) differs from the "
                              f"target's ({getattr(target_tokenizer, name)}); use a draft with the target's tokenizer")


def check_runners_compatible(target: ModelRunner, draft: ModelRunner) -> None:
    """The draft must be a text-only causal LM whose logits index the target's vocabulary."""
    if draft.is_multimodal:
        raise ConfigError(f"the draft model at {draft.model_path!r} is multimodal; use a text-only causal LM "
                          "(it conditions on the transcript's text, see SpeculativeDecoder)")
    if draft.info.vocab_size != target.info.vocab_size:
        raise ConfigError(f"the draft model's vocab_size ({draft.info.vocab_size}) differs from the target's "
                          f"({target.info.vocab_size}); use a draft trained with the target's tokenizer")


# ---------------------------------------------------------------- the decoder


@dataclass
class SpecRow:
    """One sequence's part of a batched speculative step (``SpeculativeDecoder.step_batch``)."""

    token_ids: list[int]  # the transcript; its last token is not yet in target_kv
    target_kv: KVCache
    draft_kv: KVCache | None  # None for prompt lookup
    k: int  # proposals wanted; 0: a plain decode row in the same target pass
    max_new: int | None = None  # tokens the request may still emit
    sampling: SamplingParams | None = None  # None or greedy: greedy acceptance
    generator: torch.Generator | None = None
    adapter_slot: int = 0


@dataclass(frozen=True)
class StepResult:
    token_ids: list[int]  # tokens for the transcript, in order: 1 .. k+1 (fewer if cut at EOS / max_new)
    num_proposed: int  # proposals the target scored (k)
    num_accepted: int  # proposals it accepted (before any cut)
    draft_s: float  # seconds spent proposing
    verify_s: float  # seconds of the target pass and acceptance


# Text tokens a draft may lack (besides the transcript's last) and still take them in its first pass of a
# step: one after a step that accepted every proposal. More (plain steps since its last pass) are fed
# by ``_catch_up`` before the step, outside its timing, so that a step after plain decoding is judged
# by what speculating costs, not by the catch-up.
CATCH_UP_IN_STEP = 2


class SpeculativeDecoder:
    """Draft-and-verify steps for a batch of sequences (or one), over caches the caller owns.

    Text-only draft for LLaVA sessions: the draft conditions on the transcript WITHOUT the image
    placeholder tokens. A text draft cannot read image embeddings, and a multimodal draft would need
    its own vision tower pass per image (the costliest part of a first turn) for a model meant to be
    cheap; the target still sees the image and rejects whatever the text alone mispredicts. So the
    draft's context is shorter than the target's and its KV length is tracked on its own cache.

    With ``draft=None`` proposals come from prompt lookup (``propose_ngram``) in the transcript's text.

    Per session the caller keeps: ``token_ids`` (the target's transcript, image placeholders included),
    ``target_kv`` and (with a draft) ``draft_kv`` from ``new_draft_kv``. Between steps target_kv holds
    every transcript token but the last. draft_kv holds a prefix of the transcript's text: all but the
    last token, or one less after a step that accepted every proposal (the draft never fed its own k-th
    proposal; the next pass feeds it with the bonus token, in one forward pass). It lags further only
    after plain steps or a new turn, and its next pass (or ``sync_draft``) prefills just what it lacks.
    """

    def __init__(self, target: ModelRunner, draft: ModelRunner | None = None, *,
                 max_ngram: int = 3, min_ngram: int = 1, clock: Callable[[], float] = time.perf_counter):
        if draft is not None:
            check_runners_compatible(target, draft)
        self.target = target
        self.draft = draft
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.clock = clock
        self.image_token_id = target.info.image_token_id
        self.num_steps = 0  # speculative row steps: each row a batched step verified (its "target pass")
        self.num_plain_steps = 0  # plain row steps through the decoder (plain_step, rows riding along with k=0)
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_draft_synced_tokens = 0  # draft prefill of tokens it had not seen (new turns, after plain steps)

    def new_draft_kv(self, *, block_tokens: int, max_tokens: int, static: bool = False) -> KVCache | None:
        """The draft's cache for a new session (None for prompt lookup). The session owns it."""
        if self.draft is None:
            return None
        return self.draft.new_kv_cache(block_tokens=block_tokens, max_tokens=max_tokens, static=static)

    def text_ids(self, token_ids: list[int]) -> list[int]:
        """The draft's view of a transcript: image placeholders removed."""
        if self.image_token_id is None:
            return token_ids
        return [t for t in token_ids if t != self.image_token_id]

    # ------------------------------------------------------------ steps

    def sync_draft(self, token_ids: list[int], draft_kv: KVCache | None) -> int:
        """Prefill the draft with the text tokens it has not seen, all but the last. Returns how many.

        Who calls this: the engine after a turn's prefill, so the new turn's text is prefilled in the draft
        with the target's (and timed as prefill). Optional: ``step`` feeds whatever the draft lacks anyway.
        """
        if draft_kv is None:
            return 0
        missing = self._lacking(token_ids, draft_kv)[:-1]
        if missing:
            self.draft.prefill(draft_kv, self.draft.embed(missing, []))
            self.num_draft_synced_tokens += len(missing)
        return len(missing)

    def step(self, token_ids: list[int], target_kv: KVCache, draft_kv: KVCache | None, k: int, *,
             max_new: int | None = None, eos_token_ids: tuple[int, ...] = (),
             sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
             adapter_slot: int = 0) -> StepResult:
        """One speculative step for one sequence: ``step_batch`` with one row (see there and ``SpecRow``)."""
        row = SpecRow(token_ids, target_kv, draft_kv, k, max_new=max_new, sampling=sampling, generator=generator,
                      adapter_slot=adapter_slot)
        return self.step_batch([row], eos_token_ids)[0]

    def step_batch(self, rows: list[SpecRow], eos_token_ids: tuple[int, ...] = ()) -> list[StepResult]:
        """One speculative step for several sequences: batched draft passes, then ONE target pass for all.

        Each row proposes up to its own k tokens (the draft's passes run batched over the rows still
        proposing), then a single multi-row target pass (``ModelRunner.extend``) scores every row's
        ``[last] + proposals`` at its own cache length. A row with k=0 is a plain decode row riding along
        in the same pass. Each row then accepts (greedy or the rejection rule), and both its caches are
        cropped so they hold its new transcript (token_ids + result.token_ids) but its last token.
        The caller appends each ``result.token_ids``; output is cut after an EOS and at ``max_new``.
        Tokens after target_kv.length must be text (the engine's turn prefill feeds the images).
        ``adapter_slot``: the row's LoRA adapter, applied to the target only. The draft stays the base
        model's: an adapter shifts the target's distribution, so acceptance may drop, never exactness.
        draft_s / verify_s in the results are the whole batch's (the rows share the passes).
        """
        ks = []
        for row in rows:
            if row.max_new is not None and row.max_new < 1:
                raise ValueError(f"max_new must be >= 1, got {row.max_new}")
            ks.append(row.k if row.max_new is None else min(row.k, row.max_new - 1))  # more could not be emitted
        if self.draft is not None:
            self._catch_up([row for row, k in zip(rows, ks) if k > 0])
        started = self.clock()
        if self.draft is not None:
            proposed = self._propose_draft(rows, ks, eos_token_ids)
        else:
            proposed = [(propose_ngram(self.text_ids(row.token_ids), k, self.max_ngram, self.min_ngram), None)
                        for row, k in zip(rows, ks)]
        proposed_at = self.clock()
        fed = []
        for row, (proposals, _) in zip(rows, proposed):
            row.target_kv.crop(len(row.token_ids) - 1)
            fed.append(row.token_ids[row.target_kv.length:] + proposals)  # usually [last] + proposals
        logits = self.target.extend([row.target_kv for row in rows], fed, [row.adapter_slot for row in rows])
        if self.target.info.image_token_id is not None:  # as in plain decoding: never emit a placeholder
            banned = torch.tensor([self.target.info.image_token_id], device=logits.device)
            logits = logits.index_fill(-1, banned, float("-inf"))
        greedy_tokens = logits.argmax(dim=-1).tolist()  # [B, T]: one host sync for every greedy row
        results = []
        for b, (row, k, (proposals, draft_probs)) in enumerate(zip(rows, ks, proposed)):
            scored = slice(len(fed[b]) - len(proposals) - 1, len(fed[b]))  # after the last token, then each proposal
            if row.sampling is None or row.sampling.greedy:
                emitted = agreed_prefix(proposals, greedy_tokens[b][scored])
            else:
                emitted = _sampling_accept(proposals, draft_probs, logits[b, scored], row.sampling, row.generator)
            num_accepted = len(emitted) - 1
            emitted = _cut(emitted, row.max_new, eos_token_ids)
            self.rewind(row.token_ids + emitted, row.target_kv, row.draft_kv)
            results.append((emitted, len(proposals), num_accepted))
            if k > 0:
                self.num_steps += 1
                self.num_proposed += len(proposals)
                self.num_accepted += num_accepted
            else:
                self.num_plain_steps += 1
        verified_at = self.clock()
        return [StepResult(emitted, num_proposed, num_accepted, proposed_at - started, verified_at - proposed_at)
                for emitted, num_proposed, num_accepted in results]

    def rewind(self, token_ids: list[int], target_kv: KVCache, draft_kv: KVCache | None) -> None:
        """Crop both caches to the transcript ``token_ids`` minus its last token.

        Who calls this: ``step``, and the engine when it drops emitted tokens (a stop string matched).
        """
        target_kv.crop(len(token_ids) - 1)
        if draft_kv is not None:
            draft_kv.crop(len(self.text_ids(token_ids)) - 1)

    def plain_step(self, token_ids: list[int], target_kv: KVCache, adapter_slot: int = 0) -> torch.Tensor:
        """One ordinary decode step (the fallback): feeds the last token, returns its logits [V]."""
        target_kv.crop(len(token_ids) - 1)
        self.num_plain_steps += 1
        return self.target.decode([target_kv], [token_ids[-1]], [adapter_slot])[0]

    def decode_greedy(self, token_ids: list[int], target_kv: KVCache, draft_kv: KVCache | None, max_new: int,
                      controller: SpeculationController, eos_token_ids: tuple[int, ...] = (),
                      adapter_slot: int = 0) -> list[int]:
        """Greedy-decode one sequence to EOS or ``max_new`` tokens, speculating while it pays.

        ``token_ids`` ends with the token sampled from the prompt's prefill (not yet in target_kv); it is
        extended in place, and the new tokens after it are returned. Who calls this: benchmarks and tests
        (the engine interleaves ``step`` / its batched plain decode with other sessions instead).
        """
        start = len(token_ids)
        while len(token_ids) - start < max_new and token_ids[-1] not in eos_token_ids:
            remaining = max_new - (len(token_ids) - start)
            if controller.should_speculate():
                result = self.step(token_ids, target_kv, draft_kv, controller.k, max_new=remaining,
                                   eos_token_ids=eos_token_ids, adapter_slot=adapter_slot)
                controller.observe(result.num_proposed, result.num_accepted, result.draft_s, result.verify_s)
                token_ids.extend(result.token_ids)
            else:
                began = self.clock()
                token_ids.append(int(self.plain_step(token_ids, target_kv, adapter_slot).argmax()))
                controller.observe_plain(self.clock() - began)
        return token_ids[start:]

    def _lacking(self, token_ids: list[int], draft_kv: KVCache) -> list[int]:
        """The transcript's text tokens the draft's cache lacks, its last token included (the cache is
        cropped first: it never holds the last token, nor proposals the target rejected)."""
        text = self.text_ids(token_ids)
        draft_kv.crop(len(text) - 1)
        return text[draft_kv.length:]

    def _catch_up(self, rows: list[SpecRow]) -> None:
        """Feed the drafts of rows far behind (plain steps since their last pass) all their text but the
        last token, in one batched pass, before the step's clock starts: the step's draft_s is then what
        a step costs while speculating, and the catch-up is the price of the plain steps before it. A
        pass, not ``sync_draft``'s prefill: a short prefill costs ~1 ms in bfloat16 on CPU (the Python
        layer), the batched pass ~0.02 ms a token on a small draft."""
        behind, missing = [], []
        for row in rows:
            lacking = self._lacking(row.token_ids, row.draft_kv)
            if len(lacking) - 1 > CATCH_UP_IN_STEP:
                behind.append(row.draft_kv)
                missing.append(lacking[:-1])
        if behind:
            self.draft.extend(behind, missing)
            self.num_draft_synced_tokens += sum(map(len, missing))

    def _propose_draft(self, rows: list[SpecRow], ks: list[int],
                       eos_token_ids: tuple[int, ...]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[b] draft proposals per row: greedy argmax, or draws from the warped draft distribution q.

        Returns per row (proposals, q [len(proposals), V] or None when greedy). The first pass (one
        ``extend`` over all proposing rows) feeds each row every text token its draft cache lacks:
        usually just the last one; two after a step that accepted all proposals (the draft never fed its
        own k-th proposal); more after plain steps. Then one batched ``decode`` per further proposal over
        the rows still proposing; a row stops at its k or after an EOS proposal (nothing after it could
        be emitted).
        """
        proposals: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = [b for b, k in enumerate(ks) if k > 0]
        if active:
            fed = []
            for b in active:
                fed.append(self._lacking(rows[b].token_ids, rows[b].draft_kv))
            logits = self.draft.extend([rows[b].draft_kv for b in active], fed)
            logits = logits[torch.arange(len(active)), torch.tensor([len(f) - 1 for f in fed])]  # [A, V]
        while active:
            tokens = self._draw_proposals([rows[b] for b in active], logits, [probs[b] for b in active])
            still = []
            for b, token in zip(active, tokens):
                proposals[b].append(token)
                if len(proposals[b]) < ks[b] and token not in eos_token_ids:
                    still.append(b)
            if still:
                logits = self.draft.decode([rows[b].draft_kv for b in still], [proposals[b][-1] for b in still])
            active = still
        return [(p, torch.stack(q) if q else None) for p, q in zip(proposals, probs)]

    @staticmethod
    def _draw_proposals(rows: list[SpecRow], logits: torch.Tensor, probs: list[list[torch.Tensor]]) -> list[int]:
        """One proposal per row from logits [A, V]; a sampling row also records its q in ``probs``."""
        tokens = logits.argmax(dim=-1).tolist()  # one host sync for the greedy rows
        for a, row in enumerate(rows):
            if row.sampling is not None and not row.sampling.greedy:
                q = warp_probs(logits[a], row.sampling.temperature, row.sampling.top_p)  # [V]
                tokens[a] = int(torch.multinomial(q, 1, generator=row.generator)[0])
                probs[a].append(q)
        return tokens


def _sampling_accept(proposals: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                     sampling: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """sampling_accept on the warped distributions. target_logits: [k+1, V]."""
    target_probs = warp_probs(target_logits, sampling.temperature, sampling.top_p)  # [k+1, V]
    if draft_probs is None:  # prompt lookup proposes deterministically: q is one-hot
        draft_probs = torch.zeros_like(target_probs[:-1])  # [k, V]
        draft_probs[torch.arange(len(proposals)), torch.tensor(proposals, dtype=torch.long)] = 1.0
    return sampling_accept(proposals, draft_probs, target_probs, generator)


def _cut(token_ids: list[int], max_new: int | None, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Keep tokens up to and including the first EOS, and at most max_new of them."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            token_ids = token_ids[: i + 1]
            break
    return token_ids if max_new is None else token_ids[:max_new]
