"""The cores this process may use: its CPU affinity, and its container's CPU quota (cgroup).

A container started with ``--cpus 1.5`` (or a Kubernetes CPU limit, or SageMaker's instance share)
sees every core of the host in ``os.sched_getaffinity`` but may run only 1.5 cores' worth per period:
OpenMP threads beyond that are throttled for the rest of each period and a decode step's barrier waits
for the slowest. The quota lives in the cgroup filesystem: ``cpu.max`` ("<quota> <period>" or
"max <period>") under cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under v1. A nested
cgroup's limit is the smallest along its path, so every level from the process's own to the root is
read.

Who calls this: session/model/threads.py (``cpu_candidates``), once at start-up, and
session/model/cpu_load.py with each load reading (a quota set or lifted later). Pure file reads; the
root is a parameter so tests build a fake cgroup tree.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Cores this process may keep busy: its affinity, capped by its cgroup's quota rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root, proc_cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """Cores' worth of CPU time per period the process's cgroup allows (the smallest along its path), or
    None when no quota is set or none can be read."""
    limits = [limit for folder in _cgroup_folders(root, proc_cgroup) if (limit := _quota_in(folder)) is not None]
    return min(limits, default=None)


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """The process's cgroup folder and each one above it up to the root (v2, or v1's cpu controller)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return [root]
    for line in lines:  # "0::/path" (v2) or "4:cpu,cpuacct:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = root
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in ("cpu,cpuacct", "cpu") if (root / name).is_dir()), root / "cpu")
        else:
            continue
        folder = base / path.lstrip("/")
        return [folder, *[p for p in folder.parents if p.is_relative_to(base)]]
    return [root]


def _quota_in(folder: Path) -> float | None:
    try:
        quota_text, period_text = (folder / "cpu.max").read_text().split()[:2]
        return None if quota_text == "max" else int(quota_text) / int(period_text)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
