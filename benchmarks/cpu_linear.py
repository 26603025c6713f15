"""CPU linears: torch's ``F.linear`` on dense weights vs oneDNN on weights packed once (RESIDENT_PACK_WEIGHTS).

Workload: every linear of a language model (its layers' projections and the head), run in turn for
M rows, as one decode step of M sessions runs them; the weights exceed the caches, so each product
streams its weight from memory. Each round times both layouts back to back, so background load hits
both alike; the table gives the median ms per pass, the weight bytes per second, and dense / packed.

Run: python -m benchmarks.cpu_linear [--model-path models/text-bench] [--rows 1 16] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import REPO, format_table, median, write_json
from session.packed_linear import can_pack

TEXT_BENCH = REPO / "models" / "text-bench"


def linears(model_path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The dense weights [out, in] of the language model's linears and head, in forward order."""
    from session.model_runner import ModelRunner

    runner = ModelRunner(model_path, device="cpu", dtype=str(dtype).removeprefix("torch."), pack_weights=False)
    modules = [m for layer in runner.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    return [m.weight.detach() for m in modules + [runner.lm_head]]


def time_pass(weights: list[torch.Tensor], packed: list[torch.Tensor] | None, rows: int) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    began = time.perf_counter()
    if packed is None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
    else:
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(TEXT_BENCH))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    table, results = [], []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        if not can_pack(torch.device("cpu"), dtype):
            print(f"{dtype}: no oneDNN packing on this torch build; skipped")
            continue
        weights = linears(args.model_path, dtype)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous()) for w in weights]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                times = {"dense": [], "packed": []}
                for _ in range(args.rounds + 2):
                    times["dense"].append(time_pass(weights, None, rows))
                    times["packed"].append(time_pass(weights, packed, rows))
                dense, fast = median(times["dense"][2:]), median(times["packed"][2:])
                results.append({"dtype": str(dtype), "threads": threads, "rows": rows, "dense_s": dense,
                                "packed_s": fast, "weight_bytes": nbytes})
                table.append([str(dtype).removeprefix("torch."), threads, rows, dense * 1e3, fast * 1e3,
                              nbytes / dense / 1e9, nbytes / fast / 1e9, dense / fast])
    print(format_table(["dtype", "threads", "rows", "dense ms", "packed ms", "dense GB/s", "packed GB/s",
                        "dense / packed"], table))
    write_json(args.out / "cpu_linear.json", {"settings": vars(args) | {"out": str(args.out)}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
