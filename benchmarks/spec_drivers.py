"""One-sequence drivers of the speculative decoder, for benchmarks and tests.

The engine never steps one sequence on its own: it batches every row through
``SpeculativeDecoder.step_batch`` and decodes plainly through the runner. These loops drive one
sequence the way a benchmark or an equivalence test wants to: a step, a plain step, a whole answer.
"""

from __future__ import annotations

import torch

from session.model.kv_cache import KVCache
from session.speculative.controller import SpeculationController
from session.speculative.decoder import SpecRow, SpeculativeDecoder, StepResult
from session.types import SamplingParams


def step(decoder: SpeculativeDecoder, token_ids: list[int], target_kv: KVCache, draft_kv: KVCache | None, k: int,
         *, max_new: int | None = None, eos_token_ids: tuple[int, ...] = (), sampling: SamplingParams | None = None,
         generator: torch.Generator | None = None, adapter_slot: int = 0) -> StepResult:
    """One speculative step for one sequence: ``step_batch`` with one row (see there and ``SpecRow``)."""
    row = SpecRow(token_ids, target_kv, draft_kv, k, max_new=max_new, sampling=sampling, generator=generator,
                  adapter_slot=adapter_slot)
    return decoder.step_batch([row], eos_token_ids)[0]


def plain_step(decoder: SpeculativeDecoder, token_ids: list[int], target_kv: KVCache,
               adapter_slot: int = 0) -> torch.Tensor:
    """One ordinary decode step (the fallback): feeds the last token, returns its logits [V]."""
    target_kv.crop(len(token_ids) - 1)
    decoder.num_plain_steps += 1
    return decoder.target.decode([target_kv], [token_ids[-1]], [adapter_slot])[0]


def decode_greedy(decoder: SpeculativeDecoder, token_ids: list[int], target_kv: KVCache, draft_kv: KVCache | None,
                  max_new: int, controller: SpeculationController, eos_token_ids: tuple[int, ...] = (),
                  adapter_slot: int = 0) -> list[int]:
    """Greedy-decode one sequence to EOS or ``max_new`` tokens, speculating while it pays.

    ``token_ids`` ends with the token sampled from the prompt's prefill (not yet in target_kv); it is
    extended in place, and the new tokens after it are returned.
    """
    start = len(token_ids)
    while len(token_ids) - start < max_new and token_ids[-1] not in eos_token_ids:
        remaining = max_new - (len(token_ids) - start)
        if controller.should_speculate():
            result = step(decoder, token_ids, target_kv, draft_kv, controller.k, max_new=remaining,
                          eos_token_ids=eos_token_ids, adapter_slot=adapter_slot)
            controller.observe(result.num_proposed, result.num_accepted, result.draft_s, result.verify_s)
            token_ids.extend(result.token_ids)
        else:
            began = decoder.clock()
            token_ids.append(int(plain_step(decoder, token_ids, target_kv, adapter_slot).argmax()))
            controller.observe_plain(decoder.clock() - began)
    return token_ids[start:]
