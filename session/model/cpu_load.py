"""How many of this process's cores other processes kept busy lately: the thread tuner's early warning.

The tuner (session/model/threads.py) learns that a neighbour took a core from its own steps, which
costs the steps that collapse first: a prompt fed on two threads beside a busy core took seconds
(benchmarks/neighbour.py). The kernel already counts every core's busy time (``/proc/stat``, one
line per CPU) and this process's own CPU time; the difference, over the wall time between two
readings, is the cores others used, known before any step runs.

A CPU quota set after start-up (``docker update --cpus``, a Kubernetes in-place resize, or
benchmarks/neighbour.py's quota phase) shows in none of these counts: the process is throttled, not
crowded. So each reading also re-reads the cgroup's quota (session/model/cpu_quota.py) and the free
cores never exceed it: under a 1-CPU quota two threads collapsed (a 1.65 s worst request against 1.07
on one thread) each time the tuner re-measured them.

Who calls this: ``ThreadTuner``, on the engine loop thread, at most every ``min_interval_s``. A
reading covers the time since the previous one (an idle engine's first reading after a pause covers
the pause). Read only where the process may use every CPU it can run on (no CPU quota below its
affinity): on a big host under a quota, the busy cores around it are not its cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from session.model.cpu_quota import cgroup_cpu_quota, usable_cores

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)


def busy_seconds(stat_text: str, cpus: set[int], ticks_per_s: float) -> float:
    """CPU seconds the ``cpus`` spent busy since boot, from ``/proc/stat``'s ``cpuN`` lines."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
    return total / ticks_per_s


class BusyElsewhere:
    def __init__(self, cpus: set[int], *, read_stat: Callable[[], str] = lambda: Path("/proc/stat").read_text(),
                 own_seconds: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 ticks_per_s: float = 100.0, min_interval_s: float = 0.25,
                 read_quota: Callable[[], float | None] = cgroup_cpu_quota):
        self.cpus = cpus
        self._read_stat, self._own_seconds, self._clock = read_stat, own_seconds, clock
        self._read_quota = read_quota
        self.quota: float | None = read_quota()  # cores' worth the cgroup allows now (None: no quota)
        self.ticks_per_s = ticks_per_s
        self.min_interval_s = min_interval_s
        self._last = self._reading()
        self.cores: float = 0.0  # the latest figure

    @classmethod
    def for_this_process(cls) -> BusyElsewhere | None:
        """A reader of the CPUs this process may run on; None where there is no ``/proc/stat`` or a CPU
        quota allows fewer cores than the affinity holds."""
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        if not cpus or usable_cores() < len(cpus) or not Path("/proc/stat").exists():
            return None
        return cls(cpus, ticks_per_s=float(os.sysconf("SC_CLK_TCK")))

    def _reading(self) -> tuple[float, float, float]:
        return self._clock(), busy_seconds(self._read_stat(), self.cpus, self.ticks_per_s), self._own_seconds()

    def free_cores(self) -> float:
        """The CPUs this process may run on less those others kept busy (``__call__``), at most its
        cgroup's quota as last read."""
        free = len(self.cpus) - self()
        return free if self.quota is None else min(free, self.quota)

    def __call__(self) -> float:
        """Cores other processes kept busy between the previous reading and now (the previous figure
        while less than ``min_interval_s`` passed)."""
        if self._clock() - self._last[0] < self.min_interval_s:
            return self.cores
        now = self._reading()
        wall = now[0] - self._last[0]
        others = (now[1] - self._last[1]) - (now[2] - self._last[2])
        self._last, self.cores = now, max(0.0, others / wall)
        self.quota = self._read_quota()
        return self.cores
