#!/usr/bin/env bash
# The device check (docs/DEVICE_CHECK.md; make device-check). On a CUDA machine, in one command and a few
# minutes on one H200, benchmarks/device_check.py builds a LLaVA-1.5-7B-shaped model and a 2-layer
# Llama-3-8B slice with random bfloat16 weights on the GPU and prints one table: the decode paths against
# transformers, host syncs, attention kernels, timings against the bandwidth floor and transformers, and
# memory across the engine's start-up, a demote/restore and an adapter load. Without a CUDA device it says
# so and runs the same stages on tiny shapes on the CPU (the CPU smoke): exit 0 when the smoke passes.
#
#   PYTHON=<a python that has torch> [WHEELS=<dir>] scripts/device_check.sh [benchmarks/device_check.py options]
#
# It installs nothing but wheels from WHEELS (pip --no-index --find-links: no network), only for the
# modules PYTHON lacks, into DEPS (build/device-check-deps) on PYTHONPATH: PYTHON's own environment is
# left as it is. No Java, no TorchServe. scripts/device_wheels.sh DIR fetches the wheels a lent GPU image
# lacks, on a machine with PyPI. Logs and JSON: benchmarks/results/device_check/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
DEPS=${DEPS:-build/device-check-deps}
case $DEPS in /*) ;; *) DEPS=$PWD/$DEPS ;; esac
LOGS=benchmarks/results/device_check
mkdir -p "$LOGS"

if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "device-check: $PYTHON cannot import torch; run with PYTHON=<a python that has torch>" >&2
    exit 2
fi

# What the check imports besides torch (and the standard library), by requirement; only what PYTHON lacks.
missing=$("$PYTHON" - <<'PY'
import importlib.util

needed = {"transformers": "transformers>=5,<6", "safetensors": "safetensors", "cachetools": "cachetools>=5"}
print(" ".join(req for module, req in needed.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    if [ -z "${WHEELS:-}" ]; then
        echo "device-check: $PYTHON lacks $missing; fetch their wheels with scripts/device_wheels.sh DIR" \
             "(on a machine with PyPI) and run with WHEELS=DIR" >&2
        exit 2
    fi
    echo "device-check: installing $missing from $WHEELS into $DEPS"
    read -ra requirements <<<"$missing"
    rm -rf "$DEPS"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" \
        --target "$DEPS" "${requirements[@]}" || exit 1
    export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "device-check: no CUDA device on this machine (torch.cuda.is_available() is false):" \
         "CPU smoke only, the same stages on tiny shapes"
    "$PYTHON" -m benchmarks.device_check --tiny --device cpu "$@" 2>&1 | tee "$LOGS/cpu_smoke.log"
    exit "${PIPESTATUS[0]}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PYTHON" -m benchmarks.device_check "$@" 2>&1 | tee "$LOGS/device_check.log"
exit "${PIPESTATUS[0]}"
