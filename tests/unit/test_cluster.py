"""launch/cluster.py: how many backends, their ports and per-backend settings."""

from __future__ import annotations

import os

import pytest

from launch import cluster
from launch.cluster import Devices, backend_base_port, backend_env, num_backends, session_id_tag, write_admin_token
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


def settings(index, num, devices, environ):
    """backend_env without the session id tag (tested on its own below)."""
    env = backend_env(index, num, devices, environ)
    assert env.pop("RESIDENT_SESSION_ID_TAG") == session_id_tag(index, environ)
    return env


def test_each_backend_gets_its_device_or_its_share_of_the_cores():
    assert [settings(i, 3, CUDA, {}) for i in range(3)] == [
        {"RESIDENT_DEVICE": "cuda:0"}, {"RESIDENT_DEVICE": "cuda:1"}, {"RESIDENT_DEVICE": "cuda:0"}]
    assert settings(1, 2, CUDA, {"RESIDENT_DEVICE": "cpu"}) == {}  # the caller's choice stands
    assert settings(3, 4, NEURON, {}) == {"NEURON_RT_VISIBLE_CORES": "3"}
    assert settings(0, 2, CPU, {}) == {"RESIDENT_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
    assert settings(0, 2, CPU, {"RESIDENT_THREADS": "8"}) == {}


def test_each_backend_gets_its_own_journal():
    env = {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident", "RESIDENT_THREADS": "1"}
    assert [settings(i, 2, CPU, env) for i in range(2)] == [
        {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident/backend-0"},
        {"RESIDENT_JOURNAL_DIR": "/dev/shm/resident/backend-1"}]


def test_each_backend_tags_the_session_ids_it_creates():
    assert [backend_env(i, 3, CPU, {})["RESIDENT_SESSION_ID_TAG"] for i in range(3)] == ["b0", "b1", "b2"]
    assert session_id_tag(1, {"RESIDENT_INSTANCE_TAG": "ia"}) == "iab1"
    with pytest.raises(ConfigError, match="RESIDENT_INSTANCE_TAG"):
        session_id_tag(0, {"RESIDENT_INSTANCE_TAG": "a-b"})


def test_the_admin_token_is_written_for_the_operator_only(tmp_path):
    path = write_admin_token(tmp_path / "cluster-8080", "s3cret")
    assert path.read_text() == "s3cret\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert write_admin_token(tmp_path / "cluster-8080", "other").read_text() == "other\n"


def test_a_front_alone_shares_the_backends_admin_token(monkeypatch):
    seen = []
    monkeypatch.setattr(cluster, "_serve", lambda config, host, port: seen.append(config.admin_token) or 0)
    env = {"RESIDENT_FRONT_BACKENDS": "http://127.0.0.1:1"}
    assert cluster.run_front(8080, {**env, "RESIDENT_ADMIN_TOKEN": "shared"}) == 0
    assert cluster.run_front(8080, {**env, "RESIDENT_ADMIN_TOKEN": "shared", "RESIDENT_FRONT_ADMIN_TOKEN": "own"}) == 0
    assert cluster.run_front(8080, env) == 0
    assert seen == ["shared", "own", ""]
