"""The container's CPU quota from fake cgroup trees (v2 and v1, nested), and the cores it leaves."""

from __future__ import annotations

import os

from session.model.cpu_quota import cgroup_cpu_quota, usable_cores


def tree(tmp_path, proc: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc").write_text(proc)
    return root, tmp_path / "proc"


def test_v2_quota_and_the_smallest_along_a_nested_path(tmp_path):
    root, proc = tree(tmp_path, "0::/pod/app\n", {"cpu.max": "max 100000\n", "pod/cpu.max": "150000 100000\n",
                                                  "pod/app/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert usable_cores(root, proc) == min(2, len(os.sched_getaffinity(0)))


def test_v2_without_a_quota_is_none_and_leaves_the_affinity(tmp_path):
    root, proc = tree(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cores(root, proc) == len(os.sched_getaffinity(0))


def test_v1_cfs_quota(tmp_path):
    root, proc = tree(tmp_path, "5:memory:/x\n4:cpu,cpuacct:/docker/abc\n",
                      {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
                       "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                       "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root, proc) == 0.5
    assert usable_cores(root, proc) == 1


def test_an_unreadable_tree_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "missing") is None
