"""When speculation pays, and how many tokens to propose: measured costs and acceptance, per sequence.

Who calls this: the engine's executor, once per step, for each row that may speculate
(``batch_should_speculate``), and after the step with what it cost (``observe``, ``observe_plain``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from session.errors import ConfigError

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
    plain steps, at most ``probe_interval`` (a cheap draft falls back only for short stretches of text
    it mispredicts). A try that still does not pay doubles the wait before the next (``probe_backoff``,
    up to ``max_probe_backoff``), so where a pair does not pay at all the tries cost little
    (docs/MEASUREMENTS.md, "Speculation probes").

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

    def observe(self, num_proposed: int, num_accepted: int, draft_s: float, verify_s: float,
                timed: bool = True) -> None:
        """Called after a speculative step with what it proposed, accepted and cost (the batch's costs).
        ``timed`` False: the step's pass also did other work (a verify that fed prompt chunks), so its
        acceptance counts and its costs do not."""
        # a try against the odds: a speculative step after plain ones, taken while speculation did not pay
        probe = self.num_plain_since_probe > 0 and self.plain_step_s is not None and self.speedup() < self.min_speedup
        self.num_plain_since_probe = 0
        if num_proposed == 0:  # prompt lookup found nothing: it was a plain step in disguise
            if timed:
                self.observe_plain(verify_s)
            else:
                self.num_plain_since_probe += 1
            return
        w = self.smoothing
        if timed:
            rate, steps = self.delivered.get(self.batch_size, (0.0, 0))
            step_rate = (num_accepted + 1) / max(draft_s + verify_s, 1e-9)  # this row's tokens per second
            self.delivered[self.batch_size] = (step_rate if steps == 0 else rate + w * (step_rate - rate), steps + 1)
            self.costs.observe_speculative(num_proposed, draft_s, verify_s, self.batch_size)
        tested = num_accepted + (num_accepted < num_proposed)
        self.num_successes += w * (num_accepted - self.num_successes)
        self.num_trials += w * (tested - self.num_trials)
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
