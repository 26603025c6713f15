"""KV block arithmetic, written once: how many blocks of ``block_tokens`` hold a number of tokens.

Pure functions; every module that sizes KV in blocks (the block pool, the attention paths, CUDA graph
buckets, the memory plan, a turn's reservation) calls these instead of dividing itself.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """The blocks that hold ``num_tokens`` tokens, the last one possibly part full (0 for none)."""
    return -(-num_tokens // block_tokens)


def blocks_missing(num_tokens: int, block_tokens: int, have: int) -> int:
    """The blocks ``num_tokens`` tokens need beyond the ``have`` already held (never negative)."""
    return max(0, blocks_for(num_tokens, block_tokens) - have)


def slot_ids(block_ids: list[int], block_tokens: int, start: int, end: int) -> list[int]:
    """Flat slot numbers (block * block_tokens + offset) of positions start .. end-1 of a block table."""
    return [block_ids[p // block_tokens] * block_tokens + p % block_tokens for p in range(start, end)]
