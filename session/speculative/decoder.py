"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one pass.

Plain decoding costs one target forward pass per token. Here a proposer (a small draft model,
or prompt lookup in the session's own transcript) guesses the next k tokens; the target scores
``[last] + proposals`` in ONE pass and keeps the longest prefix it agrees with, plus one token of
its own. Every step therefore yields between 1 and k+1 tokens for one target pass.

Who calls this: the engine's loop thread (one ``SpeculativeDecoder`` per engine, shared by all
sessions). The caller owns every cache: the session holds the target's KV cache and the draft's
KV cache (counted in its bytes), so a follow-up turn prefills only its new tokens in both models.
Between steps the target's cache holds every transcript token but the last (fed next); the draft's
holds a prefix of the text and is caught up by its next pass (see ``SpeculativeDecoder``).

The maths lives in ``acceptance`` (greedy and sampled acceptance, prompt lookup) and the policy in
``controller`` (``SpeculationController`` decides k and when speculation does not pay); the decoder
glues them to the model runners. The decoder steps a batch of
sequences at once: batched draft passes, then ONE target pass (``ModelRunner.extend``) verifies
every row's proposals at its own cache length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from session.errors import ConfigError
from session.model.grammar import apply_masks, fill_masks
from session.model.kv_cache import KVCache
from session.model.prefix_cache import block_keys
from session.model.sampling import ban_token, warp_probs
from session.speculative.acceptance import agreed_prefix, cut, propose_ngram, sampling_accept_logits
from session.types import SamplingParams

if TYPE_CHECKING:  # annotations only
    from llguidance import LLMatcher

    from session.model.runner import ModelRunner

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
    # A greedy row's grammar matcher (llguidance): proposals are drawn and verified under its mask, and
    # it takes the emitted tokens at the end of the step; untouched when the step fails.
    matcher: LLMatcher | None = None


# The target's pass over a verify: (target caches, each row's fed tokens, adapter slots) -> logits [B, T, V]
Verify = Callable[[list[KVCache], list[list[int]], list[int]], torch.Tensor]


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
        self.num_draft_shared_tokens = 0  # text the draft took from published blocks instead of prefilling it
        # Shared KV blocks in the draft's own pool (session/model/prefix_cache.py): block size, 0 = off.
        # Set by the engine's assembly when sharing is on. The draft reads text only and no adapter; its
        # keys are salted as the session's target blocks are (``sync_draft``'s salt), tenants kept apart.
        self.share_block_tokens = 0

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

    def sync_draft(self, token_ids: list[int], draft_kv: KVCache | None, salt: bytes = b"") -> int:
        """Prefill the draft with the text tokens it has not seen, all but the last. Returns how many.

        Who calls this: the engine after a turn's prefill, so the new turn's text is prefilled in the draft
        with the target's (and timed as prefill). Optional: ``step_batch`` feeds whatever the draft lacks anyway.
        ``salt``: the session's block-key salt (``Sessions.salt``), so drafts share blocks within a tenant only.
        """
        draft = self.draft
        if draft_kv is None or draft is None:  # prompt lookup: no draft, no draft cache
            return 0
        keys: list[bytes] = []
        if self.share_block_tokens:
            text = self.text_ids(token_ids)
            keys = block_keys(text, self.share_block_tokens, salt=salt)
            if draft_kv.length == 0:  # new, stateless or dropped: start from the longest published prefix
                draft_kv.release()  # what the turn reserved; the prefill takes what it needs
                self.num_draft_shared_tokens += draft_kv.share_prefix(keys[:(len(text) - 1) // self.share_block_tokens])
        missing = self._lacking(token_ids, draft_kv)[:-1]
        if missing:
            draft.prefill(draft_kv, draft.embed(missing, []))
            self.num_draft_synced_tokens += len(missing)
        if keys:
            draft_kv.publish(keys)
        return len(missing)

    def step_batch(self, rows: list[SpecRow], eos_token_ids: tuple[int, ...] = (),
                   verify: Verify | None = None) -> list[StepResult]:
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
        ``verify``: the target pass, in place of ``target.extend`` (the engine's, packing the rows with a
        step's prefill chunks); same arguments, same logits.
        """
        ks = []
        for row in rows:
            if row.max_new is not None and row.max_new < 1:
                raise ValueError(f"max_new must be >= 1, got {row.max_new}")
            ks.append(row.k if row.max_new is None else min(row.k, row.max_new - 1))  # more could not be emitted
        draft = self.draft
        if draft is not None:
            self._catch_up(draft, [row for row, k in zip(rows, ks) if k > 0])
        started = self.clock()
        if draft is not None:
            proposed = self._propose_draft(draft, rows, ks, eos_token_ids)
        else:
            proposed = [(_grammatical(propose_ngram(self.text_ids(row.token_ids), k, self.max_ngram, self.min_ngram),
                                      row.matcher), None) for row, k in zip(rows, ks)]
        proposed_at = self.clock()
        fed = []
        for row, (proposals, _) in zip(rows, proposed):
            row.target_kv.crop(len(row.token_ids) - 1)
            fed.append(row.token_ids[row.target_kv.length:] + proposals)  # usually [last] + proposals
        logits = (verify or self.target.extend)([row.target_kv for row in rows], fed, [row.adapter_slot for row in rows])
        logits = ban_token(logits, self.target.info.image_token_id)  # as in plain decoding: never a placeholder
        logits = _masked_positions(logits, rows, [p for p, _ in proposed], [len(f) for f in fed])
        greedy_tokens = logits.argmax(dim=-1).tolist()  # [B, T]: one host sync for every greedy row
        results = []
        for b, (row, k, (proposals, draft_probs)) in enumerate(zip(rows, ks, proposed)):
            scored = slice(len(fed[b]) - len(proposals) - 1, len(fed[b]))  # after the last token, then each proposal
            if row.sampling is None or row.sampling.greedy:
                emitted = agreed_prefix(proposals, greedy_tokens[b][scored])
            else:
                emitted = sampling_accept_logits(proposals, draft_probs, logits[b, scored], row.sampling, row.generator)
            num_accepted = len(emitted) - 1
            emitted = cut(emitted, row.max_new, eos_token_ids)
            self.rewind(row.token_ids + emitted, row.target_kv, row.draft_kv)
            results.append((emitted, len(proposals), num_accepted))
            if k > 0:
                self.num_steps += 1
                self.num_proposed += len(proposals)
                self.num_accepted += num_accepted
            else:
                self.num_plain_steps += 1
        for row, (emitted, _, _) in zip(rows, results):  # the step can no longer fail: the grammars advance
            # one by one: llguidance's consume_tokens refuses the EOS after a grammar that stopped by itself
            # (nothing can follow its last token), which consume_token takes, as plain decoding does
            if row.matcher is not None and not all(row.matcher.consume_token(token) for token in emitted):
                raise AssertionError(f"a grammar refused its own masked tokens: {row.matcher.get_error()}")
        verified_at = self.clock()
        return [StepResult(emitted, num_proposed, num_accepted, proposed_at - started, verified_at - proposed_at)
                for emitted, num_proposed, num_accepted in results]

    def rewind(self, token_ids: list[int], target_kv: KVCache, draft_kv: KVCache | None) -> None:
        """Crop both caches to the transcript ``token_ids`` minus its last token.

        Who calls this: ``step_batch``, and the engine when it drops emitted tokens (a stop string matched).
        """
        target_kv.crop(len(token_ids) - 1)
        if draft_kv is not None:
            draft_kv.crop(len(self.text_ids(token_ids)) - 1)

    def _lacking(self, token_ids: list[int], draft_kv: KVCache) -> list[int]:
        """The transcript's text tokens the draft's cache lacks, its last token included (the cache is
        cropped first: it never holds the last token, nor proposals the target rejected)."""
        text = self.text_ids(token_ids)
        draft_kv.crop(len(text) - 1)
        return text[draft_kv.length:]

    def _catch_up(self, draft: ModelRunner, rows: list[SpecRow]) -> None:
        """Feed the drafts of rows far behind (plain steps since their last pass) all their text but the
        last token, in one batched pass, before the step's clock starts: the step's draft_s is then what
        a step costs while speculating, and the catch-up is the price of the plain steps before it. A
        pass, not ``sync_draft``'s prefill: a short prefill runs the Python layer, the batched pass a
        small fraction of its cost per token (docs/MEASUREMENTS.md, "Draft catch-up")."""
        behind: list[KVCache] = []
        missing: list[list[int]] = []
        for row in rows:
            draft_kv = _draft_kv(row)
            lacking = self._lacking(row.token_ids, draft_kv)
            if len(lacking) - 1 > CATCH_UP_IN_STEP:
                behind.append(draft_kv)
                missing.append(lacking[:-1])
        if behind:
            draft.extend(behind, missing)
            self.num_draft_synced_tokens += sum(map(len, missing))

    def _propose_draft(self, draft: ModelRunner, rows: list[SpecRow], ks: list[int],
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
        probes = {b: matcher.deep_copy() for b in active
                  if (matcher := rows[b].matcher) is not None}  # drafts' grammars
        if active:
            fed = []
            for b in active:
                fed.append(self._lacking(rows[b].token_ids, _draft_kv(rows[b])))
            logits = draft.extend([_draft_kv(rows[b]) for b in active], fed)
            logits = logits[torch.arange(len(active)), torch.tensor([len(f) - 1 for f in fed])]  # [A, V]
        while active:
            logits = _masked_rows(logits, [probes.get(b) for b in active])
            tokens = self._draw_proposals([rows[b] for b in active], logits, [probs[b] for b in active])
            still = []
            for b, token in zip(active, tokens):
                proposals[b].append(token)
                if b in probes:
                    probes[b].consume_token(token)
                if len(proposals[b]) < ks[b] and token not in eos_token_ids:
                    still.append(b)
            if still:
                logits = draft.decode([_draft_kv(rows[b]) for b in still], [proposals[b][-1] for b in still])
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


def _draft_kv(row: SpecRow) -> KVCache:
    """The row's draft cache, which every row has when there is a draft (``new_draft_kv``)."""
    if row.draft_kv is None:
        raise ValueError("a row of a step with a draft model needs its draft_kv (SpeculativeDecoder.new_draft_kv)")
    return row.draft_kv


# ---------------------------------------------------------------- grammars


def _grammatical(proposals: list[int], matcher: LLMatcher | None) -> list[int]:
    """Prompt-lookup proposals cut where the row's grammar would refuse one (all of them without one)."""
    return proposals if matcher is None or not proposals else proposals[:matcher.validate_tokens(proposals)]


def _masked_rows(logits: torch.Tensor, matchers: list[LLMatcher | None]) -> torch.Tensor:
    """Draft logits [A, V] with each row that has a grammar (its matcher, else None) masked by it."""
    grammars = [(a, matcher) for a, matcher in enumerate(matchers) if matcher is not None]
    if not grammars:
        return logits
    rows = [a for a, _ in grammars]
    masks = fill_masks([matcher for _, matcher in grammars], logits.shape[-1], pin=logits.is_cuda)
    return apply_masks(logits, rows, masks)


def _masked_positions(logits: torch.Tensor, rows: list[SpecRow], proposals: list[list[int]],
                      fed_lengths: list[int]) -> torch.Tensor:
    """Target logits [B, T, V] with each grammar row's scored positions (after its last token, then after
    each proposal) masked by its grammar at that point: one mask per position, from a copy of the matcher
    that takes the proposals one by one. The argmax under the masks is plain constrained decoding's."""
    constrained = [(b, row.matcher) for b, row in enumerate(rows) if row.matcher is not None]
    if not constrained:
        return logits
    logits = logits.clone()
    for b, matcher in constrained:
        probe, guesses = matcher.deep_copy(), proposals[b]
        positions = []
        for j in range(len(guesses) + 1):
            positions.append(probe.deep_copy())
            if j < len(guesses):
                probe.consume_token(guesses[j])
        scored = slice(fed_lengths[b] - len(guesses) - 1, fed_lengths[b])
        masks = fill_masks(positions, logits.shape[-1], pin=logits.is_cuda)
        logits[b, scored] = apply_masks(logits[b, scored], list(range(len(positions))), masks)
    return logits
