"""CPU linears: torch's ``F.linear`` on dense weights vs oneDNN on weights packed once (RESIDENT_PACK_WEIGHTS)
vs our kernel on weights packed for it (session/model/cpu/linear.py, RESIDENT_CPU_KERNELS).

Workload: every linear of a language model (its layers' projections and the head), run in turn for
M rows, as one decode step of M sessions runs them; the weights exceed the caches, so each product
streams its weight from memory. Each round times both layouts back to back, so background load hits
both alike; the table gives the median ms per pass, the weight bytes per second, dense / packed, and
ours and whether its outputs equal oneDNN's bit for bit (one row: the one-row block size;
several: the several-row one, as ``KernelLinear`` picks them).

Run: python -m benchmarks.cpu_linear [--model-path models/text-bench] [--rows 1 16 600] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import REPO, TEXT_BENCH_MODEL, ensure_bench_model, format_table, median, write_json
from session.model.cpu import linear as cpu_linear
from session.model.cpu.packed_linear import can_pack


def linears(model_path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The dense weights [out, in] of the language model's linears and head, in forward order."""
    from session.model.runner import ModelRunner

    runner = ModelRunner(model_path, device="cpu", dtype=str(dtype).removeprefix("torch."), pack_weights=False)
    modules = [m for layer in runner.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    return [m.weight.detach() for m in modules + [runner.lm_head]]


def run_pass(weights: list[torch.Tensor], how: str, packed: list | None, inputs: dict) -> list[torch.Tensor]:
    """Every linear once on ``inputs`` [rows, in]: "dense" (F.linear), "packed" (oneDNN), "ours"
    (packed: (our packed weight, block size) per linear)."""
    if how == "dense":
        return [F.linear(inputs[w.shape[1]], w) for w in weights]
    if how == "packed":
        return [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, packed)]
    return [cpu_linear.linear(inputs[w.shape[1]], p, None, w.shape[0], block) for w, (p, block) in zip(weights, packed)]


def ours_packed(weights: list[torch.Tensor], rows: int) -> list | None:
    """Our packing and block size per linear (the runner's choice for ``rows`` rows), or None where the
    kernel or the probe says no for any of them."""
    dtype = weights[0].dtype
    if not cpu_linear.load(dtype):
        return None
    blocking = cpu_linear.blockings({tuple(w.shape) for w in weights}, dtype=dtype)
    if len(blocking) < len({tuple(w.shape) for w in weights}):
        return None
    return [(cpu_linear.pack(w), blocking[tuple(w.shape)].one_row if rows == 1 else blocking[tuple(w.shape)].rows)
            for w in weights]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=str(TEXT_BENCH_MODEL))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 600])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    ensure_bench_model(args.model_path)
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
                inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
                ours = ours_packed(weights, rows)
                layouts = {"dense": None, "packed": packed} | ({"ours": ours} if ours else {})
                times = {how: [] for how in layouts}
                with torch.inference_mode():
                    for _ in range(args.rounds + 2):
                        for how, layout in layouts.items():
                            began = time.perf_counter()
                            run_pass(weights, how, layout, inputs)
                            times[how].append(time.perf_counter() - began)
                    same = ours and all(torch.equal(a, b) for a, b in zip(run_pass(weights, "ours", ours, inputs),
                                                                           run_pass(weights, "packed", packed, inputs)))
                dense, fast = median(times["dense"][2:]), median(times["packed"][2:])
                mine = median(times["ours"][2:]) if ours else None
                results.append({"dtype": str(dtype), "threads": threads, "rows": rows, "dense_s": dense,
                                "packed_s": fast, "ours_s": mine, "ours_equal": same, "weight_bytes": nbytes})
                table.append([str(dtype).removeprefix("torch."), threads, rows, dense * 1e3, fast * 1e3,
                              mine * 1e3 if mine else "-", nbytes / dense / 1e9, nbytes / fast / 1e9,
                              nbytes / mine / 1e9 if mine else "-", dense / fast, fast / mine if mine else "-",
                              ("yes" if same else "NO") if ours else "-"])
    print(format_table(["dtype", "threads", "rows", "dense ms", "packed ms", "ours ms", "dense GB/s", "packed GB/s",
                        "ours GB/s", "dense / packed", "packed / ours", "ours = oneDNN"], table))
    write_json(args.out / "cpu_linear.json", {"settings": vars(args) | {"out": str(args.out)}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
