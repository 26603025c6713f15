"""The CPU thread count, chosen by measuring decode steps while serving.

On a CPU a decode step reads every weight once, and one core cannot draw the memory bandwidth that
all of them can: on a quiet 2-core machine two threads decode faster than one. But when another
process keeps a core busy (the TorchServe frontend, the clients, a neighbour), OpenMP's threads wait
for each other at every barrier and two threads collapse (docs/MEASUREMENTS.md, "Thread count"). Neither
count is right everywhere, and the load changes while a server runs, so the engine measures instead
of guessing.

``ThreadTuner`` keeps, for each batch-size bucket, a recent decode-step time per candidate count. It
runs the fastest (the figure of the count in use follows every step, so a count that slows down is
left at once), and re-measures each other candidate for a few steps once its figure is older than its
refresh interval: ``refresh_steps`` steps of that bucket, doubled (up to ``max_refresh_steps``) each
time a re-measure finds it still slower, so a steady machine pays a few slow steps ever more rarely
and a count that became faster is found within the interval. A count above the best is also
re-measured once its figure is ``max_refresh_s`` old: cores coming back (a neighbour or a quota gone)
show in no step of the count in use, and counted in steps alone, a server with sparse traffic stayed
on one thread for over 20 minutes after the CPU quota phase of benchmarks/neighbour.py. A count below
the best needs no clock: cores taken away slow the count in use at once. A re-measure ends at
its first step that is far slower than the best; a new bucket starts from its nearest measured
bucket's verdict (without these two rules, a loaded machine re-tried the slow count in every new
bucket: docs/MEASUREMENTS.md, "Thread count"). The
first step after a switch is not counted (the OpenMP pool resizes), unless it collapsed. Steps with a
prefill are not measured.

A collapse is a step ``collapse_ratio`` times slower than another count's figure: with a core taken
by a neighbour, every OpenMP barrier of a two-thread step waits for the thread that shares that core
to get its time slice, and a 15 ms step took 0.3 to 1 s (benchmarks/neighbour.py). Such a step is
believed at once: the count in use is left after one step (not after the running figure catches up,
which cost seconds per request), a re-measure ends at its first step even when that is the one after
the switch (a pool resize costs about 1.1x, not 4x), and the collapsed count is re-measured again soon
(``first_probe_after`` steps, doubling while it stays slower), so that the count comes back once the
neighbour leaves.

Who calls this: the executor, on the engine loop thread: ``choose`` before a decode step,
``observe`` after it, ``choose_for_prefill`` before a prefill. Nothing here is thread-safe.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from session.model.cpu_quota import usable_cores


def bucket_of(batch: int) -> int:
    """Batch sizes whose steps cost alike share figures: 1, 2-3, 4-7, 8-15, ... (the power of 2 below)."""
    return 1 << (max(1, batch).bit_length() - 1)


def cpu_candidates(ceiling: int = 0) -> tuple[int, ...]:
    """One thread, and every core this process may keep busy (its affinity, capped by its container's
    CPU quota: session/model/cpu_quota.py, and by ``ceiling`` when given: its share beside other
    backends), when there is more than one."""
    cores = min(usable_cores(), ceiling) if ceiling > 0 else usable_cores()
    return (1, cores) if cores > 1 else (1,)


@dataclass
class _Figure:
    seconds: float | None = None  # the candidate's recent step time in this bucket
    age: int = 0  # steps of this bucket since it was last measured
    interval: int = 0  # re-measure once age reaches this
    measured_at: float = 0.0  # the clock when ``seconds`` was last set (re-measured after max_refresh_s)


@dataclass
class _Probe:
    threads: int
    samples: list[float] = field(default_factory=list)


class ThreadTuner:
    def __init__(self, candidates: tuple[int, ...], *, probe_steps: int = 4, refresh_steps: int = 256,
                 max_refresh_steps: int = 2048, first_probe_after: int = 8, abort_ratio: float = 1.5,
                 collapse_ratio: float = 4.0, smoothing: float = 0.1,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 free_cores: Callable[[], float] | None = None, taken_at: float = 0.75,
                 max_refresh_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.candidates = tuple(sorted(set(candidates)))
        self.probe_steps = probe_steps  # measured steps per probe (after the discarded first)
        self.refresh_steps = refresh_steps
        self.max_refresh_steps = max_refresh_steps
        self.first_probe_after = first_probe_after  # steps before the first measure of another count
        self.abort_ratio = abort_ratio  # a probe step this much slower than the best ends the probe
        self.collapse_ratio = collapse_ratio  # a step this much slower than the best: believed at once
        self._prior: dict[int, int] = {}  # bucket -> the count its nearest measured bucket found best
        self.smoothing = smoothing  # weight of a new step in the running figure of the count in use
        self._set_threads = set_threads
        self._free_cores = free_cores  # cores other processes leave (session/model/cpu_load.py)
        self.taken_at = taken_at  # a core busy elsewhere this much of the time is not ours to use
        self.max_refresh_s = max_refresh_s  # a figure this old is re-measured, however few steps ran
        self._clock = clock
        self._figures: dict[int, dict[int, _Figure]] = {}
        self._probes: dict[int, _Probe] = {}  # bucket -> the candidate being re-measured there
        self._discard_next = False
        self.threads = self.candidates[-1]  # all cores first: faster on a quiet machine (module docstring)
        self._last_bucket = 1  # the bucket of the last decode step
        self.num_switches = 0
        set_threads(self.threads)

    def choose_for_prefill(self) -> int:
        """Before a prefill: the count the last decode steps found best, never a re-measure's (a prompt
        fed on the slower count while decode steps probe it stalls every stream in its step). Sets and
        returns it; the next decode step's time is not counted if it switched."""
        bucket = self._last_bucket
        threads = self._best(bucket) if bucket in self._figures else self.threads
        threads = min(threads, self._allowed())
        if threads != self.threads:
            self._set_threads(threads)
            self.threads, self._discard_next = threads, True
            self.num_switches += 1
        return threads

    def choose(self, batch: int) -> int:
        """Before a decode step of ``batch`` rows: sets (and returns) the thread count to run it with."""
        bucket = self._last_bucket = bucket_of(batch)
        figures = self._figures.get(bucket) or self._new_bucket(bucket)
        allowed = self._allowed()
        best = min(self._best(bucket), allowed)
        if bucket in self._probes and self._probes[bucket].threads > allowed:
            del self._probes[bucket]  # a neighbour took the cores it would measure
        if bucket not in self._probes:
            now = self._clock()
            stale = [c for c in self.candidates if c != best and c <= allowed and self._stale(c, best, figures[c], now)]
            if stale:
                self._probes[bucket] = _Probe(stale[0])
        probe = self._probes.get(bucket)
        threads = probe.threads if probe else best
        if threads != self.threads:
            self._set_threads(threads)
            self.threads, self._discard_next = threads, True
            self.num_switches += 1
        return threads

    def _stale(self, candidate: int, best: int, figure: _Figure, now: float) -> bool:
        return figure.age >= figure.interval or (
            candidate > best and figure.seconds is not None and now - figure.measured_at >= self.max_refresh_s)

    def _allowed(self) -> int:
        """The most threads the cores other processes leave allow (every candidate without a reader):
        ``taken_at`` of a core busy elsewhere counts as the whole core, on which a thread of ours would
        wait for time slices at every barrier."""
        if self._free_cores is None:
            return self.candidates[-1]
        free = self._free_cores() + self.taken_at
        return max([c for c in self.candidates if c <= free], default=self.candidates[0])

    def _new_bucket(self, bucket: int) -> dict[int, _Figure]:
        """A batch size not seen yet starts from the nearest measured bucket's verdict: its best count runs
        at once, the others are measured after the interval that bucket had for them (so a count found far
        slower at batch 1 is not re-tried at once at 2, 4, 8 and 16: that cost seconds on a loaded machine)."""
        measured = [b for b in self._figures if any(f.seconds is not None for f in self._figures[b].values())]
        figures = {c: _Figure(interval=self.first_probe_after) for c in self.candidates}
        self._figures[bucket] = figures
        if measured:
            near = min(measured, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
            for candidate, figure in figures.items():
                figure.interval = self._figures[near][candidate].interval
            self._prior[bucket] = self._best(near)
        return figures

    def _best(self, bucket: int) -> int:
        """The count with the best figure in ``bucket``; before any, the prior (or the count in use)."""
        figures = self._figures[bucket]
        known = {c: seconds for c in self.candidates if (seconds := figures[c].seconds) is not None}
        if not known:
            return self._prior.get(bucket, self.threads)
        return min(known, key=known.__getitem__)

    def observe(self, batch: int, seconds: float) -> None:
        """After the step ``choose`` prepared: its wall time."""
        bucket = bucket_of(batch)
        figures = self._figures[bucket]
        for candidate, figure in figures.items():
            figure.age += candidate != self.threads
        figure = figures[self.threads]
        others = [f.seconds for c, f in figures.items() if c != self.threads and f.seconds is not None]
        collapsed = bool(others) and seconds > self.collapse_ratio * min(others)
        discard, self._discard_next = self._discard_next, False
        if discard and not collapsed:
            return
        probe = self._probes.get(bucket)
        if probe is not None and probe.threads == self.threads:
            probe.samples.append(seconds)
            far_slower = bool(others) and seconds > self.abort_ratio * min(others)  # no need to see more
            if len(probe.samples) >= self.probe_steps or far_slower:
                figure.seconds, figure.age, figure.measured_at = statistics.median(probe.samples), 0, self._clock()
                still_slower = bool(others) and figure.seconds > min(others)
                figure.interval = min(2 * figure.interval, self.max_refresh_steps) if still_slower \
                    else self.refresh_steps
                del self._probes[bucket]
            return
        figure.age, figure.measured_at = 0, self._clock()
        if collapsed:  # left at the next step; re-measured soon, in case it was a passing stall
            figure.seconds, figure.interval = seconds, self.first_probe_after
            return
        figure.seconds = seconds if figure.seconds is None else (
            (1 - self.smoothing) * figure.seconds + self.smoothing * seconds)

    def figures(self) -> dict[int, dict[int, float | None]]:
        """bucket -> thread count -> its recent step seconds (for logs and tests)."""
        return {b: {c: f.seconds for c, f in figs.items()} for b, figs in self._figures.items()}


@contextmanager
def one_thread_here() -> Iterator[None]:
    """Torch operators run inside on the calling thread alone, and its thread count is restored after.

    ``ComputeThread`` keeps the engine's OpenMP team the process's only one, but threads outside the
    engine run torch operators too: request images are preprocessed on the caller's thread (the
    handler's executor threads). A thread's first parallel operator gives it a team of its own, which
    lives as long as the thread, and from then on GNU OpenMP stops spinning between the engine's
    parallel regions (its threads outnumber the cores). Today's processors (LLaVA, LLaVA-NeXT,
    Qwen2-VL, Qwen2.5-VL; checked) start none; this keeps it so for any processor (a second team
    slowed decode ~1.5x: docs/MEASUREMENTS.md, "One OpenMP team"). With one thread (OpenMP's count is per thread,
    and torch reads the calling thread's) such operators start no team. Who calls this:
    ``Engine.preprocess_images``.
    """
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class ComputeThread:
    """The one OS thread that runs every torch operator of an engine: loading the model, then the loop.

    OpenMP keeps a team of worker threads for each thread that runs parallel regions, and GNU OpenMP
    stops spinning between regions once its threads outnumber the cores: with a model loaded on the
    caller's thread and decoded on the loop thread, a 2-thread decode step on a 2-core machine ran
    markedly slower (docs/MEASUREMENTS.md, "One OpenMP team"). Running both on this thread keeps one team.
    Who calls this: ``Engine`` (construction, start, stop), from the caller's thread. Work runs in the
    order posted; once the engine loop is posted, later work waits for the loop to end.
    """

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (function, future); None ends the thread
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            function, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function())
                except BaseException as exc:  # handed to the caller, raised there
                    future.set_exception(exc)

    def post(self, function: Callable[[], object]) -> Future:
        """Run ``function`` on the thread after what was posted before; its Future holds the outcome."""
        future: Future = Future()
        self._calls.put((function, future))
        return future

    def call(self, function: Callable[[], object]):
        """Run ``function`` on the thread and return its result (or raise its exception) here."""
        if threading.current_thread() is self._thread:
            return function()
        return self.post(function).result()

    def close(self, timeout: float) -> None:
        """End the thread once what was posted has run (waits up to ``timeout`` seconds)."""
        self._calls.put(None)
        self._thread.join(timeout)
