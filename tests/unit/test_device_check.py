"""The device check (scripts/device_check.sh, benchmarks/device_check.py) where there is no GPU.

The end-to-end test runs the script as a person would on a bare machine: a fresh venv that has torch
and nothing else, every other package installed by the script from a folder of wheels, no index, no
configured pip. The wheel folder is downloaded once (PyPI, or this machine's local index) into
build/device-check-wheels; the test skips, saying so, only when that download fails. The other tests
run the CPU smoke in this process and check the pure parts (GPU table, row lengths).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from benchmarks import device_check

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "build" / "device-check-wheels"  # git-ignored, kept between runs
# transformers as the lent GPU image has it (docs/DEVICE_CHECK.md), so the fresh venv runs the check with
# the library version the GPU run gets; torch and the rest as in this project's venv
LENT_TRANSFORMERS = "5.17.0"
ROWS = [  # rows the CPU smoke must print, each with its result
    ("device", "info"),
    ("llama-tiny-gqa: build", "pass"),
    ("llama-tiny-gqa: paths vs transformers, batch 1", "pass"),
    ("llama-tiny-gqa: paths vs transformers, batch 3", "pass"),
    ("llama-tiny-gqa: paths vs transformers, batch 16", "pass"),
    ("llama-tiny-gqa: packed step vs apart", "pass"),
    ("llava-tiny: build", "pass"),
    ("llava-tiny: paths vs transformers, batch 16", "pass"),
    ("llava-tiny: packed step vs apart", "pass"),
    ("llava-tiny: host syncs", "n/a"),
    ("llava-tiny: KV pool read by", "info"),
    ("llava-tiny: attention kernels, decode eager", "info"),
    ("llava-tiny: attention kernels, prefill 40", "info"),
    ("llava-tiny: first turn, 40 tokens with an image", "info"),
    ("llava-tiny: follow-up, 20 tokens after 40", "info"),
    ("llava-tiny: verify, 5 tokens after 60", "info"),
    ("llava-tiny: decode, batch 1, 40-token contexts", "info"),
    ("llava-tiny: decode, batch 16, 40-token contexts", "info"),
    ("llava-tiny: memory after the KV reserve", "info"),
    ("llava-tiny: memory after capturing every bucket", "info"),
    ("llava-tiny: memory a 400-token session resident", "info"),
    ("llava-tiny: memory demoted", "pass"),
    ("llava-tiny: memory restored from host", "pass"),
    ("llava-tiny: memory one adapter load (rank 4)", "pass"),
]


def isolated_pip_env(**extra: str) -> dict[str, str]:
    """This environment without pip's configuration (no index, no find-links, no constraints) nor a
    PYTHONPATH: an install sees only the wheel folder it is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"} | extra


def download_wheels() -> Path:
    """The wheel folder: torch as installed here (the CPU build), transformers as on the lent image, the
    rest as the script asks for them; binary wheels only. Skips the test when pip cannot download them."""
    requirements = [f"torch=={version('torch')}", f"transformers=={LENT_TRANSFORMERS}", "safetensors", "cachetools>=5"]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest",
                           str(WHEELS), *requirements], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.skip(f"pip download of the wheel folder failed (no package index reachable?): {done.stderr[-600:]}")
    return WHEELS


def parse_table(stdout: str) -> dict[str, str]:
    """check -> result, from the device check's table: its columns are where the rule's dashes are."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["check", "result", "numbers"])
    check_width, result_width = (len(dashes) for dashes in lines[header + 1].split()[:2])
    rows = {}
    for line in lines[header + 2:]:
        if not line.strip():
            break
        rows[line[:check_width].rstrip()] = line[check_width + 2:check_width + 2 + result_width].strip()
    return rows


@pytest.mark.timeout(900)
def test_a_bare_machine_runs_the_cpu_smoke_from_a_wheel_folder(tmp_path):
    wheels = download_wheels()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                    f"torch=={version('torch')}"], check=True, env=isolated_pip_env(), timeout=600)
    done = subprocess.run([str(REPO / "scripts" / "device_check.sh")], capture_output=True, text=True, timeout=600,
                          env=isolated_pip_env(PYTHON=str(python), WHEELS=str(wheels), DEPS=str(tmp_path / "deps")))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "installing transformers>=5,<6 safetensors cachetools>=5 from" in out
    assert "device-check: no CUDA device on this machine (torch.cuda.is_available() is false)" in out
    assert f"transformers {LENT_TRANSFORMERS}" in out  # the wheel folder's, not this project's venv's
    rows = parse_table(out)
    assert {check: rows.get(check) for check, _ in ROWS} == dict(ROWS)
    assert "FAIL" not in rows.values()
    assert f"{len(rows)} rows, 0 FAIL" in out
    assert not (venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
                / "transformers").exists()  # installed beside the venv (DEPS), not into it


def test_the_cpu_smoke_passes_in_process(tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert device_check.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)  # the smoke runs on one thread; the tests after it get theirs back
    out = capsys.readouterr().out
    rows = parse_table(out)
    assert {check: rows.get(check) for check, _ in ROWS} == dict(ROWS)
    saved = json.loads((tmp_path / "device_check_tiny.json").read_text())
    assert saved["shapes"] == "tiny" and [row[:2] for row in saved["rows"]] == [[c, r] for c, r in rows.items()]
    pool_read = {row[0]: row[2] for row in saved["rows"]}["llava-tiny: KV pool read by"]
    assert pool_read.startswith("each row's runs of blocks in place")  # the CPU's per-row path
    equivalence = saved["results"]["llama-tiny-gqa: paths vs transformers, batch 16"]["by_path"]
    assert set(equivalence) == {"batched", "per_row", "prefill"}  # no graph replay without CUDA
    assert all(e["max_rel_error"] < 1e-4 and e["agreement"] == 1.0 for e in equivalence.values())
    memory = saved["results"]
    assert memory["llava-tiny: memory demoted"]["held"] == 0  # every block back in the pool
    assert memory["llava-tiny: memory restored from host"]["held"] == memory["llava-tiny: memory a 400-token session resident"]["held"]


def test_device_wheels_fetches_cachetools_for_the_lent_image(tmp_path):
    done = subprocess.run([str(REPO / "scripts" / "device_wheels.sh"), str(tmp_path / "w")], capture_output=True,
                          text=True, timeout=300, env=os.environ | {"PYTHON": sys.executable})
    if done.returncode != 0 and "ERROR" in done.stderr and "No matching distribution" not in done.stderr:
        pytest.skip(f"pip download failed (no package index reachable?): {done.stderr[-600:]}")
    assert done.returncode == 0, done.stderr
    wheels = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert len(wheels) == 1 and wheels[0].startswith("cachetools-") and wheels[0].endswith("-py3-none-any.whl")
    assert "holds 1 MiB" in done.stdout


def test_known_gpus_match_their_own_names_only():
    assert device_check.known_gpu("NVIDIA H200") == (4.8e12, 989e12)
    assert device_check.known_gpu("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert device_check.known_gpu("NVIDIA H100 PCIe") == (2.0e12, 756e12)
    assert device_check.known_gpu("NVIDIA L40S") == (0.864e12, 362e12)
    assert device_check.known_gpu("NVIDIA L4") == (0.3e12, 121e12)
    assert device_check.known_gpu("NVIDIA A100-SXM4-80GB") == (2.039e12, 312e12)
    assert device_check.known_gpu("NVIDIA A10G") == (0.6e12, None)
    assert device_check.known_gpu("NVIDIA GH200 480GB") is None  # not an H200: measured instead
    assert device_check.known_gpu("Tesla T4") is None


def test_each_row_crosses_a_block_boundary_within_the_steps_compared():
    block, steps = 256, device_check.GPU_SHAPES.decode_steps
    lengths = device_check.row_lengths(16, block)
    assert lengths[:4] == [255, 510, 765, 252]
    # the prefill ends in one block, and a decode step among those compared writes the next block's first slot
    assert all(n % block != 0 and (n // block) < ((n + steps - 1) // block) for n in lengths)
