"""launch/cluster.py: how many backends, their ports and per-backend settings."""

from __future__ import annotations

import os

import pytest

from launch.cluster import Devices, backend_base_port, backend_env, num_backends
from session.errors import ConfigError

CUDA, NEURON, CPU = Devices("cuda", 2), Devices("neuron", 4), Devices("cpu", 1)


def test_num_backends():
    assert num_backends("3", CPU) == 3
    assert num_backends("auto", CUDA) == 2
    assert num_backends(" AUTO ", CPU) == 1
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ConfigError, match="BACKENDS"):
            num_backends(bad, CPU)


def test_backend_ports():
    assert backend_base_port(8080, {}) == 8090
    assert backend_base_port(8080, {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999"}) == 29000
    assert backend_base_port(8080, {"SAGEMAKER_SAFE_PORT_RANGE": "29000-29999", "RESIDENT_BACKEND_PORT": "7000"}) \
        == 7000


def test_each_backend_gets_its_device_or_its_share_of_the_cores():
    assert [backend_env(i, 3, CUDA, {}) for i in range(3)] == [
        {"RESIDENT_DEVICE": "cuda:0"}, {"RESIDENT_DEVICE": "cuda:1"}, {"RESIDENT_DEVICE": "cuda:0"}]
    assert backend_env(1, 2, CUDA, {"RESIDENT_DEVICE": "cpu"}) == {}  # the caller's choice stands
    assert backend_env(3, 4, NEURON, {}) == {"NEURON_RT_VISIBLE_CORES": "3"}
    assert backend_env(0, 2, CPU, {}) == {"RESIDENT_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    assert backend_env(0, 2, CPU, {"RESIDENT_THREADS": "8"}) == {}


def test_each_backend_gets_its_own_journal():
    env = {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident", "RESIDENT_THREADS": "1"}
    assert [backend_env(i, 2, CPU, env) for i in range(2)] == [
        {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident/backend-0"},
        {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident/backend-1"}]
