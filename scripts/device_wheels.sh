#!/usr/bin/env bash
# The wheels the device check (scripts/device_check.sh) needs that a lent GPU machine's image lacks, for
# that image's Python (CPython 3.12, manylinux x86_64), downloaded into DIR on a machine with PyPI. Carry
# DIR to the GPU machine (no network there) and run: PYTHON=python3 WHEELS=DIR scripts/device_check.sh
#
#   scripts/device_wheels.sh DIR [REQUIREMENT...]
#
# By default only cachetools (session/state/store.py imports it; the image has torch, transformers,
# safetensors and the rest: docs/DEVICE_CHECK.md). More requirements may be named, and their dependencies
# come along. Binary wheels only, and at most 64 MiB in DIR; PY_VERSION picks another Python (3.12).
set -euo pipefail
DIR=${1:?usage: scripts/device_wheels.sh DIR [REQUIREMENT...]}
shift
PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}
MAX_MIB=64
if [ "$#" -eq 0 ]; then
    set -- "cachetools>=5"
fi
mkdir -p "$DIR"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$DIR" --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp --abi "cp${PY_VERSION/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
ls -l "$DIR"
mib=$(du -sm "$DIR" | cut -f1)
if [ "$mib" -gt "$MAX_MIB" ]; then
    echo "device-wheels: $DIR holds $mib MiB, over $MAX_MIB MiB" >&2
    exit 1
fi
echo "device-wheels: $DIR holds $mib MiB; on the GPU machine: PYTHON=python3 WHEELS=$DIR scripts/device_check.sh"
