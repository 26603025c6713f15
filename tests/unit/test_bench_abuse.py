"""benchmarks.abuse_load's arithmetic: the victim's gaps (the first from sending the request), the
phase's and the attack window's numbers, the attackers' rows, and the huge prompt's size."""

import json
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.abuse_load import (
    AttackResult,
    VictimTurn,
    attack_body,
    attack_failed,
    attack_summary,
    attack_window,
    turn_gaps,
    victim_summary,
    words_text,
)
from benchmarks.load import server_env

TURNS = [VictimTurn(sent_s=0.0, chunk_s=[0.25, 0.5, 1.5, 1.75], status=200),
         VictimTurn(sent_s=2.0, chunk_s=[2.5, 2.625], status=200),
         VictimTurn(sent_s=3.0, status=500, error="internal_error")]


def test_a_turns_gaps_start_from_sending_the_request():
    assert turn_gaps(TURNS[0]) == [0.25, 0.25, 1.0, 0.25]
    assert turn_gaps(TURNS[1]) == [0.5, 0.125]
    assert turn_gaps(TURNS[2]) == []


def test_the_victim_summary_covers_every_chunk_and_counts_failed_turns():
    summary = victim_summary(TURNS)
    assert summary["num_turns"] == 3 and summary["num_failed"] == 1 and summary["num_chunks"] == 6
    assert summary["longest_gap_s"] == 1.0 and summary["longest_gap_at_s"] == 1.5
    assert summary["p50_gap_s"] == 0.25  # of 0.125 0.25 0.25 0.25 0.5 1.0
    assert summary["p99_gap_s"] == pytest.approx(0.5 + 0.95 * 0.5, rel=1e-12)
    assert summary["longest_first_chunk_s"] == 0.5
    assert summary["chunks_per_s"] == 6 / 2.375  # the gaps cover 1.75 s of the first turn and 0.625 s of the second
    assert "window" not in summary


def test_the_window_keeps_the_gaps_that_overlap_it():
    window = victim_summary(TURNS, window=(1.0, 2.5))["window"]
    # 0.5->1.5, 1.5->1.75 and 2.0->2.5 overlap (1.0, 2.5); 0.25->0.5 ends before it, 2.5->2.625 starts at its end
    assert window["num_chunks"] == 3 and window["start_s"] == 1.0 and window["end_s"] == 2.5
    assert window["longest_gap_s"] == 1.0 and window["longest_gap_at_s"] == 1.5 and window["p50_gap_s"] == 0.5
    assert window["chunks_per_s"] == 3 / 1.75


def test_attackers_are_grouped_by_answer_and_a_5xx_or_no_answer_fails():
    results = [AttackResult(400, "invalid_request_error", 0.5, 0.25, "too long"),
               AttackResult(400, "invalid_request_error", 0.5, 0.75, "too long"),
               AttackResult(400, "invalid_request_error", 1.0, 0.5, "too long"),
               AttackResult(503, "service_unavailable", 1.0, 2.0), AttackResult(0, "timed out", 1.5, 1.0)]
    assert attack_summary(results) == [
        {"status": 0, "error_type": "timed out", "n": 1, "p50_answer_s": 1.0, "max_answer_s": 1.0, "message": ""},
        {"status": 400, "error_type": "invalid_request_error", "n": 3, "p50_answer_s": 0.5, "max_answer_s": 0.75,
         "message": "too long"},
        {"status": 503, "error_type": "service_unavailable", "n": 1, "p50_answer_s": 2.0, "max_answer_s": 2.0,
         "message": ""}]
    assert [attack_failed(r) for r in results] == [False, False, False, True, True]
    assert attack_window(results) == (0.5, 3.0) and attack_window([]) is None


def test_the_huge_prompt_has_exactly_the_characters_asked_for_and_fits_the_request_limit():
    assert words_text(12) == "the quick br" and len(words_text(1000)) == 1000
    body = attack_body(6_000_000)
    assert len(json.loads(body)["messages"][0]["content"]) == 6_000_000
    assert len(body) == 6_000_065 and len(body) < 6 * 1024 * 1024
    with pytest.raises(ValueError, match="--prompt-chars"):
        attack_body(6_291_456)


def test_the_abuse_server_keeps_the_default_limits():
    args = Namespace(abuse=True, budget_bytes=1, host_budget_bytes=1)
    assert server_env(args, Path("/run")) == {"RESIDENT_JOURNAL_DIR": "/run/journal"}
