"""Shape buckets: the fixed sizes that compiled graphs and CUDA graphs are made for.

A step of any size runs in the smallest bucket that holds it (padded up), so a compiler or a graph
capture sees a few shapes instead of every size. Used by CUDA graphs (batch sizes, block-table
widths) and fixed-shape steps (prompt lengths, batch sizes).
"""

from __future__ import annotations

import bisect


def power_buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit`` itself."""
    buckets, size = [], smallest
    while size < limit:
        buckets.append(size)
        size *= 2
    return (*buckets, limit)


def bucket_for(size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest of the sorted ``buckets`` that holds ``size``, or None when none does (the
    caller decides: CUDA graphs fall back to eager, a fixed-shape step refuses)."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None
