"""The engine's metrics snapshot. Built by the loop thread after every step (``snapshot``) and read
by any thread (the handler's metrics, tests) without touching the engine's live dicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from session.state.session import Tier


@dataclass(frozen=True)
class EngineStats:
    """Counters are cumulative since start-up."""

    live_sessions: int
    sessions_by_tier: dict[str, int]  # tier -> sessions
    # "device" (KV held, a shared block once), "host" (KV copies), "embeddings" (host), "journal" (disk/shm);
    # paged KV by kind: "kv_pinned" (one holder), "kv_shared" (several), "kv_cached" (idle, evicted first)
    resident_bytes: dict[str, int]
    device_budget_bytes: int  # 0: unlimited
    running_requests: int  # in flight: waiting for prefill or decoding
    events: dict[str, int]  # event -> count
    tokens: dict[str, int]  # "generated", "prefilled", "cached" -> count
    speculation: dict[str, int]  # target_passes, proposed, accepted (speculative steps) -> count
    requests: dict[str, int]  # "cancelled", "failed", "overloaded", "invariant_violations" -> count
    not_recoverable_sessions: int  # live sessions whose journal entry could not be written


def snapshot(engine) -> EngineStats:
    """Called by the engine loop thread only (it owns what is read here)."""
    by_tier = {tier.value: 0 for tier in Tier}
    host = not_recoverable = 0
    parts = engine.parts
    for session in parts.store.all_sessions():  # one pass: this runs after every step
        host += session.host_bytes
        if not session.ephemeral:
            by_tier[session.tier.value] += 1
            not_recoverable += not session.recoverable
    memory, store, embeddings, sessions, journal = parts.memory, parts.store, parts.embeddings, parts.sessions, parts.journal
    overloaded = engine.num_overloaded + engine.num_queue_full
    return EngineStats(
        live_sessions=sum(by_tier.values()), sessions_by_tier=by_tier,
        resident_bytes={"device": memory.device_bytes, "host": host, "embeddings": embeddings.nbytes,
                        "journal": journal.nbytes if journal is not None else 0, **_kv_kinds(memory.blocks)},
        device_budget_bytes=memory.device_budget_bytes, running_requests=len(parts.scheduler.active),
        events={"opened": store.num_opened, "closed": store.num_closed, "expired": store.num_expired,
                "demoted_to_host": memory.num_to_host, "dropped": memory.num_dropped,
                "restored_from_host": memory.num_restored_from_host, "recomputed": memory.num_recomputed,
                "restored_from_journal": sessions.num_journal_restored, "embedding_hits": embeddings.num_hits,
                "embedding_misses": embeddings.num_misses, "embedding_evictions": embeddings.num_evictions,
                "overloaded": overloaded, "journal_write_errors": sessions.num_journal_write_errors,
                "oom_retries": engine.num_oom_retries, "oom_failures": engine.num_oom_failures,
                "steps_run_apart": engine.num_steps_run_apart,
                "prefill_chunks": parts.executor.num_prefill_chunks,
                "prompts_passed_over": parts.scheduler.num_passed_over,
                "prompts_waited_for_kv_room": parts.scheduler.num_waited_for_room,
                "prefills_abandoned": engine.num_abandoned_prefills, "thread_switches": _thread_switches(parts.executor),
                **_prefix_events(memory.blocks)},
        not_recoverable_sessions=not_recoverable,
        tokens={"generated": parts.outputs.num_generated_tokens, "prefilled": parts.executor.num_prefilled_tokens,
                "cached": parts.executor.num_cached_tokens},
        speculation=_speculation(parts.speculator),
        requests={"cancelled": engine.num_cancelled + engine.admission.num_cancelled_queued,
                  "failed": engine.num_failed, "overloaded": overloaded,
                  "invariant_violations": engine.num_invariant_violations},
    )


def _speculation(spec) -> dict[str, int]:
    if spec is None:
        return {}
    return {"target_passes": spec.num_steps, "proposed": spec.num_proposed, "accepted": spec.num_accepted,
            "plain_steps": spec.num_plain_steps}


def _kv_kinds(blocks) -> dict[str, int]:
    if blocks is None:
        return {}
    return {f"kv_{kind}": nbytes for kind, nbytes in blocks.usage_bytes().items()}


def _prefix_events(blocks) -> dict[str, int]:
    """Shared-prefix counters: blocks found by a lookup (prefill skipped), idle blocks evicted."""
    if blocks is None:
        return {}
    counters = blocks.counters()
    return {"prefix_hit_blocks": counters["hit_blocks"], "prefix_evicted_blocks": counters["evicted_blocks"]}


def _thread_switches(executor) -> int:
    """Changes of the CPU thread count (session/model/threads.py): a neighbour arriving or leaving."""
    return 0 if executor.thread_tuner is None else executor.thread_tuner.num_switches
