#!/usr/bin/env bash
# The device check (make device-check): on a CUDA machine, in one command and under ~8 minutes on one
# H200, it installs what it needs (torch with CUDA), builds the demo models, runs the equivalence tests
# on the GPU in float32, then the attention-path, decode and first-vs-follow-up benchmarks, and prints
# one table. Without a CUDA device it says so, runs the CPU smoke (the operator-count test) and exits 0.
# Logs: benchmarks/results/device_check/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${VENV:-.venv}/bin/python
LOGS=benchmarks/results/device_check
mkdir -p "$LOGS"

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device-check: no CUDA device on this machine; CPU smoke only (operator count of one decode step)"
    make install >/dev/null || exit 1
    exec "$PY" -m pytest tests/unit/model/test_op_count.py -q -s -p no:cacheprovider
fi

# torch from PyPI with its CUDA libraries (the Makefile's default is the CPU build)
make install TORCH="${TORCH:-torch}" || exit 1
"$PY" -c 'import torch; assert torch.cuda.is_available(), "torch was installed without CUDA"' || exit 1
"$PY" -m model_store.build_models --only tiny >/dev/null && "$PY" -m model_store.build_models --only bench >/dev/null

declare -A STATUS
stage() {  # stage NAME COMMAND...: runs it with its log under $LOGS, records pass/fail
    local name=$1
    shift
    echo "== $name: $*"
    if (set -o pipefail; "$@" 2>&1 | tee "$LOGS/$name.log"); then STATUS[$name]=pass; else STATUS[$name]=FAIL; fi
}

# Equivalence on the GPU: float32 (RESIDENT_TEST_DTYPE, see tests/conftest.py), so the tests' token-exact
# references hold; the batched path runs with CUDA graphs there (RESIDENT_ATTENTION=auto on CUDA).
stage equivalence env RESIDENT_TEST_DTYPE=float32 "$PY" -m pytest -q -p no:cacheprovider -k "not compiled" \
    tests/unit/model/test_op_count.py tests/unit/model/test_kv_cache.py tests/integration/test_decode_paths.py \
    tests/integration/test_engine.py tests/integration/test_memory.py tests/integration/test_text_families.py
stage attention_paths "$PY" -m benchmarks.attention_paths --levels 1 16 --device cuda --threads 0
stage decode "$PY" -m benchmarks.decode --levels 1 4 16 --dtype float32
stage first_vs_followup "$PY" -m benchmarks.first_vs_followup --start-server

"$PY" - "${STATUS[equivalence]}" "${STATUS[attention_paths]}" "${STATUS[decode]}" "${STATUS[first_vs_followup]}" <<'PY'
import json, sys
from pathlib import Path

import torch

from benchmarks.common import format_table

results = Path("benchmarks/results")
status = dict(zip(["equivalence", "attention_paths", "decode", "first_vs_followup"], sys.argv[1:]))


def load(name):
    path = results / name
    return json.loads(path.read_text()) if path.exists() else {}


rows = [["equivalence tests (CUDA, float32)", status["equivalence"], "see benchmarks/results/device_check/equivalence.log"]]
for key, r in load("attention_paths.json").get("results", {}).items():
    rows.append([f"decode step, batch {key}", status["attention_paths"],
                 f"per_row {1000 * r['per_row_s']:.2f} ms, batched {1000 * r['batched_s']:.2f} ms"])
decode = load("decode.json").get("results", {})
for level, r in decode.get("ours", {}).items():
    rows.append([f"engine decode, {level} sessions", status["decode"],
                 f"{1000 * r['per_token_s']:.2f} ms/token, {r['tokens_per_s']:.0f} tokens/s"])
fvf = load("first_vs_followup.json")
if fvf:
    rows.append(["first vs follow-up", status["first_vs_followup"],
                 f"first {fvf['first_s']:.3f} s, follow-up {fvf['followup_s']:.3f} s "
                 f"({fvf['ratios']['first_s / followup_s']:.1f}x)"])
print()
print(f"device check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
print(format_table(["check", "result", "numbers"], rows))
sys.exit(0 if all(s == "pass" for s in status.values()) else 1)
PY
