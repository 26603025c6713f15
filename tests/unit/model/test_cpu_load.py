"""BusyElsewhere reads /proc/stat's per-CPU busy time less this process's own, over wall time."""

from __future__ import annotations

from session.model.cpu_load import BusyElsewhere, busy_seconds

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 {a} 0 {s} 2500 5 0 0 0 0 0
cpu1 {b} 0 100 2500 5 0 0 0 0 0
intr 12345
"""


def stat(a: int, b: int, s: int = 100) -> str:
    return STAT.format(a=a, b=b, s=s)


def test_busy_seconds_sums_the_busy_fields_of_the_chosen_cpus():
    text = stat(400, 300)
    assert busy_seconds(text, {0}, 100.0) == (400 + 100) / 100  # user + system; idle and iowait left out
    assert busy_seconds(text, {0, 1}, 100.0) == (400 + 100 + 300 + 100) / 100
    assert busy_seconds(text, {5}, 100.0) == 0.0  # the aggregate "cpu" line never counts


class Machine:
    def __init__(self):
        self.now, self.cpu0, self.cpu1, self.own = 0.0, 0, 0, 0.0
        self.quota: float | None = None

    def reader(self) -> BusyElsewhere:
        return BusyElsewhere({0, 1}, read_stat=lambda: stat(self.cpu0, self.cpu1, 0),
                             own_seconds=lambda: self.own, clock=lambda: self.now, ticks_per_s=100.0,
                             read_quota=lambda: self.quota)


def test_a_neighbour_on_one_core_reads_as_one_core_busy_elsewhere():
    machine = Machine()
    load = machine.reader()
    machine.now, machine.cpu0, machine.cpu1, machine.own = 2.0, 200, 150, 1.5  # 2 s: ours 1.5 s, a loop 2 s
    assert load() == 2.0 / 2.0 and load.free_cores() == 1.0  # (3.5 s busy - 1.5 s ours) / 2 s
    machine.now = 2.1  # under min_interval_s: the previous figure
    machine.cpu1 += 10
    assert load() == 1.0
    machine.now, machine.cpu0, machine.own = 4.0, 350, 3.0  # it stopped: 0.1 s of others since 2.0
    assert round(load(), 6) == round(((150 + 10) / 100 - 1.5) / 2.0, 6) == 0.05


def test_our_own_threads_never_count_as_a_neighbour():
    machine = Machine()
    load = machine.reader()
    machine.now, machine.cpu0, machine.cpu1, machine.own = 1.0, 100, 100, 2.0  # two threads of ours, 1 s
    assert load() == 0.0


def test_a_quota_set_after_start_up_caps_the_free_cores_until_it_lifts():
    """A throttled process crowds no core (others' busy time stays 0): only the cgroup's quota, re-read
    with each reading, tells the tuner that two threads would wait for the period's end."""
    machine = Machine()
    load = machine.reader()
    machine.now, machine.cpu0, machine.cpu1, machine.own = 1.0, 50, 50, 1.0  # ours, 1 s of CPU in 1 s
    assert load.free_cores() == 2.0
    machine.quota = 1.0  # docker update --cpus 1
    machine.now, machine.cpu0, machine.own = 1.1, 60, 1.1  # under min_interval_s: not read yet
    assert load.free_cores() == 2.0
    machine.now, machine.cpu0, machine.own = 2.0, 150, 2.0
    assert load.free_cores() == 1.0 and load.quota == 1.0
    machine.quota = 1.5
    machine.now, machine.cpu0, machine.own = 3.0, 250, 3.0
    assert load.free_cores() == 1.5
    machine.quota = None  # lifted
    machine.now, machine.cpu0, machine.own = 4.0, 350, 4.0
    assert load.free_cores() == 2.0
