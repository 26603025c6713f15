"""Choosing the next token: greedy, or temperature + top-p with a per-request seed. A row that cannot
be sampled (non-finite logits) fails alone: ``sample_rows`` returns its error in place of its token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from session.errors import ResidentError
from session.model.grammar import apply_masks, fill_masks
from session.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher


def ban_token(logits: torch.Tensor, token_id: int | None) -> torch.Tensor:
    """logits [..., V] with ``token_id`` made impossible (None: unchanged). The engine and the
    speculative verify ban the image placeholder: a generated one would read as an image position on
    the next turn (and break the recount on a recompute)."""
    if token_id is None:
        return logits
    return logits.index_fill(-1, torch.tensor([token_id], device=logits.device), float("-inf"))


def make_generator(params: SamplingParams, default_seed: int, device: torch.device) -> torch.Generator | None:
    """Greedy requests need no generator; sampled ones get their own, so batching cannot change them."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else default_seed)
    return generator


NOT_FINITE = ("the model's output for this request is not finite (NaN or Inf logits), so no next token "
              "could be sampled")


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int | ResidentError]:
    """logits: [B, V] -> one token id per row, or the error that row's request fails with (500): its
    logits hold NaN or +Inf (or only -Inf), or drawing from them raised. Only that row fails; the
    others get the tokens they would get alone. One host sync for the whole batch."""
    peak, chosen = logits.max(dim=-1)  # [B] each: max propagates NaN; the index is the first maximum's
    usable = torch.isfinite(peak)  # [B]
    failures: dict[int, ResidentError] = {}  # row -> what drawing its token raised
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            try:
                chosen[row], valid = draw(logits[row], p.temperature, p.top_p, gen, p.top_k)
                usable[row] &= valid
            except Exception as exc:
                usable[row] = False
                failures[row] = ResidentError(f"sampling this request's next token failed: {exc}")
                failures[row].__cause__ = exc
    tokens = torch.where(usable, chosen, -1).tolist()
    return [token if token >= 0 else failures.get(row) or ResidentError(NOT_FINITE)
            for row, token in enumerate(tokens)]


def draw(logits: torch.Tensor, temperature: float, top_p: float,
         generator: torch.Generator | None, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [V] -> (one token drawn from ``warp_probs``, whether that is a distribution), with no host
    sync. Where it is not one (non-finite logits, or logits / T overflowed) the draw is from uniform
    weights instead, and its token is not used: on CUDA ``multinomial`` would assert on the device."""
    probs = warp_probs(logits, temperature, top_p, top_k)
    total = probs.sum()
    valid = torch.isfinite(total) & (total > 0)  # a NaN or Inf anywhere in probs reaches its sum
    return torch.multinomial(torch.where(valid, probs, 1.0), 1, generator=generator)[0], valid


def sample_one(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits: [V] -> one token drawn from ``warp_probs`` (``draw``'s token)."""
    return draw(logits, temperature, top_p, generator)[0]


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """logits [..., V] -> the distribution sampling draws from: the ``top_k`` likeliest tokens (0: all),
    softmax at ``temperature``, then nucleus filtering (keep a token if the mass before it is < top_p,
    so the top token always stays), renormalised. Speculative sampling compares these p(x) and q(x),
    so both sum to one.
    """
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# ---------------------------------------------------------------- logits processors


@dataclass
class RowContext:
    """What a row's logits processors read (``process_logits``)."""

    params: SamplingParams
    answer: Sequence[int]  # the tokens generated so far in this answer
    transcript: Sequence[int]  # every token of the context before this step (repetition_penalty)
    matcher: LLMatcher | None = None  # the row's grammar matcher (session.model.grammar), or None


def process_logits(logits: torch.Tensor, rows: list[RowContext], eos_token_ids: Sequence[int],
                   pin: bool = False) -> torch.Tensor:
    """logits [B, V] -> the logits each row samples from (out of place; ``logits`` when no row changes
    them): logit_bias added, then repetition, presence and frequency penalties, EOS banned below
    min_tokens or with ignore_eos, then the grammar's mask. The order is vLLM's and transformers'."""
    changed = [i for i, row in enumerate(rows) if row.params.processed]
    if not changed:
        return logits
    logits = logits.clone()
    for i in changed:
        _process_row(logits[i], rows[i], eos_token_ids)
    grammars = [(i, matcher) for i in changed if (matcher := rows[i].matcher) is not None]
    if grammars:
        constrained = [i for i, _ in grammars]
        masks = fill_masks([matcher for _, matcher in grammars], logits.shape[-1], pin=pin)
        logits = apply_masks(logits, constrained, masks)
    return logits


def _process_row(logits: torch.Tensor, row: RowContext, eos_token_ids: Sequence[int]) -> None:
    """logits [V] of one row, changed in place (not the grammar: ``process_logits`` masks rows together)."""
    params, device = row.params, logits.device
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        logits.index_add_(0, torch.tensor(ids, device=device), torch.tensor(biases, device=device,
                                                                              dtype=logits.dtype))
    if params.repetition_penalty != 1.0 and (row.transcript or row.answer):
        seen = torch.tensor(sorted(set(row.transcript) | set(row.answer)), device=device)
        scores = logits.index_select(0, seen)
        penalty = params.repetition_penalty
        logits.index_copy_(0, seen, torch.where(scores > 0, scores / penalty, scores * penalty))
    if (params.presence_penalty or params.frequency_penalty) and row.answer:
        ids, counts = torch.tensor(list(row.answer), device=device).unique(return_counts=True)
        logits.index_add_(0, ids, -(params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty))
    if params.ignore_eos or len(row.answer) < params.min_tokens:
        logits.index_fill_(0, torch.tensor(list(eos_token_ids), device=device, dtype=torch.long), float("-inf"))


def row_logprobs(logits: torch.Tensor, tokens: list, wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Each row's chosen token's log-probability under ``logits`` [B, V] (the model's, before any
    processor or temperature: vLLM's default) and its ``wanted[b]`` likeliest; None for rows that asked
    none or failed. One host sync for all the rows that asked."""
    rows = [b for b, (k, token) in enumerate(zip(wanted, tokens)) if k is not None and isinstance(token, int)]
    if not rows:
        return [None] * len(tokens)
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
    chosen = logp.gather(1, torch.tensor([[tokens[b]] for b in rows], device=logits.device))[:, 0]
    most = max(wanted[b] or 0 for b in rows)  # each row's is set (``rows``)
    top = logp.topk(most, dim=-1) if most else None
    chosen_list = chosen.tolist()
    top_values = top.values.tolist() if top is not None else [[] for _ in rows]
    top_ids = top.indices.tolist() if top is not None else [[] for _ in rows]
    out: list[TokenLogprob | None] = [None] * len(tokens)
    for r, b in enumerate(rows):
        k = wanted[b]
        out[b] = TokenLogprob(token_id=tokens[b], logprob=chosen_list[r],
                              top=tuple(zip(top_ids[r][:k], top_values[r][:k])))
    return out
