"""The maths of speculative decoding: which proposals to keep, and what prompt lookup proposes.

Exactness. Greedy: a proposal is kept only where it equals the target's argmax, and the token
after the kept prefix is the target's argmax, so the output is token for token what the target
alone produces. Sampling: the rejection rule of Leviathan et al. / Chen et al. (2023) makes each
emitted token distributed exactly as the target's (after the same temperature / top-p warping).

Pure functions over token lists and probability tensors; no model, no cache.
"""

from __future__ import annotations

import torch

from session.model.sampling import warp_probs
from session.types import SamplingParams

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


def sampling_accept_logits(proposals: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                     sampling: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """``sampling_accept`` on the warped distributions. target_logits: [k+1, V]; draft_probs None: the
    proposals came from prompt lookup (a one-hot q)."""
    target_probs = warp_probs(target_logits, sampling.temperature, sampling.top_p)  # [k+1, V]
    if draft_probs is None:  # prompt lookup proposes deterministically: q is one-hot
        draft_probs = torch.zeros_like(target_probs[:-1])  # [k, V]
        draft_probs[torch.arange(len(proposals)), torch.tensor(proposals, dtype=torch.long)] = 1.0
    return sampling_accept(proposals, draft_probs, target_probs, generator)


def cut(token_ids: list[int], max_new: int | None, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Keep tokens up to and including the first EOS, and at most max_new of them."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            token_ids = token_ids[: i + 1]
            break
    return token_ids if max_new is None else token_ids[:max_new]
