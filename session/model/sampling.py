"""Choosing the next token: greedy, or temperature + top-p with a per-request seed."""

from __future__ import annotations

import torch

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


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] -> one token id per row. One host sync for the whole batch."""
    greedy = logits.argmax(dim=-1)  # [B]
    if all(p.greedy for p in params):
        return greedy.tolist()
    chosen = greedy.clone()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            chosen[row] = sample_one(logits[row], p.temperature, p.top_p, gen)
    return chosen.tolist()


def sample_one(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits: [V] -> one token drawn from ``warp_probs``."""
    return torch.multinomial(warp_probs(logits, temperature, top_p), 1, generator=generator)[0]


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
