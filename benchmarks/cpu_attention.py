"""bfloat16 decode attention on CPU: torch's flash kernel, one call per row (what transformers runs and what
our per-row path ran before), against our kernel, one call for all rows (session/model/cpu/attention.py).

Each row: one query token over ``--context`` keys, ``--heads`` heads of ``--head-dim``, its keys in a
head-major pool of 256-token blocks. Both are timed interleaved in the same loop (median of
``--repeats``) and their outputs compared bit for bit.

Run: python -m benchmarks.cpu_attention [--rows 1 16] [--context 600] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import REPO, format_table, median, write_json

BLOCK_TOKENS = 256


def case(rows: int, context: int, heads: int, head_dim: int, seed: int = 0):
    """Queries [rows, H, hd], each row's keys and values [H, context, hd], and the same in a pool."""
    generator = torch.Generator().manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)
    q = rand(rows, heads, head_dim)
    keys = [rand(heads, context, head_dim) for _ in range(rows)]
    values = [rand(heads, context, head_dim) for _ in range(rows)]
    blocks = -(-context // BLOCK_TOKENS)
    k_pool = torch.zeros(heads, rows * blocks + 1, BLOCK_TOKENS, head_dim, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    table = torch.zeros(rows, blocks, dtype=torch.int32)
    for row in range(rows):
        for index in range(blocks):
            block = 1 + row + index * rows  # rows' blocks interleave, as sessions grown side by side
            table[row, index] = block
            chunk = slice(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS)
            k_pool[:, block, : keys[row][:, chunk].shape[1]] = keys[row][:, chunk]
            v_pool[:, block, : values[row][:, chunk].shape[1]] = values[row][:, chunk]
    return q, keys, values, k_pool, v_pool, table


def measure(rows: int, context: int, heads: int, head_dim: int, repeats: int) -> dict:
    from session.model.cpu import attention as cpu_attention

    q, keys, values, k_pool, v_pool, table = case(rows, context, heads, head_dim)
    scale = head_dim ** -0.5
    starts = torch.zeros(rows, dtype=torch.int32)
    ends = torch.full((rows,), context, dtype=torch.int32)

    def torch_per_row():
        return torch.stack([F.scaled_dot_product_attention(q[b: b + 1, :, None], keys[b][None], values[b][None],
                                                           scale=scale)[0, :, 0] for b in range(rows)])

    def ours():
        return cpu_attention.decode_attention(q, k_pool, v_pool, table, starts, ends, scale)

    times = {"torch": [], "ours": []}
    for step in range(repeats + 3):  # the first three warm up
        for name, run in (("torch", torch_per_row), ("ours", ours)):
            began = time.perf_counter()
            run()
            if step >= 3:
                times[name].append(time.perf_counter() - began)
    same = torch.equal(torch_per_row(), ours())
    return {"rows": rows, "context": context, "torch_us": 1e6 * median(times["torch"]),
            "ours_us": 1e6 * median(times["ours"]), "bit_identical": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    from session.model.cpu import attention as cpu_attention

    if not cpu_attention.load():
        print("the kernel cannot be built or used here (see the log)")
        return 1
    torch.set_num_threads(args.threads)
    results = [measure(rows, args.context, args.heads, args.head_dim, args.repeats) for rows in args.rows]
    print(format_table(["rows", "context", "torch flash, per row (us)", "ours, one call (us)", "torch / ours",
                        "bit-identical"],
                       [[r["rows"], r["context"], f"{r['torch_us']:.0f}", f"{r['ours_us']:.0f}",
                         f"{r['torch_us'] / r['ours_us']:.1f}", r["bit_identical"]] for r in results]))
    write_json(args.out / "cpu_attention.json", {"threads": args.threads, "heads": args.heads,
                                                  "head_dim": args.head_dim, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
