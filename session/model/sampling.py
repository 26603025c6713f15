"""Choosing the next token: greedy, or temperature + top-p with a per-request seed. A row that cannot
be sampled (non-finite logits) fails alone: ``sample_rows`` returns its error in place of its token."""

from __future__ import annotations

import torch

from session.errors import ResidentError
from session.types import SamplingParams


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
                chosen[row], valid = draw(logits[row], p.temperature, p.top_p, gen)
                usable[row] &= valid
            except Exception as exc:
                usable[row] = False
                failures[row] = ResidentError(f"sampling this request's next token failed: {exc}")
                failures[row].__cause__ = exc
    tokens = torch.where(usable, chosen, -1).tolist()
    return [token if token >= 0 else failures.get(row) or ResidentError(NOT_FINITE)
            for row, token in enumerate(tokens)]


def draw(logits: torch.Tensor, temperature: float, top_p: float,
         generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [V] -> (one token drawn from ``warp_probs``, whether that is a distribution), with no host
    sync. Where it is not one (non-finite logits, or logits / T overflowed) the draw is from uniform
    weights instead, and its token is not used: on CUDA ``multinomial`` would assert on the device."""
    probs = warp_probs(logits, temperature, top_p)
    total = probs.sum()
    valid = torch.isfinite(total) & (total > 0)  # a NaN or Inf anywhere in probs reaches its sum
    return torch.multinomial(torch.where(valid, probs, 1.0), 1, generator=generator)[0], valid


def sample_one(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits: [V] -> one token drawn from ``warp_probs`` (``draw``'s token)."""
    return draw(logits, temperature, top_p, generator)[0]


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [..., V] -> the distribution sampling draws from: softmax at ``temperature``, then
    nucleus filtering (keep a token if the mass before it is < top_p, so the top token always
    stays), renormalised. Speculative sampling compares these p(x) and q(x), so both sum to one.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
